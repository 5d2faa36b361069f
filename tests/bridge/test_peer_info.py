"""PeerInfo.to_dict / from_dict: plain types for a network control plane, everything validated."""
import json

import pytest

from bridge import BridgeError, MemoryRegion, PeerError, PeerInfo
from bridge.regions import MAX_PEER_METADATA, MAX_PEER_NAME, MAX_PEER_REGIONS, MAX_PEER_SESSION

try:
    import msgpack
except ImportError:  # pragma: no cover - the round trip through msgpack is skipped then
    msgpack = None

_INFO = PeerInfo("mooncake", "decode-3", "127.0.0.1:15001", b"\x00md\xff",
                 (MemoryRegion(4096, 1 << 20), MemoryRegion(1 << 40, 64, "VRAM", 1)))


def _good() -> dict:
    return _INFO.to_dict()


def test_to_dict_is_plain_types():
    d = _good()
    assert d == {"engine": "mooncake", "name": "decode-3", "session": "127.0.0.1:15001",
                 "metadata": b"\x00md\xff", "regions": [[4096, 1 << 20, "DRAM", 0], [1 << 40, 64, "VRAM", 1]]}
    assert all(type(x) in (int, str) for r in d["regions"] for x in r)
    json.dumps({**d, "metadata": d["metadata"].hex()})  # nothing but str / int / list besides bytes


def test_round_trip():
    assert PeerInfo.from_dict(_good()) == _INFO
    empty = PeerInfo("nixl", "p")
    assert PeerInfo.from_dict(empty.to_dict()) == empty
    d = _good()
    d["metadata"] = bytearray(d["metadata"])  # what some decoders hand back
    d["regions"] = tuple(tuple(r) for r in d["regions"])
    back = PeerInfo.from_dict(d)
    assert back == _INFO and type(back.metadata) is bytes and type(back.regions) is tuple


@pytest.mark.skipif(msgpack is None, reason="msgpack not installed")
def test_round_trip_through_msgpack():
    wire = msgpack.packb(_INFO.to_dict(), use_bin_type=True)
    assert PeerInfo.from_dict(msgpack.unpackb(wire, raw=False)) == _INFO
    # decoded with raw=True the keys are bytes: refused, not misread
    with pytest.raises(PeerError, match="missing key"):
        PeerInfo.from_dict(msgpack.unpackb(wire, raw=True))


@pytest.mark.timeout(30)
def test_real_engine_info_round_trips(two_connected_engines):
    p = two_connected_engines
    info = p.tgt.peer_info()
    d = info.to_dict()
    if msgpack is not None:
        d = msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)
    back = PeerInfo.from_dict(d)
    assert back == info
    assert p.ini.add_peer(back) == p.peer  # usable as received


def _with(**changes) -> dict:
    d = _good()
    d.update(changes)
    return d


@pytest.mark.parametrize("d, field", [
    ("not a dict", "expected a dict"),
    ([("engine", "nixl")], "expected a dict"),
    ({k: v for k, v in _good().items() if k != "session"}, r"missing key\(s\) 'session'"),
    ({**_good(), "extra": 1}, r"unknown key\(s\) 'extra'"),
    ({**_good(), 5: 1}, "unknown key"),
    (_with(engine="rdma"), "PeerInfo.engine"),
    (_with(engine=b"nixl"), "PeerInfo.engine"),
    (_with(name=""), "PeerInfo.name"),
    (_with(name="x" * (MAX_PEER_NAME + 1)), "PeerInfo.name"),
    (_with(name=7), "PeerInfo.name"),
    (_with(session="h" * (MAX_PEER_SESSION + 1)), "PeerInfo.session"),
    (_with(session=None), "PeerInfo.session"),
    (_with(metadata="text"), "PeerInfo.metadata"),
    (_with(metadata=b"\x00" * (MAX_PEER_METADATA + 1)), "PeerInfo.metadata"),
    (_with(regions={"a": 1}), "PeerInfo.regions"),
    (_with(regions=[[4096, 64, "DRAM", 0]] * (MAX_PEER_REGIONS + 1)), "PeerInfo.regions must be a list of at most"),
    (_with(regions=[[4096, 64, "DRAM"]]), r"PeerInfo.regions\[0\]"),
    (_with(regions=[[4096, 64, "DRAM", 0], "4096"]), r"PeerInfo.regions\[1\]"),
    (_with(regions=[[4096, 0, "DRAM", 0]]), r"PeerInfo.regions\[0\].*nbytes"),
    (_with(regions=[[-1, 64, "DRAM", 0]]), r"PeerInfo.regions\[0\].*addr"),
    (_with(regions=[[4096.0, 64, "DRAM", 0]]), r"PeerInfo.regions\[0\].*addr"),
    (_with(regions=[[4096, True, "DRAM", 0]]), r"PeerInfo.regions\[0\].*nbytes"),
    (_with(regions=[[4096, 64, "HBM", 0]]), r"PeerInfo.regions\[0\].*mem_type"),
    (_with(regions=[[4096, 64, "VRAM", -1]]), r"PeerInfo.regions\[0\].*device_id"),
    (_with(regions=[[(1 << 63) - 8, 64, "DRAM", 0]]), r"PeerInfo.regions\[0\].*int64"),
    (_with(regions=[[4096, 64, "DRAM", 1 << 64]]), r"PeerInfo.regions\[0\].*int64"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 40 else None)
def test_bad_fields_are_refused_by_name(d, field):
    with pytest.raises(PeerError, match=field) as info:
        PeerInfo.from_dict(d)
    assert isinstance(info.value, BridgeError)
