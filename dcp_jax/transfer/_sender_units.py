"""The sender's send algorithm: plan units, hold pack regions, submit (`SenderEndings` polls
and ends them).

Part of the worker-thread machinery of `dcp_jax.transfer.KVSender` (a mixin: the state it works
on is created in ``KVSender.__init__``; `SenderPeers`, `SenderEndings` and `SenderRegion` are
the rest). Every method runs on
the worker thread under the sender's lock. A (request, chunk, rank) is planned once by
`dcp_jax.transfer.schedule.plan_rank_chunk`; each of its windows is one `Unit`: one engine batch
(push) or one ``pull_ready`` (pull), with its own pack region from the `PackArena`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._sender_region import sync_arrays as _sync_arrays
from dcp_jax.transfer.requests import RankTarget, SendRequest
from dcp_jax.transfer.schedule import SideLayout, batch_engine_calls, plan_rank_chunk
from dcp_jax.transfer.spec import HandshakeError
from dcp_jax.transfer.status import TransferStatus
from dcp_jax.transfer.views import served_group_ranks

__all__ = ["SenderUnits", "Unit", "ARENA_SHARE"]

logger = logging.getLogger(__name__)

#: How long (seconds) `KVSender.close` waits for the pack kernels still running (each takes
#: milliseconds; a device that hangs longer is not waited for).
DRAIN_PACK_S = 1.0
#: Pack buffers of closed senders whose last pack never ended: kept, never reused or freed.
_ORPHANED_PACKS: list = []

#: Most of the pack arena one decode rank may hold while it already holds a region (fraction).
ARENA_SHARE = 0.5


@dataclasses.dataclass(eq=False)
class Unit:
    """One window of one (request, chunk, rank): one engine batch or one pull.

    A region-push window is written only once both ``packed`` (the round synchronised its
    pack) and ``grant`` (the rank's ``region_grant`` offset) are set, in either order: its
    ``region_ask`` goes out while the pack runs (``asked``; `SenderRegion._ask_regions`)."""

    req: SendRequest
    target: RankTarget
    rc: Any          # schedule.RankChunk
    w: int           # window index
    region: Any = None
    handle: Any = None
    asked: bool = False        # region push: region_ask sent (in self._asks until written or dropped)
    packed: bool = False       # region push: the round's synchronisation found its pack complete
    grant: int | None = None   # region push: the granted offset in the rank's receive region
    nbytes: int | None = None  # the window's bytes (`SenderUnits._window_bytes`, computed once)
    # Its engine batch (push) or pull, once posted (`SenderEndings._posted`): the post's number
    # (post order on this sender), when its stall clock started (the post, or the completion of
    # a batch posted before it to the same rank) and its size allowance (`batch_allowance`).
    seq: int = 0
    clock: float | None = None
    allow_s: float = 0.0
    descriptors: int = 0
    batch_bytes: int = 0
    held: bytes | None = None  # region push, ``region_notify="round"``: its ``done``, told by `_tell_held`
    round: int = 0  # the pack round (`_submit_units` call) that packed it


class SenderUnits:
    """Planning, pack regions, submission, completion and the endings of requests."""

    def _plan_units(self) -> None:
        # Only requests that got a chunk or an announcement since the last round (`_to_plan`).
        todo, self._to_plan = self._to_plan, {}  # in arrival order: FIFO across requests
        for req in todo:
            if req.status.terminal or req.page_table is None or self._requests.get(req.rid) is not req:
                continue
            if req.needed is None and not req.targets and self._serves_nobody():
                # No decode rank will announce it here (each announces only to the senders that
                # move it bytes): done as soon as it is sent.
                req.needed = frozenset()
                self._maybe_done(req)
                continue
            for rank, t in req.targets.items():
                while t.next_chunk < len(req.chunks):
                    ci = t.next_chunk
                    t.next_chunk += 1
                    start, stop, src_table = req.chunks[ci]
                    if stop > t.num_tokens:
                        self._end(req, TransferStatus.FAILED, f"tokens [{start}, {stop}) pass decode rank "
                                  f"{rank}'s num_tokens={t.num_tokens}", notify="failed")
                        break
                    tp = time.perf_counter()
                    try:
                        rc = plan_rank_chunk(
                            ci, max(start, t.prefix_tokens), max(stop, t.prefix_tokens), src=self._layout,
                            dst=SideLayout.of(t.conn.spec), src_page_table=src_table,
                            dst_page_table=t.page_table, mode=t.conn.path,
                            max_batch_indices=self.max_batch_indices, max_region_rows=self._region_rows(t.conn),
                            check_tables=False)  # both tables were checked once, at send / expect
                    except ValueError as exc:
                        self._end(req, TransferStatus.FAILED, f"plan for decode rank {rank}: {exc}", notify="failed")
                        break
                    req.plan_seconds += time.perf_counter() - tp
                    if rc.strategy == "fused" and (err := self._fused_rows_error(t, rc)):
                        self._end(req, TransferStatus.FAILED, err, notify="failed")
                        break
                    t.parts_left[ci] = (len(rc.windows), start, stop)
                    t.counters.rows += len(rc.src_rows)
                    if rc.strategy != "empty":
                        t.counters.strategies.add(rc.strategy)
                    self._queue.extend(Unit(req, t, rc, w) for w in range(len(rc.windows)))
                if req.status.terminal:
                    break

    def _serves_nobody(self) -> bool:
        """True when this sender has connected decode ranks and moves bytes to none of their
        groups' ranks (`views.served_group_ranks`: e.g. prefill TP rank 1 of an MLA model whose
        latent every decode rank takes from TP rank 0). With no connection it cannot know."""
        if not self._conns:
            return False
        try:
            return not any(served_group_ranks(self.spec, c.spec) for c in self._conns.values())
        except HandshakeError:
            return False

    def _region_rows(self, conn: Any) -> int:
        """Rows one window may hold: the pack buffer's, and for the region path also the
        receiver's receive region's (a window must fit both)."""
        if conn.path == "region":
            return min(self._max_region_rows, conn.region_bytes // self._wire_row_bytes(conn))
        return self._max_region_rows

    def _wire_row_bytes(self, conn: Any) -> int:
        """Bytes one token row of this connection moves over every layer: the whole row, or a
        view pair's head pieces."""
        return self.spec.row_bytes if conn.view is None else conn.view.row_bytes() * self.spec.num_layers

    def _index_rows(self, n: int) -> int:
        """Index rows a window of ``n`` rows takes in a round's kernel launch (pack or fused
        copy): whole row blocks (`pallas_kernels.windows.window_blocks`)."""
        return -(-n // self._index_block) * self._index_block

    def _window_bytes(self, u: Unit) -> int:
        """Bytes of a unit's window: its rows' pack, or a view pair's wire block (computed once
        per unit: a region write asks for it at its ask, its grant and its post)."""
        if u.nbytes is None:
            if u.target.conn.view is None:
                u.nbytes = u.rc.window_bytes(u.w, self._layers.item_lens)
            else:
                lo, hi = u.rc.windows[u.w]
                u.nbytes = (hi - lo) * self._wire_row_bytes(u.target.conn)
        return u.nbytes

    def _batch_calls(self, descriptors: int) -> int:
        return batch_engine_calls(descriptors, getattr(self.engine, "window", None))

    def _submit_units(self) -> bool:
        """Submits queued windows in order while the arena has room. A rank already holding
        regions gets more only within `ARENA_SHARE` of the arena: a rank that stopped reading
        (its windows never complete) keeps at most that share (or one window, if larger) and
        the other ranks' windows pass it; the skipped rank's later windows wait too, so each
        rank's order is kept. Otherwise FIFO: a window that does not fit stops the scan."""
        busy, blocked, i = False, set(), 0
        packed: list[tuple] = []  # (unit, lo, hi, pack address or None): packed, not yet posted
        batch: list[tuple] = []  # (unit, rows, pack offset): the round's windows, packed at once
        index_rows = 0  # the pack kernel's index rows so far: each window rounded to a row block
        share = int(self._arena.capacity * ARENA_SHARE)
        while i < len(self._queue):
            stalled = time.monotonic() - self._last_round  # this round began then: a stop inside it
            if stalled > self._stall_s and self._conns:
                self._on_stall(stalled)
            u = self._queue[i]
            if u.req.status.terminal:
                del self._queue[i]
                continue
            conn = u.target.conn
            if conn in blocked or conn.closing is not None:  # a closing rank gets nothing new
                i += 1
                continue
            lo, hi = u.rc.windows[u.w]
            if u.rc.strategy in ("packed", "region") and hi > lo:
                if conn.view is None:  # the round's one pack kernel: within the warmed buckets
                    rounded = self._index_rows(hi - lo)
                    if batch and index_rows + rounded > self._index_cap["pack"]:
                        break  # the rest in the next round (FIFO keeps order)
                need = self._window_bytes(u)
                held = self._held.get(conn, 0)
                if held and held + need > share:
                    blocked.add(conn)
                    i += 1
                    continue
                u.region = self._arena.acquire((u.req.rid, u.rc.chunk, conn.spec.dcp_rank, u.w), need)
                if u.region is None:
                    break  # the arena is full: wait for a transfer to finish (FIFO keeps order)
                self._held[conn] = held + u.region.reserved
                if conn.view is None:
                    index_rows += rounded
            del self._queue[i]
            conn.queue_moved_at = time.monotonic()  # the windows behind this one wait their turn
            busy = True
            try:
                packed.append((u, lo, hi, self._pack_unit(u, lo, hi, batch)))
            except Exception as exc:  # noqa: BLE001 - the request fails, the sender lives on
                self._submit_failed(u, exc)
        self._pack_round(packed, batch)
        return self._post_ready() or busy

    def _post_ready(self) -> bool:
        """Posts the rounds whose packs finished, oldest first (each rank's windows keep their
        order): a round's pack is only enqueued by `_submit_units`, and the next round's pack
        follows at once, so the device packs back to back while earlier rounds' windows go out.
        True when a round was posted."""
        posted = False
        while self._packing:
            ticket, packed, since = self._packing[0]
            try:
                if ticket is not None and not ticket.ready():
                    break
            except Exception as exc:  # noqa: BLE001 - a failed kernel (CUDA error): no window of the round goes out
                self._packing.popleft()
                self._fail_round(packed, exc)
                posted = True
                continue
            self._packing.popleft()
            self._post_packed(packed, ticket, since)
            posted = True
        return posted

    def _fail_round(self, packed: list, exc: BaseException) -> None:
        """A round whose pack failed: every window's request fails, naming the error."""
        for u, _, _, _ in packed:
            self._submit_failed(u, exc)

    def _pending_pack(self, req: Any) -> bool:
        """Whether a window of ``req`` waits for its round's pack to end (`_packing`)."""
        return any(u.req is req for _, packed, _ in self._packing for u, _, _, _ in packed)

    def _drain_packing(self, timeout_s: float | None = None) -> None:
        """At close, after the worker stopped: waits (at most ``timeout_s`` for all) for the packs
        still running, then frees their regions. Nothing may write the pack buffer once it is
        given back: a pack still running then (a hung device) keeps the buffer alive for the
        process (`_ORPHANED_PACKS`), logged."""
        timeout_s = DRAIN_PACK_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while self._packing:
            ticket, packed, _ = self._packing.popleft()
            try:
                if ticket is not None and not ticket.wait(max(0.0, deadline - time.monotonic())):
                    logger.warning("close: a pack kernel did not end within %.1f s; its pack buffer is "
                                   "kept for the life of the process", timeout_s)
                    _ORPHANED_PACKS.append(self._pack)
                    self._packing.clear()
                    return
                if ticket is None and any(addr is not None for _, _, _, addr in packed):
                    _sync_arrays([self._pack.array])  # a view pair's block (host-made): the device-wide wait
            except Exception:  # noqa: BLE001 - closing: the device failed; nothing is posted anyway
                logger.warning("close: a pack in flight failed", exc_info=True)
            for u, _, _, _ in packed:
                self._free_region(u)

    def _submit_failed(self, u: Unit, exc: BaseException) -> None:
        self._free_region(u)
        self._end(u.req, TransferStatus.FAILED, f"decode rank {u.target.conn.spec.dcp_rank}, chunk "
                  f"{u.rc.chunk}: {type(exc).__name__}: {exc}", notify="failed")

    def _post_packed(self, packed: list, ticket: Any = None, since: float | None = None) -> None:
        """Second half of a round's submissions, once its pack kernels finished (`ticket`
        ready, `_post_ready`; None: a device-wide wait here, one for all of them, not one per
        window): each window is posted (region push: once its grant is here too), announced
        (pull), and each fused copy is waited for the same way. Windows of requests that ended
        meanwhile (an asked window dropped by `_end` before the pack finished kept its region
        for this) are freed here, after the wait: no kernel still writes a region the arena
        hands out again. ``since``: when the round's pack was enqueued (its requests' pack time
        runs to here)."""
        if any(addr is not None for _, _, _, addr in packed):
            tk = time.perf_counter() if since is None else since
            try:
                if ticket is not None:
                    ticket.wait()  # ready already: a failed kernel raises here
                else:
                    _sync_arrays([self._pack.array])
            except Exception as exc:  # noqa: BLE001 - no window of this round may go out
                return self._fail_round(packed, exc)
            for req in dict.fromkeys(u.req for u, _, _, addr in packed if addr is not None):
                req.pack_seconds += time.perf_counter() - tk  # the wait is part of each request's pack
        self._launch_fused(packed)  # the fused copies first: the bookkeeping below runs while they copy
        for u, lo, hi, addr in packed:
            if u.req.status.terminal:  # ended by an earlier window's failure in this round
                self._free_region(u)
                continue
            try:
                self._post_unit(u, lo, hi, addr)
            except Exception as exc:  # noqa: BLE001 - the request fails, the sender lives on
                self._submit_failed(u, exc)
        self._finish_fused()

    def _free_region(self, u: Unit) -> None:
        """Gives a window's pack region back to the arena (nothing reads it any more)."""
        r, u.region = u.region, None
        if r is None:
            return
        if r.state == "quarantined":
            self._arena.release_quarantined(r)
        else:
            self._arena.release(r)
        conn = u.target.conn
        conn.queue_moved_at = time.monotonic()  # room back: the rank's next queued window may go
        left = self._held.get(conn, 0) - r.reserved
        if left > 0:
            self._held[conn] = left
        else:
            self._held.pop(conn, None)

    def _pack_unit(self, u: Unit, lo: int, hi: int, batch: list) -> int | None:
        """Packs a view pair's window now (host), or adds the window to the round's `batch`
        (packed by `_pack_batch`; the caller synchronises before any engine reads the region);
        returns the region's address, or None for windows that do not pack."""
        req = u.req
        if req.first_byte_at is None:  # the request's first byte packed (or sent, unpacked paths)
            req.first_byte_at = time.monotonic()
        if u.region is None:
            return None
        req.timeline.mark("pack", u.target.conn.spec.group_rank)
        if u.target.conn.view is not None:  # a TP or layout pair: its head pieces' wire block (host)
            tk = time.perf_counter()
            u.target.conn.view.pack(self._layers.rows, u.rc.src_rows[lo:hi], self._pack.array, u.region.offset)
            req.pack_seconds += time.perf_counter() - tk
        else:
            batch.append((u, u.rc.src_rows[lo:hi], u.region.offset))
        return self._pack.addr + u.region.offset

    def _post_unit(self, u: Unit, lo: int, hi: int, region_addr: int | None) -> None:
        req, t, rc = u.req, u.target, u.rc
        rank, n = t.conn.spec.dcp_rank, hi - lo
        if region_addr is not None:
            req.timeline.mark("packed", t.conn.spec.group_rank)
        head = self._window_head(u)
        # The transfer phase starts with the data ready to go (after the pack's synchronisation),
        # also for a region push whose region_ask went out while the pack ran.
        if req.t_first_submit is None:
            req.t_first_submit = time.perf_counter()
        req.state.advance(TransferStatus.TRANSFERRING)
        if rc.strategy == "fused":
            return self._submit_fused(u, head)
        if t.conn.direction == "pull":
            src_rows = b"" if region_addr is not None else proto.pack_i64(rc.src_rows[lo:hi])
            self._pulls[(req.rid, t.inc, rank, rc.chunk, u.w)] = u
            req.inflight += 1
            t.inflight += 1
            # The reader builds these very descriptors (same rows, same runs): count them here.
            ndesc = rc.descriptors_per_window(self.spec.num_layers)[u.w] if n else 0
            nbytes = rc.window_bytes(u.w, self._layers.item_lens) if n else 0
            self._count(t, ndesc, nbytes, self._batch_calls(ndesc) if n else 0)
            self._posted(u, ndesc, nbytes)
            self._tell(t.conn.ident, proto.encode("pull_ready", req.rid, t.inc, lo=lo, src_addr=region_addr or 0,
                                                 src_rows=src_rows, **head))
            req.timeline.mark("post", t.conn.spec.group_rank)  # the pull's post: the rank may read now
            return
        if rc.strategy == "region":
            return self._region_packed(u)  # posted now if granted, else by `_on_region_grant`
        if t.conn.view is not None:  # TP or layout pair: head pieces through both layouts
            descs = t.conn.view.descriptors(rc.src_rows[lo:hi], rc.dst_rows[lo:hi], self._layers.bases,
                                            t.conn.layer_bases)
        else:
            descs = rc.window_descriptors(u.w, src_bases=self._layers.bases, dst_bases=t.conn.layer_bases,
                                          item_lens=self._layers.item_lens, region_addr=region_addr)
        notif = proto.encode("done", req.rid, t.inc, **head)
        u.handle = self.engine.transfer_batch(t.conn.peer, descs, notif=notif, dcp_rank=rank, chunk=rc.chunk)
        req.timeline.mark("post", t.conn.spec.group_rank)
        # Engine notifications wake no socket: this tells the rank one is due, so it polls its
        # engine only while completions are on their way.
        self._tell(t.conn.ident, proto.encode("sent", req.rid, t.inc, chunk=rc.chunk, part=u.w))
        req.inflight += 1
        t.inflight += 1
        self._inflight.append(u)
        nbytes = int(descs[:, 2].sum()) if len(descs) else 0
        self._count(t, len(descs), nbytes, self._batch_calls(len(descs)))
        self._posted(u, len(descs), nbytes)

    def _count(self, t: RankTarget, descriptors: int, nbytes: int, calls: int) -> None:
        """Adds one batch to the rank's and the sender's counters (a notification-only batch
        moves no descriptor and counts no batch)."""
        batches = 1 if descriptors else 0
        c = t.counters
        c.descriptors += descriptors
        c.bytes += nbytes
        c.batches += batches
        c.engine_calls += calls
        for k, v in (("descriptors", descriptors), ("bytes", nbytes), ("batches", batches), ("engine_calls", calls)):
            self._counts[k] += v
