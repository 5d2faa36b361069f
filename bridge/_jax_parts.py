"""Parts of `bridge.jax_engine`: its side-channel wire format and its host-memory copies.

Wire: every message is one msgpack map ``{"v": PROTOCOL_VERSION, "op": ..., "seq": ...}`` plus
the fields of its op (`REQUESTS` from an initiator, `REPLIES` from the serving engine), checked
field by field by `check` before anything acts on it; ranges travel as little-endian i64
``(addr, nbytes)`` pairs. Memory: `HostMemory` gathers and scatters descriptor ranges of the
engine's registered host regions, row-vectorised where the ranges share one length.
"""
from __future__ import annotations

import ctypes

import msgpack
import numpy as np

from bridge.errors import DescriptorError
from bridge.jax_transfer import MAX_UUID
from bridge.regions import MemoryRegion

__all__ = ["PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "MAX_RANGES", "REQUESTS", "REPLIES", "Refused",
           "encode", "check", "ranges_of", "is_address", "HostMemory"]

PROTOCOL_VERSION = 1
#: Largest side-channel message accepted (bytes); a batch's ranges travel as i64 pairs in it.
MAX_MESSAGE_BYTES = 64 << 20
MAX_RANGES = (MAX_MESSAGE_BYTES - 4096) // 16
_MAX_NOTIF = 1 << 16
REQUESTS = {  # op -> extra fields and their types (all requests carry v, op, from, seq)
    "read": {"ranges": bytes},
    "read_done": {"uuid": int, "ok": bool, "notif": (bytes, type(None))},
    "write": {"uuid": int, "ranges": bytes, "notif": (bytes, type(None)), "address": str},
    "notify": {"notif": bytes},
    "cancel": {},
}
REPLIES = {"offered": {"uuid": int, "nbytes": int}, "written": {}, "error": {"msg": str}}


class Refused(Exception):
    """A side-channel message failed its checks (the text says which field)."""


def encode(op: str, **fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, **fields}, use_bin_type=True)


def check(data: bytes, schema: dict[str, dict]) -> dict:
    """One side-channel message, decoded and checked against `schema` (op -> fields)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise Refused(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES,
                              max_str_len=4096, max_array_len=0, max_map_len=16)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for garbage
        raise Refused(f"not a msgpack map: {type(exc).__name__}: {exc}") from None
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
        raise Refused(f"not a version-{PROTOCOL_VERSION} message map")
    fields = schema.get(msg.get("op"))
    if fields is None:
        raise Refused(f"op={msg.get('op')!r:.40} must be one of {sorted(schema)}")
    need = {"v": int, "op": str, "seq": int, **fields, **({"from": str} if schema is REQUESTS else {})}
    if set(msg) != set(need):
        raise Refused(f"{msg['op']}: fields {sorted(msg)} must be exactly {sorted(need)}")
    for key, types in need.items():
        v = msg[key]
        if not isinstance(v, types) or (types is int and isinstance(v, bool)):
            raise Refused(f"{msg['op']}.{key}: {type(v).__name__} is not {types}")
        if types is int and not 0 <= v <= MAX_UUID:
            raise Refused(f"{msg['op']}.{key}={v} must be in [0, 2**63 - 1]")
    if isinstance(msg.get("notif"), bytes) and not 0 < len(msg["notif"]) <= _MAX_NOTIF:
        raise Refused(f"{msg['op']}.notif must be 1..{_MAX_NOTIF} bytes")
    return msg


def is_address(addr) -> bool:
    """A 'host:port' str of sane length (a peer's transfer server)."""
    if not isinstance(addr, str) or len(addr) > 300:
        return False
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit()


def ranges_of(data: bytes) -> np.ndarray:
    """i64[n, 2] (addr, nbytes) from a message's ``ranges`` bytes."""
    if len(data) % 16 or not 0 < len(data) // 16 <= MAX_RANGES:
        raise Refused(f"ranges: {len(data)} bytes is not 1..{MAX_RANGES} (addr, nbytes) i64 pairs")
    return np.frombuffer(data, dtype="<i8").reshape(-1, 2).astype(np.int64)


def _coalesce(addrs: np.ndarray, lens: np.ndarray, region: np.ndarray):
    """Merges ranges that continue each other inside one region (a page run becomes one copy;
    two registrations that happen to touch are never merged across)."""
    if len(addrs) < 2:
        return addrs, lens, region
    start = np.ones(len(addrs), dtype=bool)
    start[1:] = (addrs[1:] != addrs[:-1] + lens[:-1]) | (region[1:] != region[:-1])
    idx = np.flatnonzero(start)
    return addrs[idx], np.add.reduceat(lens, idx), region[idx]


class HostMemory:
    """Gather / scatter of descriptor ranges inside the registrations of a `TransferEngine`
    (mixed into `JaxTransferEngine`: uses its ``_local_table``, ``_views`` and ``name``)."""

    def _located(self, addrs: np.ndarray, lens: np.ndarray):
        """Coalesced ranges grouped for copying, all checked inside this engine's registrations:
        yields (region view, starts i64[k], length) for runs of equal length (one numpy fancy
        index per region: a row gather, not a Python loop), else (view, [start], n) per range."""
        addrs, lens = np.asarray(addrs, np.int64), np.asarray(lens, np.int64)
        table = self._local_table
        idx = table.locate(addrs, lens)
        bad = (idx < 0) | (lens <= 0) | (addrs < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise DescriptorError(f"ranges: {int(addrs[i]):#x}+{int(lens[i])} is outside every region registered "
                                  f"with engine {self.name!r}")
        addrs, lens, idx = _coalesce(addrs, lens, idx)
        if len(lens) > 1 and (lens == lens[0]).all():
            # one length: consecutive ranges of one region go in one fancy-indexed row copy
            cut = np.flatnonzero(np.diff(idx)) + 1
            for lo, hi in zip(np.r_[0, cut].tolist(), np.r_[cut, len(idx)].tolist()):
                r = table.regions[int(idx[lo])]
                yield self._view(r), addrs[lo:hi] - r.addr, int(lens[0])
            return
        for a, n, i in zip(addrs.tolist(), lens.tolist(), idx.tolist()):
            r = table.regions[i]
            yield self._view(r), np.array([a - r.addr]), n

    def _view(self, r: MemoryRegion) -> np.ndarray:
        view = self._views.get(r)
        if view is None:
            view = self._views[r] = np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr))
        return view

    @staticmethod
    def _rows(view: np.ndarray, starts: np.ndarray, n: int):
        """Index into `view` reaching bytes [s, s+n) of every start: a [k, n] row index of a 2-D
        view when every start is a multiple of n, else None."""
        if len(starts) == 1 or (starts % n).any():
            return None
        return view[: view.size // n * n].reshape(-1, n), starts // n

    def _gather(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        out = np.empty(int(np.sum(lens)), dtype=np.uint8)
        off = 0
        for view, starts, n in self._located(addrs, lens):
            rows = self._rows(view, starts, n)
            if rows is not None:
                out[off:off + len(starts) * n].reshape(-1, n)[:] = rows[0][rows[1]]
            else:
                for st in starts.tolist():
                    out[off:off + n] = view[st:st + n]
                    off += n
                continue
            off += len(starts) * n
        return out

    def _scatter(self, addrs: np.ndarray, lens: np.ndarray, data: np.ndarray) -> None:
        data = data.reshape(-1).view(np.uint8)
        off = 0
        for view, starts, n in self._located(addrs, lens):
            rows = self._rows(view, starts, n)
            if rows is not None:
                rows[0][rows[1]] = data[off:off + len(starts) * n].reshape(-1, n)
                off += len(starts) * n
                continue
            for st in starts.tolist():
                view[st:st + n] = data[off:off + n]
                off += n
