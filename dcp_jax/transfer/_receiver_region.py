"""The receiver's region and fused paths (a mixin of `dcp_jax.transfer.KVReceiver`, worker thread, lock held).

Region: every window of a (request, sender, chunk) lands in its own range of this rank's
registered receive region (`dcp_jax.transfer._region.ReceiveRegion`) and is placed into the
pages by `pallas_kernels.unpack_rows` before it counts as landed. Push: the sender's
``region_ask`` is checked (a live request, a part not credited yet, a window of rows this rank
owns in that chunk, the size those rows make) before a range is granted (``region_grant``, FIFO while the region is
full); the engine's ``done`` notification for it triggers the unpack. Pull: ``pull_ready`` gets a
range, the rank READs the window with one descriptor and unpacks when the read finished.

A range is given back after its unpack, or, when the request ended first, once nothing can write
it any more: push, when the sender said ``drained`` (or is gone); pull, when the read finished.

Fused: the sender's ``fused_done`` is checked like a ``done`` notification and credits the part.
Ungated, the sender sent it after its copy kernel into this rank's pages finished; gated (the
sender offered a flag page in ``hello_ack``: `bridge.host_flag`), it was sent right after the
launch, and the part is credited once the page reads the message's ``seq`` or later
(`_poll_gated`, one memory read per link per worker round while any waits).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import numpy as np
import zmq

from bridge.host_flag import seq_done
from dcp_jax._validate import check_int_type
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._worker import SPIN
from dcp_jax.transfer.requests import RecvRequest
from dcp_jax.transfer.status import TransferStatus

__all__ = ["ReceiverRegion", "Grant", "GATED_SPIN_S", "CTL_SPIN_S"]

#: How long (seconds) the worker polls a gated part's flag without backing off: a fused copy of
#: 9.2 GB took ~5 ms on an H200; past this the usual backoff (to 1 ms) bounds the cost of a stall.
GATED_SPIN_S = 0.05
#: How long (seconds) after a grant whose ``done`` comes as a control frame (``ctl_done``) a rank
#: on device memory spins on its sockets: that write ends within milliseconds, and a worker asleep
#: in its backoff heard the last ``done`` of the 32k GPU job 0.61-0.87 ms after it was sent, a
#: spinning one 0.17-0.24 ms (medians, H200 and H100, 2026-12-07). Host ranks, and after this,
#: wait idle: the frame itself wakes them.
CTL_SPIN_S = 0.02


@dataclasses.dataclass(eq=False)
class Grant:
    """One window's range of the receive region and where its rows go."""

    region: Any            # arena.PackRegion of the ReceiveRegion
    req: RecvRequest
    link: Any
    done: dict             # chunk, part, nparts, start, stop, nrows (what lands)
    rows: np.ndarray       # i64[nrows] this rank's buffer rows of the window
    ctl_done: bool = False  # its ``done`` comes as a control frame (not counted in ``req.due``)
    at: float = 0.0        # when it was granted (time.monotonic)


def _synchronize(arrays) -> None:
    """Waits for the kernels queued on device arrays (no-op for numpy): the rows are in the
    pages before the part counts."""
    import pallas_kernels

    sync = getattr(pallas_kernels, "synchronize", None)
    if sync is not None:
        sync(arrays)
    elif arrays and not isinstance(arrays[0], np.ndarray):
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


class ReceiverRegion:
    """Grants, unpacks and the ranges' life cycle; ``fused_done``."""

    def _init_region_state(self) -> None:
        self._grants: dict[tuple, Grant] = {}       # (id(link), rid, inc, chunk, part) -> push grant
        self._read_grants: dict[int, Grant] = {}   # read handle seq -> pull grant
        self._waiting: deque = deque()             # (kind, link, req, msg): asks / pulls waiting for room
        self._gated: list = []                     # (link, msg, since): gated fused_done waiting for the flag
        self._unpacker = None                      # RowUnpacker (receive region -> pages), made on first use
        self._spin_socks: tuple = ()               # the links' sockets, for `_spin_ready` (set by `_spin`)

    def _window_rows(self, req: RecvRequest, link: Any, msg: dict) -> np.ndarray | None:
        """The rows of a window a sender announces, or None (the request is failed) when the
        window is not rows this rank owns in that chunk or its size disagrees."""
        if msg["stop"] > req.num_tokens:  # before any row is computed from the page table
            self._inconsistent(req, f"window of tokens [{msg['start']}, {msg['stop']}) passes "
                                    f"num_tokens={req.num_tokens}")
            return None
        rows = self._rows_of(req, link, msg["start"], msg["stop"])
        lo, n = msg["lo"], msg["nrows"]
        nbytes = msg.get("nbytes", n * link.row_bytes)
        if n == 0 or lo + n > len(rows) or nbytes != n * link.row_bytes \
                or nbytes > self._region.nbytes:
            self._inconsistent(req, f"window of rows [{lo}, {lo + n}) ({nbytes} bytes) of a chunk this rank holds "
                                    f"{len(rows)} rows of, into a {self._region.nbytes}-byte receive region")
            return None
        return rows[lo:lo + n]

    def _on_region_ask(self, link: Any, msg: dict) -> None:
        req = self._live(link, msg)
        if req is None:
            return  # the request ended here: the sender hears it (abort / failed) and drops the window
        if link.path != "region":
            return self._inconsistent(req, f"region_ask on a {link.path} connection")
        if self._credited(req, link, msg):
            self._counts["dropped_messages"] += 1  # a late duplicate: its window already landed
            return
        if self._window_rows(req, link, msg) is None:
            return
        self._waiting.append(("ask", link, req, msg))
        self._grant_waiting()

    @staticmethod
    def _credited(req: RecvRequest, link: Any, msg: dict) -> bool:
        """Whether this rank already credited the part a ``region_ask`` names. A range granted
        for it would never be written (the sender no longer has that window and drops the
        grant) nor given back (``drained`` is not sent after SUCCESS): it would leak for good."""
        entry = req.parts.get((id(link), msg["chunk"]))
        return entry is not None and msg["part"] in entry[1]

    def _grant_waiting(self) -> bool:
        """Grants ranges to waiting windows in arrival order while the region has room."""
        busy = False
        while self._waiting:
            kind, link, req, msg = self._waiting[0]
            if req.status.terminal or link not in self._links or self._requests.get(req.rid) is not req:
                self._waiting.popleft()
                if kind == "pull":  # the sender holds its pack region for this: let it go
                    self._send(link, proto.encode("pull_done", msg["rid"], msg["inc"], chunk=msg["chunk"],
                                                  part=msg["part"], ok=False, reason="request not live here"))
                continue
            nbytes = msg["nrows"] * link.row_bytes
            key = (id(link), req.rid, req.inc, msg["chunk"], msg["part"])
            if kind == "ask" and (key in self._grants or self._credited(req, link, msg)):
                # A duplicate ask (its window holds a range, or already landed while this one
                # waited): one range per window, and none once it landed.
                self._waiting.popleft()
                self._counts["dropped_messages"] += 1
                continue
            region = self._region.acquire(key, nbytes)
            if region is None:
                break  # full: the next unpack frees room
            self._waiting.popleft()
            busy = True
            lo, n = msg["lo"], msg["nrows"]
            done = dict(chunk=msg["chunk"], part=msg["part"], nparts=msg["nparts"], start=msg["start"],
                        stop=msg["stop"], nrows=n)
            g = Grant(region, req, link, done, self._rows_of(req, link, msg["start"], msg["stop"])[lo:lo + n],
                      ctl_done=kind == "ask" and msg["ctl_done"], at=time.monotonic())
            if kind == "ask":
                self._grants[key] = g
                if not g.ctl_done:  # its engine ``done`` is due (no ``sent`` hint comes for region writes)
                    req.due += 1
                req.state.advance(TransferStatus.TRANSFERRING)  # a write into this range may start now
                req.timeline.mark("granted", self.spec.group_rank)
                self._send(link, proto.encode("region_grant", req.rid, req.inc, chunk=msg["chunk"], part=msg["part"],
                                              offset=region.offset, nbytes=nbytes))
            else:
                self._read_region(g, msg)
        return busy

    def _read_region(self, g: Grant, msg: dict) -> None:
        """Pull: one READ of the sender's packed window into the granted range."""
        req, link, n = g.req, g.link, g.done["nrows"]
        descs = np.array([[self._region.addr + g.region.offset, msg["src_addr"], n * self.spec.row_bytes]], np.int64)
        self._reading(req, descs)
        try:
            h = self.engine.transfer_batch(link.peer, descs, op="READ", dcp_rank=self.spec.dcp_rank,
                                           chunk=msg["chunk"])
        except Exception as exc:  # noqa: BLE001 - refused before a byte moved
            self._region.free(g.region)
            self._send(link, proto.encode("pull_done", req.rid, req.inc, chunk=msg["chunk"], part=msg["part"],
                                          ok=False, reason=str(exc)[:proto.MAX_TEXT]))
            self._end(req, TransferStatus.FAILED, f"pull refused: {exc}", "failed")
            return
        self._reads[h.seq] = (req, link, g.done, h)
        self._read_grants[h.seq] = g
        req.inflight += 1
        self._counts["reads"] += 1
        req.state.advance(TransferStatus.TRANSFERRING)

    def _queue_region_pull(self, req: RecvRequest, link: Any, msg: dict) -> None:
        if msg["nrows"] and self._window_rows(req, link, {**msg, "nbytes": msg["nrows"] * self.spec.row_bytes}) is None:
            return
        self._waiting.append(("pull", link, req, msg))
        self._grant_waiting()

    def _unpack(self, g: Grant) -> str | None:
        """Places a landed window's rows into the pages; the error text, or None."""
        from pallas_kernels import RowUnpacker, unpack_rows

        try:
            tk = time.perf_counter()
            src, off = self._region.array, g.region.offset
            window_copy = self.staged and self._layers.mem_type == "VRAM"
            if window_copy:  # host region -> device, then unpack there
                from dcp_jax.transfer.staging import to_device_window

                src, off = to_device_window(src, off, len(g.rows) * self.spec.row_bytes), 0
                g.req.stage_seconds += time.perf_counter() - tk
            # Device: the rows come from the page table expect() validated, so the kernel skips
            # its index checks (each would synchronise); the host checks are cheap and stay.
            if g.link.view is not None:  # a TP or layout pair: place its wire block through the layout
                g.link.view.unpack(src, off, self._layers.rows, g.rows)
            elif not window_copy:  # the region itself: the prepared unpacker (its checks done once)
                if self._unpacker is None:
                    self._unpacker = RowUnpacker(src, self._layers.rows)
                self._unpacker.unpack(g.rows, offset=off, checked=self._layers.mem_type == "VRAM")
            else:  # a staged window's device copy
                unpack_rows(src, self._layers.rows, g.rows, offset=off, checked=self._layers.mem_type == "VRAM")
            g.req.timeline.mark("unpack_enqueued", self.spec.group_rank)  # host part done; the wait follows
            _synchronize(self._layers.rows)
            g.req.unpack_seconds += time.perf_counter() - tk
            g.req.timeline.mark("unpacked", self.spec.group_rank)
            g.req.unpacks += 1
            self._counts["unpacks"] += 1
            return None
        except Exception as exc:  # noqa: BLE001 - the request fails, the receiver lives on
            return f"unpack: {type(exc).__name__}: {exc}"

    def _region_landed(self, link: Any, msg: dict, by_ctl: bool = False) -> None:
        """A ``done`` for a region window (``by_ctl``: it came as a control frame, not as the
        engine's notification): unpack (if the request is still live), give the range back."""
        key = (id(link), msg["rid"], msg["inc"], msg["chunk"], msg["part"])
        g = self._grants.get(key)
        req = self._live(link, msg)
        if g is not None and by_ctl and not g.ctl_done:
            # Its ask said the engine's notification brings it: only that one follows the bytes.
            # A control frame may come before them: unpacking then would read the range's old
            # bytes, and freeing it would let a late write land in another window's range. The
            # range stays held (until the engine's done, or the sender's drained).
            if req is None:  # (`_live` counted it dropped)
                return
            return self._inconsistent(req, f"done for chunk {msg['chunk']} part {msg['part']} came as a control "
                                           "frame, but its region_ask said the engine's notification brings it")
        self._grants.pop(key, None)
        if req is not None:
            req.timeline.mark("landed", self.spec.group_rank)
        if g is None:
            if req is not None:
                what = "which landed already (a second done)" if self._credited(req, link, msg) else \
                    "which was never granted"
                self._inconsistent(req, f"done for chunk {msg['chunk']} part {msg['part']}, {what}")
            return
        err = self._unpack(g) if req is not None and g.done["nrows"] == msg["nrows"] else None
        self._region.free(g.region)
        self._grant_waiting()
        if req is None:
            return
        if not g.ctl_done:
            req.due = max(0, req.due - 1)
        if g.done != {k: msg[k] for k in g.done}:
            return self._inconsistent(req, f"done {msg} does not match the grant {g.done}")
        if err is not None:
            return self._end(req, TransferStatus.FAILED, err, "failed")
        self._part_landed(req, link, msg)

    def _read_landed(self, seq: int, ok: bool) -> str | None:
        """A region READ finished: unpack when it succeeded and the request lives; the range is
        given back either way. Returns the unpack's error, or None."""
        g = self._read_grants.pop(seq, None)
        if g is None:
            return None
        err = self._unpack(g) if ok and not g.req.status.terminal else None
        self._region.free(g.region)
        self._grant_waiting()
        return err

    def warm_up(self, max_rows: int | None = None, *, every_bucket: bool = False) -> dict[str, list[int]]:
        """Compiles, before serving, the kernel that places region windows into this rank's
        pages (`pallas_kernels.RowUnpacker.warm`: the index bucket of the largest window, or
        every bucket up to it, writing nothing), so no window compiles it on the thread that
        also answers the senders: on a fresh GPU machine the 32k job's first window took 27.5 s
        (H100) and over 30 s (H200, past the job's 30 s ``peer_timeout_s``: the senders dropped
        every rank) to compile in each of eight decode processes at once (2026-12-07).

        Call it after construction, before `connect`. Called later it still runs on the
        caller's thread through an unpacker of its own, holding no lock the receiver's worker
        takes (the compiled kernel is process-wide: the worker's unpacks reuse it). Host layers,
        a staged receiver, no receive region, or direct launches of "unpack" off
        (`pallas_kernels.triton_launch`) compile nothing here (the windows then take the jitted
        unpack, compiled on first use).

        Args:
            max_rows: the most token rows one window carries (an int >= 1); None, or more than
                the receive region holds: as many as it holds.
            every_bucket: also every smaller index bucket (windows of many sizes, e.g. a serving
                loop's chunked prefills; ~4 s a bucket in the job on an H100); False: a smaller
                window compiles its bucket when it first lands.

        Returns:
            ``{"unpack": buckets}``: the index buckets (rows, ascending) now compiled.

        Raises:
            RuntimeError: the receiver is closed. TypeError: ``max_rows`` not an int (``1.0``
                too), ``every_bucket`` not a bool; ValueError: ``max_rows`` < 1.
        """
        from pallas_kernels import RowUnpacker

        self._check_open()
        if max_rows is not None and check_int_type("max_rows", max_rows) < 1:
            raise ValueError(f"max_rows={max_rows!r} must be an int >= 1 or None")
        if not isinstance(every_bucket, bool):
            raise TypeError(f"every_bucket must be a bool, got {type(every_bucket).__name__}")
        region = self._region
        fits = region.nbytes // self.spec.row_bytes
        if self.staged or self._layers.mem_type != "VRAM" or fits < 1:
            return {"unpack": []}
        un = RowUnpacker(region.array, self._layers.rows)
        try:
            rows = fits if max_rows is None else min(int(max_rows), fits)
            return {"unpack": un.warm(rows, every_bucket=every_bucket)}
        finally:
            un.close()

    def _close_unpacker(self) -> None:
        if self._unpacker is not None:
            self._unpacker.close()
            self._unpacker = None

    def _free_grants(self, pred) -> None:
        """Gives back the push ranges no write can reach any more (sender drained or gone)."""
        for key, g in list(self._grants.items()):
            if pred(key, g):
                del self._grants[key]
                self._region.free(g.region)
                if not g.ctl_done:
                    g.req.due = max(0, g.req.due - 1)  # its ``done`` will not come
        self._grant_waiting()

    def _quarantine_grants(self, req: RecvRequest) -> None:
        """The request ended: its push ranges may still be written by an engine; hold them apart
        until the sender says ``drained``."""
        for g in self._grants.values():
            if g.req is req and g.region.state == "in_use":
                self._region.arena.quarantine(g.region)

    def _on_fused_done(self, link: Any, msg: dict) -> None:
        req = self._live(link, msg)
        if req is None:
            return
        if link.path != "fused":
            return self._inconsistent(req, f"fused_done on a {link.path} connection")
        if msg["gated"]:
            if link.flag is None:
                return self._inconsistent(req, "a gated fused_done from a sender that offered no flag page")
            if msg["seq"] >= 1 << 32:
                return self._inconsistent(req, f"a gated fused_done with seq={msg['seq']} (the flag holds uint32)")
            self._gated.append((link, msg, time.monotonic()))
            return
        self._part_landed(req, link, msg)

    def _poll_gated(self) -> bool:
        """Credits the gated ``fused_done``s whose sender's flag reached their ``seq`` (one read
        per link per round); True if any was credited or dropped."""
        if not self._gated:
            return False
        values: dict = {}
        keep, busy = [], False
        for link, msg, since in self._gated:
            if link not in self._links:  # dropped: its requests failed with it
                busy = True
                continue
            if self._live(link, msg) is None:  # ended or released meanwhile: nothing to credit
                busy = True
                continue
            if id(link) not in values:
                try:
                    values[id(link)] = link.flag.value()
                except Exception as exc:  # noqa: BLE001 - a shrunk or closed page: no part of it may count
                    values[id(link)] = f"{type(exc).__name__}: {exc}"
            value = values[id(link)]
            if isinstance(value, str):
                busy = True
                self._end(self._requests[msg["rid"]], TransferStatus.FAILED,
                          f"fused copy: the sender's flag page: {value}", "failed")
                continue
            if not seq_done(value, msg["seq"]):
                keep.append((link, msg, since))
                continue
            busy = True
            self._part_landed(self._requests[msg["rid"]], link, msg)
        self._gated = keep
        return busy

    def _gated_ready(self) -> bool:
        """Whether a gated part's flag reached its number (the worker's spin check: worker thread,
        no lock; `_gated` is only changed on this thread, and replaced, not edited, by
        `_poll_gated`)."""
        values: dict = {}
        for link, msg, _ in self._gated:
            flag = link.flag
            if flag is None or flag.closed:
                return True  # a dropped link: the next round sees to it
            if id(link) not in values:
                values[id(link)] = flag.value()  # a shrunk page raises: the worker runs the round
            if seq_done(values[id(link)], msg["seq"]):
                return True
        return False

    def _ctl_spinning(self) -> bool:
        """Whether the worker should spin on its sockets: a grant on device memory whose
        ``done`` comes as a control frame was given less than `CTL_SPIN_S` ago."""
        if self._layers.mem_type != "VRAM":
            return False
        now = time.monotonic()
        return any(g.ctl_done and now - g.at < CTL_SPIN_S for g in self._grants.values())

    def _spin(self) -> int:
        """A round's SPIN, with the sockets `_spin_ready` checks snapshotted for it (the spin
        runs without the lock)."""
        self._spin_socks = tuple(link.client.sock for link in self._links if link.registered)
        return SPIN

    def _spin_ready(self) -> bool:
        """The worker's spin check (worker thread, no lock): a gated part's flag reached its
        number, or a control frame waits on a socket (`_spin_socks`, set by `_spin`)."""
        if self._gated and self._gated_ready():
            return True
        return any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in self._spin_socks)

    def _gated_waiting(self) -> bool:
        """Whether the gated parts wait on copies that should end within milliseconds (the worker
        then spins); once the OLDEST has waited `GATED_SPIN_S` (the page lags: a stalled
        sender, or a stream of requests behind a slow one) the usual backoff applies, so a
        lagging page never keeps a core busy."""
        return bool(self._gated) and time.monotonic() - self._gated[0][2] < GATED_SPIN_S
