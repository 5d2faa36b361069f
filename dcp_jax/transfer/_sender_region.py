"""The sender's region and fused paths (a mixin of `dcp_jax.transfer.KVSender`, worker thread, lock held).

Region, push: a window is packed into the sender's pack region (as the packed path); as soon
as the round's pack is enqueued, before it ends, ``region_ask`` asks the
decode rank for room in its receive region, so the ask -> grant round trip overlaps the pack
kernel. Its ``region_grant`` (offset, size: checked against the region the rank declared at the
handshake before any byte moves) and the end of the round's pack (its ticket ready,
`SenderUnits._post_ready`), in either order,
let ONE descriptor write the whole window, with the usual ``done`` notification (`Unit.packed`,
`Unit.grant`: the write is posted by whichever comes second). Region, pull: as the packed path's
``pull_ready`` after the synchronisation; the receiver READs the window with one descriptor.

Fused: the round's windows are copied from this sender's pages into each decode rank's pages,
through the connection's `bridge.cuda_ipc.IpcMapping`, by ONE fan-out kernel launch
(`pallas_kernels.copy_fanout` over the links' `RowCopier`s). Gated (the sender made a flag page,
`bridge.host_flag.SharedFlag`, and offered it in ``hello_ack``): a bump of the flag is enqueued
after the launch (a jitted kernel that takes the copy's output, so XLA runs it after the copy) and
``fused_done(gated=True, seq=k)`` goes to each rank at once, while the copy runs; each rank counts
its rows once the page reads k. Else (no page could be made, or the bump could not be enqueued):
``fused_done`` once the host's wait (``pallas_kernels.synchronize``) returned. Either way the
sender's own bookkeeping (its units, its request's end) follows its host wait.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer.status import TransferStatus
from pallas_kernels.config import env_flag

__all__ = ["SenderRegion", "sync_arrays"]

logger = logging.getLogger(__name__)

#: Whether fused links are offered the flag gate (``hello_ack.flag``); on unless the environment
#: variable DCP_JAX_FUSED_FLAG_GATE is off (`pallas_kernels.config.env_flag`; then ranks are told
#: after the sender's host wait). It replaced
#: a CUDA IPC event recorded after a DLPack stream wait, which fired before the copy's end at
#: 9.21 GB on an H200 (2026-12-02; see `bridge.host_flag`).
FUSED_FLAG_GATE = env_flag("DCP_JAX_FUSED_FLAG_GATE", True)

#: `KVSender`'s ``region_notify`` values: the engine's notification with each region write, or
#: ``done`` told over the control plane once every region write of the window's pack round ended.
REGION_NOTIFY = ("write", "round")
#: ``region_notify="round"``: the longest a completed write's ``done`` waits for the rest of its
#: round (a window whose grant is late, a write stuck at a stopped peer) before it is told anyway.
REGION_HOLD_MAX_S = 0.005


def sync_arrays(arrays) -> None:
    """Waits until every kernel queued on these device arrays finished (no-op for numpy)."""
    import pallas_kernels

    sync = getattr(pallas_kernels, "synchronize", None)
    if sync is not None:
        sync(arrays)
        return
    if arrays and not isinstance(arrays[0], np.ndarray):
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


def _device_id(array) -> int | None:
    dev = getattr(array, "device", None)
    return getattr(dev, "id", None)


class SenderRegion:
    """Region asks and grants, the fused copy, and their clean-up."""

    def _ask_key(self, u: Any) -> tuple:
        return (u.req.rid, u.target.inc, u.target.conn.spec.dcp_rank, u.rc.chunk, u.w)

    def _window_head(self, u: Any) -> dict:
        """The fields that name a unit's window in ``region_ask`` / ``done`` / ``pull_ready`` / ``fused_done``."""
        rc = u.rc
        lo, hi = rc.windows[u.w]
        return dict(chunk=rc.chunk, part=u.w, nparts=len(rc.windows), start=rc.start, stop=rc.stop, nrows=hi - lo)

    def _ask_regions(self, packed: list) -> list:
        """Region push: asks the rank of each of the round's windows for room right after the
        round's pack was enqueued (`_pack_batch`; a view pair's block was packed on the host by
        `_pack_unit`), before the round synchronises it: the ask -> grant round trip overlaps
        the pack kernel. Returns ``packed`` less the windows whose ask could not be sent (their
        requests failed)."""
        out = []
        for p in packed:
            u, addr = p[0], p[3]
            if (addr is not None and u.rc.strategy == "region" and u.target.conn.direction == "push"
                    and not u.req.status.terminal):
                try:
                    self._ask_region(u)
                except Exception as exc:  # noqa: BLE001 - the request fails, the sender lives on
                    self._submit_failed(u, exc)
                    continue
            out.append(p)
        return out

    def _ask_region(self, u: Any) -> None:
        """Sends a window's ``region_ask``; it counts in flight from here (a grant may be used,
        or the window dropped by `_drop_asks`, from now on)."""
        t = u.target
        lo, _ = u.rc.windows[u.w]
        frame = proto.encode("region_ask", u.req.rid, t.inc, lo=lo, nbytes=self._window_bytes(u),
                             ctl_done=self.region_notify == "round", **self._window_head(u))
        self._asks[self._ask_key(u)] = u
        u.asked = True
        u.req.inflight += 1
        t.inflight += 1
        u.req.timeline.mark("ask", t.conn.spec.group_rank)
        self._tell(t.conn.ident, frame)

    def _region_packed(self, u: Any) -> None:
        """The round synchronised a region-push window's pack: written now if its grant is
        here, else when the grant comes (`_on_region_grant`)."""
        if not u.asked:  # not asked while its pack ran (`_ask_regions` asks every live one)
            self._ask_region(u)
        u.packed = True
        if u.grant is not None:
            self._write_region(u)

    def _on_region_grant(self, conn: Any, msg: dict) -> None:
        key = (msg["rid"], msg["inc"], conn.spec.dcp_rank, msg["chunk"], msg["part"])
        u = self._asks.get(key)
        if u is None or u.target.conn is not conn or u.grant is not None:
            self._counts["dropped_messages"] += 1  # a grant for a window that ended meanwhile, or a second one
            return
        want = self._window_bytes(u)
        if msg["nbytes"] != want or msg["offset"] + want > conn.region_bytes:
            # Never write outside the region the rank declared: its grant is refused whole.
            del self._asks[key]
            return self._unit_finished(u, f"region_grant offset={msg['offset']} nbytes={msg['nbytes']} is not "
                                          f"{want} bytes inside the {conn.region_bytes}-byte receive region",
                                       free=u.packed)
        u.grant = msg["offset"]
        u.req.timeline.mark("grant", conn.spec.group_rank)
        if u.packed:
            self._write_region(u)
        # else: its round has not synchronised the pack yet; `_region_packed` writes it then.

    def _write_region(self, u: Any) -> None:
        """Posts a region-push window: packed AND granted (ONE descriptor, the checked grant)."""
        assert u.packed and u.grant is not None
        del self._asks[self._ask_key(u)]
        req, t = u.req, u.target
        conn, want = t.conn, self._window_bytes(u)
        descs = np.array([[self._pack.addr + u.region.offset, conn.region_addr + u.grant, want]], np.int64)
        frame = proto.encode("done", req.rid, t.inc, **self._window_head(u))
        u.held = frame if self.region_notify == "round" else None
        try:
            u.handle = self.engine.transfer_batch(conn.peer, descs, notif=None if u.held is not None else frame,
                                                  dcp_rank=conn.spec.dcp_rank, chunk=u.rc.chunk)
        except Exception as exc:  # noqa: BLE001 - refused before a byte moved: the request fails
            return self._unit_finished(u, f"{type(exc).__name__}: {exc}")
        req.timeline.mark("post", conn.spec.group_rank)
        # No ``sent`` hint: the rank expects this window's ``done`` since it granted the range
        # (one control frame less per write; the post is the region path's host cost per rank).
        self._inflight.append(u)  # inflight counts were taken at the ask
        self._count(t, 1, want, self._batch_calls(1))
        self._posted(u, 1, want)

    def _tell_held(self, ended: list, keep: list, flush: bool = False) -> None:
        """``region_notify="round"``: queues the ``done`` of the region writes that just ended
        without error (``ended``) and tells each once no window of its pack round (`Unit.round`)
        is still in flight (``keep``), waiting for its grant or for its pack, or once it has
        waited `REGION_HOLD_MAX_S` (``flush``: every one now, as the sender closes). A window
        whose request failed or was aborted meanwhile is not told (its rank heard that instead)."""
        held = self._held_dones
        now = time.monotonic()
        held.extend((u, now) for u in ended if u.held is not None)
        if not held:
            return
        busy = {v.round for v in keep if v.held is not None} | {v.round for v in self._asks.values()}
        busy.update(u.round for _, packed, _ in self._packing for u, _, _, _ in packed)
        later = []
        for u, at in held:
            if u.round in busy and now - at < REGION_HOLD_MAX_S and not flush:
                later.append((u, at))
            elif u.req.status in (TransferStatus.TRANSFERRING, TransferStatus.SUCCESS):
                u.req.timeline.mark("noted", u.target.conn.spec.group_rank)  # before the send: the rank's mark follows
                self._tell(u.target.conn.ident, u.held)
        self._held_dones = later

    @staticmethod
    def _fused_rows_error(t: Any, rc: Any) -> str | None:
        """Why a fused chunk's destination rows cannot be written (no engine checks these
        addresses: this does, once per chunk when it is planned), or None. The bound is the
        link's copier's (made at the handshake over the sender's one PackSource): rows of the
        rank's smallest mapped layer."""
        if not len(rc.dst_rows):
            return None
        rows, hi, lo = t.conn.copier.dst_rows, int(rc.dst_rows.max()), int(rc.dst_rows.min())
        if hi >= rows:
            return f"decode rank {t.conn.spec.dcp_rank}'s page table maps row {hi}, its mapped layers hold {rows} rows"
        if lo < 0:
            return f"decode rank {t.conn.spec.dcp_rank}'s page table maps a negative row"
        return None

    def _launch_fused(self, packed: list) -> None:
        """Enqueues the round's fused copies FIRST, before the round's per-window bookkeeping
        (`_post_unit`: message heads, states), which then runs while the kernel copies (it had
        sat between the round's first byte and the launch: ~0.1 ms of a 2.3 ms request on the
        H200 host). `packed`: the round's (unit, lo, hi, address) entries; the fused ones of live
        requests are launched (`_copy_fused`) and count in flight, their request's and their
        rank's, until `_finish_fused` waited for the copy, whether or not `_post_unit` reaches
        them. Their rows were checked when their chunk was planned (`_fused_rows_error`)."""
        for u, lo, hi, _ in packed:
            if u.rc.strategy != "fused" or u.req.status.terminal:
                continue
            if u.req.t_first_submit is None:  # the transfer phase starts with the launch
                u.req.t_first_submit = time.perf_counter()
            src = dst = None
            if hi > lo:
                src, dst = u.rc.src_rows[lo:hi], u.rc.dst_rows[lo:hi]
            u.req.inflight += 1
            u.target.inflight += 1
            self._fused.append([u, None, hi > lo, src, dst])  # its head comes from `_submit_fused`
        if self._fused:
            self._fused_launched = self._copy_fused(self._fused)
            self._fused_seq = self._flag_after_launch()

    def _flag_after_launch(self) -> int | None:
        """Enqueues the flag's bump right behind the round's launches (`_bump_flag`), before the
        round's bookkeeping: enqueued after it, the bump waited for ~0.2-0.5 ms of cold host
        work and a jitted dispatch, so the flag could flip well after the copy had ended.
        Returns its number, or None (no live window moved rows, no flag, or it could not be
        enqueued: the ranks are then told after the host's wait)."""
        errors, written = self._fused_launched
        moved = [e[0] for e in self._fused if e[2] and e[0] not in errors and not e[0].req.status.terminal]
        seq = self._bump_flag(written) if moved else None
        if seq is not None:
            for u in moved:
                u.req.timeline.mark("flagged", u.target.conn.spec.group_rank)
        return seq

    def _submit_fused(self, u: Any, head: dict) -> None:
        """Gives a window `_launch_fused` enqueued its message head: `_finish_fused` tells its rank
        ``fused_done`` (a window without a head, its request ended meanwhile, is only waited for)."""
        for entry in self._fused:
            if entry[0] is u:
                entry[1] = head
                return

    def _copy_fused(self, done: list) -> tuple[dict, list]:
        """Enqueues the round's fused copies: ONE fan-out kernel for all decode ranks
        (`pallas_kernels.copy_fanout`; a rank with two windows this round needs a second
        launch). Every fused link's copier is in every launch, in connection order, with no
        rows where it has no window: the kernel compiled for this sender's ranks serves every
        round (`KVSender.warm_up` compiles it), whichever ranks announced in time. Should a
        launch raise, its windows are copied one by one, so only a failing window ends its
        request. Returns ({unit: error}, one copier per launch: the IPC event is recorded
        after what they wrote). Bounds were checked by `_submit_fused` on the host (the
        kernel's own checks would each synchronise)."""
        from pallas_kernels import copy_fanout

        moved = [(u, src, dst) for u, _, m, src, dst in done if m and not u.req.status.terminal]
        links = [c for c in self._conns.values() if c.copier is not None]
        per_link: dict = {}
        for job in moved:
            per_link.setdefault(job[0].target.conn, []).append(job)
        listed = set(links)  # units, requests, links and copiers hash by identity: no id() (an audit event)
        links += [c for c in dict.fromkeys(u.target.conn for u, _, _ in moved) if c not in listed]
        empty = np.empty(0, np.int64)
        errors, written = {}, []
        tk = time.perf_counter()
        for u, _, _ in moved:  # the host's part before the launch: planned -> copy -> launched
            u.req.timeline.mark("copy", u.target.conn.spec.group_rank)
        for batch in self._fused_launches(per_link):
            mine = {u.target.conn: (s, d) for u, s, d in batch}
            def phase(name, batch=batch):  # the launch's host time, split on the timeline
                for u, _, _ in batch:
                    u.req.timeline.mark(name, u.target.conn.spec.group_rank)
            try:
                copy_fanout([(c.copier, *mine.get(c, (empty, empty))) for c in links], checked=True,
                            on_phase=phase)
                written.append(links[0].copier)  # one kernel wrote them all: the first link's output
                for u, _, _ in batch:  # enqueued, not finished: the timeline tells launch from wait
                    u.req.timeline.mark("launched", u.target.conn.spec.group_rank)
                for req in dict.fromkeys(u.req for u, _, _ in batch):
                    req.launches += 1
            except Exception:  # noqa: BLE001 - find the window that fails; the others go out
                logger.warning("fused copy: one launch for %d windows failed; copying window by window",
                               len(batch), exc_info=True)
                for u, src, dst in batch:
                    try:
                        u.target.conn.copier.copy(src, dst, checked=True)
                        written.append(u.target.conn.copier)
                    except Exception as exc:  # noqa: BLE001 - its request fails, the sender lives on
                        errors[u] = f"fused copy: {type(exc).__name__}: {exc}"
        took = time.perf_counter() - tk
        for req in dict.fromkeys(u.req for u, _, _ in moved):
            req.copy_seconds += took
        return errors, written

    def _fused_launches(self, per_link: dict) -> list:
        """The round's launches: the b-th window of each link in launch b (a copier at most
        once per launch), each launch split further where its windows' index rows (each
        rounded up to a row block) would pass the bucket `warm_up` compiled."""
        cap = self._index_cap["fused"]
        out = []
        for b in range(max((len(v) for v in per_link.values()), default=0)):
            launch, rows = [], 0
            for js in per_link.values():
                if b >= len(js):
                    continue
                n = self._index_rows(len(js[b][1]))
                if launch and rows + n > cap:
                    out.append(launch)
                    launch, rows = [], 0
                launch.append(js[b])
                rows += n
            if launch:
                out.append(launch)
        return out

    def _finish_fused(self) -> None:
        """The round's fused copies (enqueued by `_launch_fused`, in one launch): the ranks are told
        (`_tell_fused`: at once when gated on the flag page, else after the host's wait), one
        host wait for all of them, then the round's bookkeeping."""
        if not self._fused:
            return
        done, self._fused = self._fused, []
        (errors, _), self._fused_launched = self._fused_launched, ({}, [])
        seq, self._fused_seq = self._fused_seq, None  # bumped by `_launch_fused` (None: not gated)
        live = [d for d in done if d[0] not in errors and not d[0].req.status.terminal and d[1] is not None]
        told = self._tell_fused(live, seq) if seq is not None and live else set()
        # Ungated, the messages are encoded while the copy runs: after the wait only the sends remain.
        frames = {} if seq is not None else {
            u: proto.encode("fused_done", u.req.rid, u.target.inc, gated=False, seq=0, **head)
            for u, head, _, _, _ in live}
        tk = time.perf_counter()
        err = None
        try:
            sync_arrays([a for u, _, moved, _, _ in done if moved for a in u.target.conn.mapping.arrays[:1]])
        except Exception as exc:  # noqa: BLE001 - no rank may count its rows (gated: they are told "failed")
            err = f"fused copy: {type(exc).__name__}: {exc}"
        waited = time.perf_counter() - tk
        for req in dict.fromkeys(u.req for u, _, moved, _, _ in done if moved):
            req.copy_seconds += waited
        if seq is None and err is None:
            told = self._tell_fused(live, None, frames)
        for u, _, moved, _, _ in done:
            t = u.target
            if moved and u in told and err is None:
                u.req.timeline.mark("copied", t.conn.spec.group_rank)
            ok = u in told and err is None
            if ok:
                self._count(t, 0, self._window_bytes(u) if moved else 0, 0)
            self._unit_finished(u, None if ok else err or errors.get(u))

    def _tell_fused(self, live: list, seq: int | None, frames: dict | None = None) -> set:
        """Sends ``fused_done`` to the rank of each live window (every rank before any
        bookkeeping): gated on the flag's `seq`, or the ungated `frames`; returns the ids of the
        units told."""
        told = set()
        for u, head, _, _, _ in live:
            if u.req.status.terminal:
                continue
            frame = frames[u] if frames else proto.encode("fused_done", u.req.rid, u.target.inc, gated=True,
                                                              seq=seq, **head)
            self._tell(u.target.conn.ident, frame)
            u.req.timeline.mark("told", u.target.conn.spec.group_rank)
            told.add(u)
        return told

    def _bump_flag(self, copiers: list) -> int | None:
        """Enqueues the flag's bump after the round's launches (no host wait; `copiers`: one per
        launch) and returns its number; None (the ranks are told after the host's wait instead)
        without a flag, when the copies are not of the flag's kind (device: every launch a JAX
        kernel on the GPU, its bump ordered after the last one's output; host: numpy copies, complete when
        they returned), or when the bump cannot be enqueued."""
        flag = self._flag
        if flag is None or not copiers:
            return None
        kinds = {c.backend for c in copiers}
        if kinds != ({"triton"} if flag.route == "device" else {"numpy"}):
            return None
        try:
            # A launch's outputs are its destinations' current JAX handles (one event for all).
            # The LAST launch's output only (the launches run in order on one stream): one bump
            # signature whatever the number of launches, so a round never compiles it anew.
            if flag.route != "device":
                return flag.bump_after(None)
            dest = copiers[-1].destinations()
            if dest.direct is not None:  # launched without JAX (`pallas_kernels.triton_launch`): on its stream
                return flag.bump_on_stream(dest.direct)
            return flag.bump_after((dest.handles[0],))
        except Exception:  # noqa: BLE001 - fall back to telling after the wait
            logger.warning("fused copy: the flag bump could not be enqueued; telling the ranks after the wait",
                           exc_info=True)
            return None

    def _flag_name(self) -> str:
        """The fused path's flag page name for a ``hello_ack``: the page is made with the first
        fused link (bumped on the device of this sender's layers, or by the host for host layers);
        "" when it cannot be made (warned once: its ranks are then told after the host's wait)."""
        if not FUSED_FLAG_GATE:
            return ""
        if self._flag is None and not getattr(self, "_flag_failed", False):
            try:
                from bridge.host_flag import SharedFlag

                first = self._layers.rows[0]
                on_device = not isinstance(first, np.ndarray)
                self._flag = SharedFlag.create(device=on_device, device_id=_device_id(first) if on_device else None)
            except Exception as exc:  # noqa: BLE001 - no /dev/shm, CUDA refused: the ungated path
                logger.warning("fused path: no flag page (%s); ranks are told after the host's wait", exc)
                self._flag_failed = True
        return self._flag.name if self._flag is not None else ""

    def _drop_asks(self, pred) -> None:
        """Asked windows that will never be written (granted or not): their pack regions are
        free (no engine reads them; one whose pack the round has not synchronised yet is freed
        by `_post_packed` after the wait) and they are no longer in flight. The rank gives a
        granted range back once told ``drained`` (or once this connection is gone)."""
        for key, u in list(self._asks.items()):
            if pred(u):
                del self._asks[key]
                self._unit_finished(u, None, free=u.packed)
