"""CUDA IPC handles as a peer sends them: `IpcHandle` (checked on construction, plain-dict form for
msgpack) and the host identity that decides whether IPC is possible (`host_info`, `same_host`).

Everything here is pure Python: a handle dict is a peer's message, and `IpcHandle.from_dict`
validates every field (types, sizes, offsets, handle length, device id, host) before anything uses
it. Opening handles is `bridge.cuda_ipc`'s job.
"""
from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["IPC_HANDLE_BYTES", "IPC_HANDLE_VERSION", "IpcHandle", "host_info", "same_host"]

#: Size of a legacy CUDA IPC handle (``CU_IPC_HANDLE_SIZE``).
IPC_HANDLE_BYTES = 64
#: Format version written by `IpcHandle.to_dict`; other versions are refused.
IPC_HANDLE_VERSION = 1
_MAX_BYTES = 1 << 48  # no GPU allocation comes near 256 TiB: a larger size is a bad message
_MAX_DEVICE = 1024
_MAX_HOST_FIELD = 256
_DICT_KEYS = ("v", "handle", "device_id", "base", "alloc_size", "offset", "nbytes", "pid", "host")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: no boot id, so `same_host` is never true
        return ""


def host_info() -> dict[str, str]:
    """This machine as IPC sees it: ``{"hostname": str, "boot_id": str}``.

    A CUDA IPC handle opens only in a process of the same boot of the same machine, hence both:
    a hostname alone repeats across containers and reboots.
    """
    return {"hostname": socket.gethostname(), "boot_id": _boot_id()}


def same_host(info: Any) -> bool:
    """True when `info` (a `host_info()` dict, e.g. from a peer, or an `IpcHandle`) names this
    very host and boot, so IPC handles from there can open here.

    A malformed dict (missing or non-str fields, empty boot id) is simply not the same host.

    Raises:
        TypeError: info is neither a mapping nor an `IpcHandle`.
    """
    if isinstance(info, IpcHandle):
        info = info.host
    if not isinstance(info, Mapping):
        raise TypeError(f"info must be a host_info() dict or an IpcHandle, got {type(info).__name__}")
    mine = host_info()
    boot, name = info.get("boot_id"), info.get("hostname")
    return (isinstance(boot, str) and isinstance(name, str) and bool(mine["boot_id"])
            and boot == mine["boot_id"] and name == mine["hostname"])


def _int_field(d: Mapping, key: str, lo: int, hi: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"ipc handle: {key}={v!r} must be an int")
    if not lo <= v <= hi:
        raise ValueError(f"ipc handle: {key}={v!r} must be in [{lo}, {hi}]")
    return int(v)


@dataclasses.dataclass(frozen=True)
class IpcHandle:
    """One exported device array: the IPC handle of its allocation and where the array sits in it.

    Attributes:
        handle: the 64-byte legacy CUDA IPC handle of the allocation.
        device_id: CUDA device ordinal of the memory in the exporter's numbering. The importer
            opens the handle on its own device of that ordinal (CUDA maps the memory into that
            context, enabling peer access lazily): with ``CUDA_VISIBLE_DEVICES`` unset or equal
            that is the memory's GPU; in the main job placed on several GPUs
            (`dcp_jax.job.gpus`) every process's own GPU is ordinal 0, so a handle opens into the
            writer's own GPU, which then writes to the peer's memory over NVLink.
        base: the allocation's base address in the exporter (bytes; identifies the allocation,
            used directly only by a mapping in the exporting process itself).
        alloc_size: size of the whole allocation (bytes).
        offset: the array's first byte inside the allocation (bytes).
        nbytes: the array's size (bytes, > 0); ``offset + nbytes <= alloc_size``.
        pid: the exporting process.
        host: the exporter's `host_info()`.

    Raises (at construction, as `from_dict`): ValueError for any field out of range.
    """

    handle: bytes
    device_id: int
    base: int
    alloc_size: int
    offset: int
    nbytes: int
    pid: int
    host: Mapping[str, str]

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not isinstance(self.handle, (bytes, bytearray)) or len(self.handle) != IPC_HANDLE_BYTES:
            n = len(self.handle) if isinstance(self.handle, (bytes, bytearray)) else type(self.handle).__name__
            raise ValueError(f"ipc handle: handle must be {IPC_HANDLE_BYTES} bytes, got {n}")
        object.__setattr__(self, "handle", bytes(self.handle))
        _int_field(d, "device_id", 0, _MAX_DEVICE - 1)
        _int_field(d, "base", 1, (1 << 64) - 1)
        _int_field(d, "alloc_size", 1, _MAX_BYTES)
        _int_field(d, "offset", 0, _MAX_BYTES)
        _int_field(d, "nbytes", 1, _MAX_BYTES)
        _int_field(d, "pid", 1, (1 << 31) - 1)
        if self.offset + self.nbytes > self.alloc_size:
            raise ValueError(f"ipc handle: offset={self.offset} + nbytes={self.nbytes} exceeds "
                             f"alloc_size={self.alloc_size}")
        if self.base + self.alloc_size > 1 << 64:
            raise ValueError(f"ipc handle: base={self.base:#x} + alloc_size={self.alloc_size} passes 2^64")
        host = self.host
        if not isinstance(host, Mapping) or set(host) != {"hostname", "boot_id"} or not all(
                isinstance(v, str) and len(v) <= _MAX_HOST_FIELD for v in host.values()):
            raise ValueError(f"ipc handle: host={host!r} must be {{'hostname': str, 'boot_id': str}} "
                             f"(each at most {_MAX_HOST_FIELD} characters)")
        object.__setattr__(self, "host", {"hostname": host["hostname"], "boot_id": host["boot_id"]})

    def to_dict(self) -> dict[str, Any]:
        """Plain types for msgpack or JSON-with-bytes (no pickle): the keys of `from_dict`."""
        return {"v": IPC_HANDLE_VERSION, "handle": self.handle, "device_id": self.device_id,
                "base": self.base, "alloc_size": self.alloc_size, "offset": self.offset,
                "nbytes": self.nbytes, "pid": self.pid, "host": dict(self.host)}

    @classmethod
    def from_dict(cls, d: Any) -> "IpcHandle":
        """Checks and rebuilds a handle from `to_dict`'s form (a peer's message).

        Raises:
            ValueError: not a dict, missing or unknown keys, another version, or any field of the
                wrong type or out of range (sizes and offsets in bytes, 64-byte handle).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"ipc handle: expected a dict, got {type(d).__name__}")
        keys = set(d)
        if keys != set(_DICT_KEYS):
            raise ValueError(f"ipc handle: keys {sorted(map(str, keys))} must be exactly {sorted(_DICT_KEYS)}")
        if d["v"] != IPC_HANDLE_VERSION or isinstance(d["v"], bool):
            raise ValueError(f"ipc handle: v={d['v']!r}, this build reads version {IPC_HANDLE_VERSION}")
        return cls(d["handle"], d["device_id"], d["base"], d["alloc_size"], d["offset"], d["nbytes"],
                   d["pid"], d["host"])


