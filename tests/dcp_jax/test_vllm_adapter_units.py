"""The vLLM adapter's geometry and config, without vLLM (the package's __init__ imports it): its
modules are loaded from their files under a stand-in package, restored after each test."""
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from dcp_jax.transfer import KVCacheSpec
from dcp_jax.transfer.spec import check_compatible

_DIR = Path(__file__).resolve().parents[2] / "dcp_jax" / "adapters" / "vllm"
_PKG = "dcp_jax.adapters.vllm"


@pytest.fixture
def adapter(monkeypatch):
    """``(geometry, config)`` modules of the adapter, loaded without its vLLM imports."""
    monkeypatch.setitem(sys.modules, _PKG, types.ModuleType(_PKG))  # a bare package: no vLLM import
    mods = []
    for name in ("geometry", "config"):
        spec = importlib.util.spec_from_file_location(f"{_PKG}.{name}", _DIR / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, f"{_PKG}.{name}", mod)  # (dataclasses look the module up)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


@pytest.mark.parametrize("rows", ["block", "token"])
def test_each_kv_head_shard_pairs_with_its_own(adapter, rows):
    # TP > DCP: each shard is a group of its own; declared as TP, every handshake was refused.
    geometry, _ = adapter
    prefill = geometry.Geometry(2, 2, 64, "bfloat16", 2, 16, rows, kv_head_shards=2)
    decode = geometry.Geometry(2, 2, 64, "bfloat16", 2, 16, rows, dcp_size=2, interleave_size=16, kv_head_shards=2)
    for shard in range(2):
        p = prefill.spec(0, shard)
        assert isinstance(p, KVCacheSpec) and p.tp_size == 1
        for r in range(2):
            check_compatible(p, decode.spec(r, shard), side="decode")  # whole rows, no head pairing
    with pytest.raises(ValueError, match="shard_rank=2"):
        prefill.spec(0, 2)


@pytest.mark.parametrize("over,named", [
    (dict(port=65535, tp_size=2), r"port=65535 must be an int in 1\.\.65534"),  # port + 1 would be 65536
    (dict(timeout_s=float("inf")), r"timeout_s=inf must be a number of seconds in \(0, 86400\]"),
    (dict(connect_timeout_s=1e9), "connect_timeout_s=1000000000.0"),
    (dict(host=123), "host=123 must be a non-empty str"),
    (dict(host=""), "host='' must be a non-empty str"),
    (dict(tp_rank=0.5), r"tp_rank=0\.5 must be an int >= 0"),
    (dict(dcp_rank="0"), "dcp_rank='0' must be an int >= 0"),
    (dict(dcp_rank=True), "dcp_rank=True"),
])
def test_config_values_are_refused_by_name(adapter, over, named):
    _, config = adapter
    with pytest.raises(ValueError, match=named):
        config.AdapterConfig(role="kv_producer", **over)._check()
    config.AdapterConfig(role="kv_producer", port=65534, tp_size=2)._check()  # the last port that fits


@pytest.mark.parametrize("n", [True, -1, 2.0, None])
def test_a_peer_entry_with_a_bad_token_count_is_refused(adapter, n):
    geometry, _ = adapter
    g = geometry.Geometry(2, 2, 64, "bfloat16", 2, 16)
    ok = dict(adapter_version=geometry.ADAPTER_VERSION, protocol_version=geometry.PROTOCOL_VERSION,
              geometry=g.to_dict(), addresses=["tcp://127.0.0.1:5710"], num_tokens=17)
    assert geometry.check_peer(g, ok)["num_tokens"] == 17
    with pytest.raises(geometry.PeerMismatch, match="num_tokens"):
        geometry.check_peer(g, dict(ok, num_tokens=n))
