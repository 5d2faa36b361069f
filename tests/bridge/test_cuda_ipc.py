"""bridge.cuda_ipc without a GPU: handle checks and serialization, host identity, and every refusal
that must happen before CUDA is touched (a peer's message is validated first). The CUDA parts
run in tests/gpu/test_cuda_ipc_gpu.py."""
import os
import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge import cuda_ipc
from bridge.cuda_ipc import IPC_HANDLE_BYTES, IpcError, IpcHandle, IpcMapping, export_ipc_handles, host_info, same_host

try:
    import cupy  # noqa: F401

    HAVE_CUPY = True
except ImportError:
    HAVE_CUPY = False


def _good(**kw) -> dict:
    d = {"v": 1, "handle": bytes(range(64)), "device_id": 0, "base": 0x7F00_0000_0000, "alloc_size": 1 << 20,
         "offset": 4096, "nbytes": 65536, "pid": 4242, "host": host_info()}
    d.update(kw)
    return d


def test_host_info_is_hostname_and_boot_id():
    info = host_info()
    assert set(info) == {"hostname", "boot_id"}
    assert info["hostname"] == socket.gethostname()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert info["boot_id"] == f.read().strip() != ""


def test_same_host():
    me = host_info()
    assert same_host(me) and same_host(dict(me))
    assert same_host(IpcHandle.from_dict(_good()))
    assert not same_host({**me, "boot_id": "00000000-0000-0000-0000-000000000000"})  # same name, other boot
    assert not same_host({**me, "hostname": me["hostname"] + "-other"})
    assert not same_host({"hostname": me["hostname"]})  # malformed: not the same host
    assert not same_host({"hostname": me["hostname"], "boot_id": 7})
    with pytest.raises(TypeError, match="info must be"):
        same_host("localhost")


def test_round_trip_is_plain_types_and_exact():
    h = IpcHandle.from_dict(_good())
    d = h.to_dict()
    assert d == _good()
    assert all(isinstance(v, (int, bytes, dict)) for v in d.values())
    assert IpcHandle.from_dict(d) == h


def test_round_trip_through_msgpack():
    msgpack = pytest.importorskip("msgpack")
    h = IpcHandle.from_dict(_good(base=(1 << 64) - (1 << 21), alloc_size=1 << 20, offset=0, nbytes=1 << 20))
    assert IpcHandle.from_dict(msgpack.unpackb(msgpack.packb(h.to_dict()), raw=False)) == h


@settings(max_examples=60, deadline=None)
@given(alloc=st.integers(1, 1 << 48), data=st.data())
def test_any_in_range_handle_round_trips(alloc, data):
    offset = data.draw(st.integers(0, alloc - 1))
    nbytes = data.draw(st.integers(1, alloc - offset))
    base = data.draw(st.integers(1, (1 << 64) - alloc))
    h = IpcHandle.from_dict(_good(alloc_size=alloc, offset=offset, nbytes=nbytes, base=base))
    assert IpcHandle.from_dict(h.to_dict()) == h


@pytest.mark.parametrize("patch, match", [
    ({"handle": b"x" * 63}, "handle must be 64 bytes, got 63"),
    ({"handle": b"x" * 65}, "handle must be 64 bytes"),
    ({"handle": "x" * 64}, "handle must be 64 bytes, got str"),
    ({"device_id": -1}, r"device_id=-1 must be in"),
    ({"device_id": 1024}, r"device_id=1024"),
    ({"device_id": True}, r"device_id=True must be an int"),
    ({"device_id": 0.0}, r"device_id=0.0 must be an int"),
    ({"base": 0}, r"base=0 must be in"),
    ({"alloc_size": 0}, r"alloc_size=0"),
    ({"alloc_size": (1 << 48) + 1}, r"alloc_size="),
    ({"nbytes": 0}, r"nbytes=0"),
    ({"offset": -1}, r"offset=-1"),
    ({"offset": (1 << 20) - 100, "nbytes": 101}, r"offset=1048476 \+ nbytes=101 exceeds alloc_size=1048576"),
    ({"base": (1 << 64) - 4096}, r"passes 2\^64"),
    ({"pid": 0}, r"pid=0"),
    ({"pid": "1"}, r"pid='1' must be an int"),
    ({"host": "me"}, r"host='me' must be"),
    ({"host": {"hostname": "a"}}, r"host=.* must be"),
    ({"host": {"hostname": "a", "boot_id": "b", "x": "c"}}, r"host=.* must be"),
    ({"host": {"hostname": "a" * 257, "boot_id": "b"}}, r"at most 256"),
    ({"host": {"hostname": 1, "boot_id": "b"}}, r"host=.* must be"),
    ({"v": 2}, r"v=2, this build reads version 1"),
    ({"v": True}, r"v=True"),
])
def test_bad_fields_are_refused_by_name(patch, match):
    with pytest.raises(ValueError, match=match):
        IpcHandle.from_dict(_good(**patch))


def test_missing_unknown_keys_and_non_dicts_are_refused():
    d = _good()
    del d["offset"]
    with pytest.raises(ValueError, match="must be exactly"):
        IpcHandle.from_dict(d)
    with pytest.raises(ValueError, match="must be exactly"):
        IpcHandle.from_dict(_good(extra=1))
    for bad in (None, [1, 2], b"\x00" * 64, "handle"):
        with pytest.raises(ValueError, match="expected a dict"):
            IpcHandle.from_dict(bad)


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="nbytes=0"):
        IpcHandle(b"\x00" * IPC_HANDLE_BYTES, 0, 4096, 4096, 0, 0, 1, host_info())
    h = IpcHandle(bytearray(64), 0, 4096, 4096, 0, 16, 1, host_info())
    assert isinstance(h.handle, bytes)  # normalised, hashable


# ---- IpcMapping: everything a peer's message could get wrong is refused before CUDA --------------
@pytest.mark.parametrize("args, match", [
    (([],), "non-empty sequence"),
    ((_good(),), "non-empty sequence"),  # a dict, not a list of them
    (([_good(nbytes=0)],), "nbytes=0"),
    (([_good()], [(65536,), (1,)], None), r"1 handles need 1 shapes and dtypes, got 2 and 1"),
    (([_good()], [(65537,)], None), r"shapes\[0\]=\(65537,\) of uint8 is 65537 bytes, more than the handle's nbytes=65536"),
    (([_good()], [(16385, 2)], [np.uint16]), r"shapes\[0\]=\(16385, 2\) of uint16 is 65540 bytes"),
    (([_good()], [(-1,)], None), r"shapes\[0\]=\(-1,\) must be a sequence of non-negative ints"),
    (([_good()], [(2.0,)], None), r"shapes\[0\]"),
    (([_good()], None, [object]), r"dtypes\[0\]=object cannot view device memory"),
    (([_good(offset=4098)], [(100,)], [np.uint32]), r"handles\[0\].offset=4098 is not a multiple of .*itemsize 4"),
    (([_good(host={"hostname": "elsewhere", "boot_id": "b"})],), r"handles\[0\] was exported on host 'elsewhere'"),
    (([_good(), _good(host={**host_info(), "boot_id": "x"})],), r"handles\[1\] was exported on host"),
])
def test_mapping_refuses_bad_input_before_cuda(args, match):
    with pytest.raises(ValueError, match=match):
        IpcMapping(*args)
    assert cuda_ipc._OPENED == {}


@pytest.mark.skipif(HAVE_CUPY, reason="checks the error without CuPy; tests/gpu covers the CUDA side")
def test_valid_mapping_without_cupy_is_a_clear_error():
    with pytest.raises(IpcError, match="needs CuPy"):
        IpcMapping([_good()])


def test_export_refuses_host_memory_and_non_arrays():
    with pytest.raises(TypeError, match=r"arrays\[0\] is a numpy array in host memory"):
        export_ipc_handles([np.zeros(16, np.uint8)])

    class HostBuf:
        addr, nbytes, mem_type = 4096, 16, "DRAM"

    with pytest.raises(TypeError, match=r"arrays\[1\] of type HostBuf is not a device array"):
        export_ipc_handles([_FakeCai(), HostBuf()])
    for bad in ([], (), "ab", None):
        with pytest.raises(ValueError, match="non-empty sequence"):
            export_ipc_handles(bad)


class _FakeCai:
    """Shape-only stand-in for __cuda_array_interface__ checks (never reaches CUDA: refused)."""

    class device:  # noqa: N801 - CuPy's attribute name
        id = 0

    def __init__(self, shape=(8, 8), strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (4096, False),
                                         "strides": strides, "version": 3}


def test_export_refuses_strided_and_empty_device_arrays():
    with pytest.raises(ValueError, match=r"arrays\[0\] is not C-contiguous"):
        export_ipc_handles([_FakeCai(strides=(16, 2))])

    class Empty:
        addr, nbytes, mem_type, device_id = 4096, 0, "VRAM", 0

    with pytest.raises(ValueError, match=r"arrays\[0\] has nbytes=0"):
        export_ipc_handles([Empty()])


def test_own_pid_handle_not_exported_here_is_refused():
    if not HAVE_CUPY:
        pytest.skip("the pid check runs after CuPy is imported; tests/gpu covers it")
    with pytest.raises(IpcError, match="not exported here"):
        IpcMapping([_good(pid=os.getpid())])
