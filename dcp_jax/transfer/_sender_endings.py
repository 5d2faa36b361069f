"""The sender's endings: engine completions, credited windows, SUCCESS, failures, drains, timeouts.

A mixin of `dcp_jax.transfer.KVSender` beside `SenderUnits` (planning and submission) and
`SenderPeers` (connections): the state it works on is created in ``KVSender.__init__``; every
method runs on the worker thread under the sender's lock. A window (`Unit`) ends once its engine
batch completes (push) or its reader says so (pull); a request ends SUCCESS once every rank's
coverage is complete and nothing is in flight, or FAILED/ABORTED (`_end`), after which each rank
is told ``drained`` once no write of ours into its pages is in flight.

Timeouts (`_check_timeouts`): a live request with no progress (a chunk, an announcement, a
window completed) for ``timeout_s`` FAILS, unless one of its engine batches is still moving:
the engine cannot report progress inside a batch, so a batch it still reports live (neither
completed nor failed) keeps its request alive for ``timeout_s`` plus the batch's size allowance
(`batch_allowance`), counted from its post or from the completion of the last batch posted
before it to the same decode rank (the engines work through one rank's batches in order, so a
batch queued behind another starts its clock only then); while it waits behind an earlier batch
to that rank that is still in flight, its bound is no sooner than that batch's
(`_batch_deadlines`): a short request queued behind a long prompt's batch is not stuck. Past
that bound it FAILS all the same, and `_end` cancels its batches as far as the engine can.

The decode ranks agree (`_tell_moving`): a rank only sees windows land, so each rank is told, in a
``moving`` frame, which of its requests have such a batch in flight within its bound, each with a
lease (the time left to that bound, at most the rank's ``peer_timeout_s``) during which the rank
counts the request as progressing. A rank hears this once a batch has been in flight for
`MOVING_AFTER_S` and then at most once per ``heartbeat_s`` while such batches exist (sooner only
for a request not in the last frame). A batch past its bound is reported no more: this side
FAILS the request and says so, and the rank, should that word be lost, FAILS it its own
``timeout_s`` after the last lease ran out; a sender gone silent is dropped after ``peer_timeout_s``.
"""

from __future__ import annotations

import time
from typing import Any

from bridge import TransferError
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._sender_units import Unit
from dcp_jax.transfer._worker import TIMEOUT_CHECK_S
from dcp_jax.transfer.requests import RankTarget, SendRequest, ranges_text
from dcp_jax.transfer.status import TransferStatus

__all__ = ["SenderEndings", "BATCH_DESCRIPTOR_S", "BATCH_BYTES_PER_S", "MOVING_AFTER_S", "batch_allowance"]

#: Seconds per descriptor an engine batch in flight is allowed beyond ``timeout_s`` before it
#: counts as stuck: 1 ms, i.e. a floor of 1,000 descriptors a second. Measured here (2-core CPU
#: machine, loopback, one batch alone): Mooncake ~34 us a descriptor (80,000 in 2.7 s), NIXL
#: ~3 us; 8 ranks' batches sharing the machine, and a loaded one, are several times slower.
BATCH_DESCRIPTOR_S = 1e-3
#: Bytes a second an engine batch in flight is allowed at least (10 MB/s: a 64 MiB window 6.7 s).
BATCH_BYTES_PER_S = 10e6
#: Seconds an engine batch (or pull) must have been in flight before its rank hears of it in a
#: ``moving`` frame (one timeout check, `TIMEOUT_CHECK_S`): shorter ones send nothing. A rank's
#: ``timeout_s`` well above this and the worker's delays is what lets the first report come in time.
MOVING_AFTER_S = TIMEOUT_CHECK_S


def batch_allowance(descriptors: int, nbytes: int) -> float:
    """Seconds an engine batch of ``descriptors`` and ``nbytes`` may stay in flight beyond the
    sender's ``timeout_s`` before its request FAILS as stuck (`SenderEndings._check_timeouts`)."""
    return descriptors * BATCH_DESCRIPTOR_S + nbytes / BATCH_BYTES_PER_S


class SenderEndings:
    """Completions, credits and the endings of requests."""

    def _posted(self, u: Unit, descriptors: int, nbytes: int) -> None:
        """A window's engine batch (or pull) was posted: its stall clock starts now."""
        self._post_seq += 1
        u.seq, u.clock, u.descriptors, u.batch_bytes = self._post_seq, time.monotonic(), descriptors, nbytes
        u.allow_s = batch_allowance(descriptors, nbytes)

    def _restart_clocks(self, ended: dict, units: Any) -> None:
        """Batches ended on these connections (``ended``: conn -> the smallest post number that
        ended): every batch in ``units`` posted after it to the same rank may only have started
        now (Mooncake works through one rank's batches in order), so its stall clock restarts."""
        now = time.monotonic()
        for v in units:
            seq = ended.get(v.target.conn)
            if seq is not None and v.seq > seq and v.clock is not None:
                v.clock = now

    def _poll_inflight(self) -> bool:
        busy, keep, ended, finished = False, [], {}, []
        for u in self._inflight:
            err = None
            try:
                done = self.engine.check(u.handle)
            except TransferError as exc:
                done, err = True, exc
            if not done:
                keep.append(u)
                continue
            busy = True
            conn = u.target.conn
            ended[conn] = min(ended.get(conn, u.seq), u.seq)
            u.req.timeline.mark("complete", conn.spec.group_rank)
            if err is None:
                finished.append(u)
            self._unit_finished(u, None if err is None else f"engine: {err}")
        self._inflight = keep
        if finished or self._held_dones:
            self._tell_held(finished, keep)
        if ended:
            self._restart_clocks(ended, keep)
        return busy

    def _unit_finished(self, u: Unit, error: str | None, *, free: bool = True) -> None:
        """The engine (or the reader) is done with a window: free its region, credit or fail.
        ``free`` False: a region-push window whose pack the round has not synchronised yet keeps
        its region; `_post_packed` frees it after the wait."""
        if free:
            self._free_region(u)
        req, t = u.req, u.target
        req.inflight -= 1
        t.inflight -= 1
        if req.status.terminal or self._requests.get(req.rid) is not req:
            self._maybe_drained(req, t)
            return
        if error is not None:
            self._end(req, TransferStatus.FAILED, f"decode rank {t.conn.spec.dcp_rank}, chunk {u.rc.chunk}: {error}",
                      notify="failed")
            return
        left, start, stop = t.parts_left[u.rc.chunk]
        if left > 1:
            t.parts_left[u.rc.chunk] = (left - 1, start, stop)
        else:
            del t.parts_left[u.rc.chunk]
            t.coverage.add(start, stop)
        req.state.touch()
        self._maybe_done(req)

    def _maybe_done(self, req: SendRequest) -> None:
        # Not before a send(), unless no rank needs a token (a full prefix hit on every rank).
        nothing = all(t.num_tokens == t.prefix_tokens for t in req.targets.values())
        if not req.status.terminal and req.complete() and req.inflight == 0 and (req.chunks or nothing):
            if req.finish(TransferStatus.SUCCESS):
                self._counts["succeeded"] += 1

    def _on_pull_done(self, conn: Any, msg: dict) -> None:
        u = self._pulls.pop((msg["rid"], msg["inc"], conn.spec.dcp_rank, msg["chunk"], msg["part"]), None)
        if u is None or u.target.conn is not conn:
            self._counts["dropped_messages"] += 1
            return
        u.req.timeline.mark("complete", conn.spec.group_rank)  # the reader said its READ ended
        self._restart_clocks({conn: u.seq}, self._pulls.values())
        self._unit_finished(u, None if msg["ok"] else f"reader: {msg['reason']}")

    def _end(self, req: SendRequest, status: TransferStatus, reason: str, *, notify: str | None) -> bool:
        """Moves a live request to FAILED/ABORTED, tells its decode ranks, quarantines its regions."""
        if not req.finish(status, reason):
            return False
        self._counts["failed" if status is TransferStatus.FAILED else "aborted"] += 1
        for u in self._inflight + list(self._pulls.values()):
            if u.req is not req:
                continue
            if u.region is not None and u.region.state != "quarantined":
                self._arena.quarantine(u.region)
            if u.handle is not None:  # direct windows too (no region): the engine stops what it can
                self.engine.cancel(u.handle)
        if notify:
            for t in req.targets.values():
                if t.conn.ident in self._conns:
                    self._tell(t.conn.ident, proto.encode(notify, req.rid, t.inc, reason=reason[:proto.MAX_TEXT]))
        self._drop_asks(lambda u: u.req is req)  # waiting for a grant: no engine reads their regions
        for t in req.targets.values():
            self._maybe_drained(req, t)
        return True

    def _maybe_drained(self, req: SendRequest, t: RankTarget, asked: bool = False) -> None:
        """Tells a rank of an ended (not successful) request once no write of ours into its
        pages is in flight: the decode side may then reuse them (`KVReceiver.is_drained`).
        ``asked``: the rank failed the request itself (its timeout, or it lost our ``done``),
        so it waits for this word even when our side ended in SUCCESS, and again if it asks again."""
        if (req.status.terminal and (asked or (req.status is not TransferStatus.SUCCESS and not t.drained))
                and t.inflight == 0 and t.conn.ident in self._conns):
            t.drained = True
            self._tell(t.conn.ident, proto.encode("drained", req.rid, t.inc))

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if now < self._next_timeout_check:
            return
        self._next_timeout_check = now + TIMEOUT_CHECK_S
        for rid in [rid for rid, gone in self._released_ended.items() if gone[0] <= now]:
            del self._released_ended[rid]
        for rid in [rid for rid, until in self._released_at.items() if until <= now]:
            del self._released_at[rid]
        for rid in [rid for rid, gone in self._forgotten.items() if gone[0] <= now]:
            del self._forgotten[rid]
        # req -> its engine batches in flight, built once a request looks stalled or a batch is out
        moving = self._batches_in_flight() if self._inflight or self._pulls else None
        due = self._batch_deadlines(moving) if moving else {}
        queued = self._queued_deadlines(due, now)
        for req in list(self._requests.values()):
            if not req.status.terminal and req.state.stalled_for(now) > self.timeout_s:
                batches = (moving or {}).get(req, ())
                if any(now < due[u] for u in batches) or req in queued:
                    continue  # a batch the engine still moves, or a window waiting its turn behind one
                why = _stuck_batch(batches, now, self.timeout_s, due) or (
                    "; a window still waits for its pack kernel to end (the device did not finish it)"
                    if self._pending_pack(req) else _waiting_for(req))
                self._end(req, TransferStatus.FAILED, f"no progress for {self.timeout_s:g} s{why}", notify="failed")
            elif (req.status.terminal and not req.chunks
                  and req.inflight == 0 and req.state.stalled_for(now) > self.timeout_s):
                self._forget_unsent(req)
        self._tell_moving(now, moving or {}, due, queued)

    def _queued_deadlines(self, due: dict, now: float) -> dict:
        """Requests with windows still queued here (not yet packed or posted) that wait their
        turn: req -> {target: until when}. A window to a rank holding arena room waits for that
        rank's own batches (its share frees only as they complete): their latest bound, or none
        if it has none in flight (its room is held by windows stuck or quarantined: no wait is
        due). A window to a rank holding no room waits for the arena to free anywhere: the latest
        bound of every batch in flight. Either way it also waits ``timeout_s`` from the last
        time the queue to that rank moved (`Conn.queue_moved_at`: a window to it left the queue
        or gave its pack room back): between one window's completion and the next one's post
        no batch to that rank is in flight, and a short request queued behind a long one FAILED
        there in a full-suite run on a loaded host (2026-12-07). Past all of these, the queue to
        that rank is as stuck as what is ahead of it, and its requests FAIL."""
        if not self._queue:
            return {}
        per_conn: dict = {}
        for u, d in due.items():
            c = u.target.conn
            per_conn[c] = max(per_conn.get(c, d), d)
        latest = max(per_conn.values(), default=now)
        out: dict = {}
        for u in self._queue:
            if u.req.status.terminal:
                continue
            conn = u.target.conn
            until = per_conn.get(conn, now) if self._held.get(conn, 0) else latest
            until = max(until, conn.queue_moved_at + self.timeout_s)
            if until > now:  # the same for every window to that rank
                out.setdefault(u.req, {})[u.target] = until
        return out

    def _batch_deadlines(self, moving: dict) -> dict:
        """Each batch in flight (``moving``: req -> its batches) -> when it counts as stuck:
        ``timeout_s`` + its allowance after its clock (its post, or the completion of the batch
        before it to the same rank: `_restart_clocks`), and no sooner than the deadline of any
        batch posted before it to the same rank that is still in flight: the engines work
        through one rank's batches in order, so a batch waiting its turn behind a long one has
        not started, and is within its bound while the one ahead is."""
        per_conn: dict = {}
        for batches in moving.values():
            for u in batches:
                per_conn.setdefault(u.target.conn, []).append(u)
        due = {}
        for units in per_conn.values():
            ahead = float("-inf")
            for u in sorted(units, key=lambda v: v.seq):
                ahead = due[u] = max(ahead, u.clock + self.timeout_s + u.allow_s)
        return due

    def _tell_moving(self, now: float, moving: dict, due: dict, queued: dict) -> None:
        """Tells each decode rank which of its live requests have an engine batch (push) or a
        pull in flight here past `MOVING_AFTER_S` and within its bound (``timeout_s`` + its
        allowance), in ``moving`` frames of ``[rid, inc, lease_ms]``: the lease is the time left
        to the latest such bound, at most the rank's ``peer_timeout_s``; likewise its requests
        whose windows wait here for pack-arena room behind such batches (`_queued_deadlines`),
        once they have had no progress for `MOVING_AFTER_S`. A rank gets a frame at most
        once per ``heartbeat_s`` while it has such requests (the lease outlasts the gap to the next),
        sooner only when one is not in its last frame; none when it has none."""
        per_conn: dict = {}

        def lease(req, t, until):  # (rid, inc) -> the latest lease, at most the rank's peer_timeout_s
            entries = per_conn.setdefault(t.conn, {})
            key = (req.rid, t.inc)
            entries[key] = max(entries.get(key, 0.0), min(until - now, t.conn.peer_timeout_s))

        for req, batches in moving.items():
            if req.status.terminal or self._requests.get(req.rid) is not req:
                continue
            for u in batches:
                if now - u.clock < MOVING_AFTER_S or due[u] <= now:
                    continue  # short so far (no frame), or past its bound: stuck, reported no more
                lease(req, u.target, due[u])
        for req, targets in queued.items():  # windows waiting their turn behind batches in flight
            if self._requests.get(req.rid) is not req or req.state.stalled_for(now) < MOVING_AFTER_S:
                continue
            for t, until in targets.items():
                lease(req, t, until)  # `_queued_deadlines` keeps only deadlines still ahead
        for conn in self._conns.values():
            entries = per_conn.get(conn)
            if not entries:
                if conn.moving_told:
                    conn.moving_told = set()
                continue
            conn.moving_told &= entries.keys()
            if now - conn.moving_at < self.heartbeat_s and entries.keys() <= conn.moving_told:
                continue
            conn.moving_at, conn.moving_told = now, set(entries)
            reqs = [[rid, inc, min(proto.MAX_LEASE_MS, int(lease * 1000))] for (rid, inc), lease in entries.items()]
            for i in range(0, len(reqs), proto.MAX_MOVING):
                self._tell(conn.ident, proto.encode("moving", reqs=reqs[i:i + proto.MAX_MOVING]))

    def _batches_in_flight(self) -> dict:
        """Every request's posted engine batches (push) and pulls not yet reported done."""
        out: dict = {}
        for u in self._inflight + list(self._pulls.values()):
            if u.clock is not None:
                out.setdefault(u.req, []).append(u)
        return out

    def _forget_unsent(self, req: SendRequest) -> None:
        """Drops a request this side never sent to (`send` was never called) `timeout_s` after it
        ended: FAILED or ABORTED (decode ranks announced it, then aborted or released it), or
        SUCCESS (every rank announced a full prefix hit: nothing to send, so a router skips the
        prefill). The prefill does not know its id, so nothing would `release` it and each such
        request would be held forever. A `send` for the id afterwards starts a new request (which fails after
        `timeout_s` if no rank announces it again). Its record answers `poll` and the like for
        `timeout_s` more (`KVSender._forgotten`), unless the id starts a new request first; as
        after `release`, a rank announcing it only in that time is told how it ended (FAILED,
        ABORTED), not started a request nobody sends."""
        del self._requests[req.rid]
        until = time.monotonic() + self.timeout_s
        self._forgotten[req.rid] = (until, req)
        self._keep_ending(req, until)
        self._replay_early(req.rid)  # announcements of the id's next use

    def _keep_ending(self, req: SendRequest, until: float) -> None:
        """Until ``until``, a decode rank that announces ``req``'s id only now (it had not) is
        told how the request ended, FAILED or ABORTED (`_on_expect`), instead of starting one
        nobody sends; the ranks that had announced it announce the id's next use. Called when
        the request is released (`KVSender.release`) or dropped unsent (`_forget_unsent`)."""
        if req.status is not TransferStatus.SUCCESS:
            self._released_ended[req.rid] = (until, set(req.targets) | set(req.told), req.status, req.state.reason)


def _stuck_batch(batches: list, now: float, timeout_s: float, due: dict) -> str:
    """The failure reason's tail for a request whose oldest engine batch in flight ran past its
    bound (``timeout_s`` + `batch_allowance`, or later behind another batch to the same rank:
    ``due``, `SenderEndings._batch_deadlines`), or "" when none is in flight."""
    if not batches:
        return ""
    u = min(batches, key=lambda v: v.clock)
    behind = due[u] > u.clock + timeout_s + u.allow_s + 1e-9
    what = "a pull (the rank's READ)" if u.target.conn.direction == "pull" else "an engine batch"
    return (f"; {what} to decode rank {u.target.conn.spec.dcp_rank} ({u.descriptors:,} descriptors, "
            f"{u.batch_bytes:,} bytes, chunk {u.rc.chunk}) has not completed in {now - u.clock:.1f} s, past its "
            f"bound of {due[u] - u.clock:.1f} s (timeout_s + {BATCH_DESCRIPTOR_S * 1e3:g} ms a descriptor "
            f"+ 1 s per {BATCH_BYTES_PER_S / 1e6:g} MB{', behind an earlier batch to that rank' if behind else ''})")


def _waiting_for(req: SendRequest) -> str:
    """What a stalled request still waits for, for its failure reason: ranks that never
    announced it (no ``expect`` arrived), nothing sent yet, the token ranges ``send()`` has not
    given, or the ranks whose windows are still in flight or not yet confirmed."""
    if not req.targets:
        return ": no decode rank announced this request (no expect arrived: is a receiver connected and expecting it?)"
    if req.needed is not None and not req.needed <= req.targets.keys():
        missing = sorted(req.needed - req.targets.keys())
        return f": decode rank(s) {missing[:8]} of group {req.group!r} never announced it (no expect arrived)"
    if not req.chunks:
        return ": every rank announced it, but send() was never called for it"
    ts = list(req.targets.values())
    prefix, stop = min(t.prefix_tokens for t in ts), max(t.num_tokens for t in ts)
    unsent = req.sent.gaps(prefix, stop)
    if unsent:
        return f"; send() has not given tokens {ranges_text(unsent)} of the {stop} the ranks expect"
    moving = sorted((r, t.inflight) for r, t in req.targets.items() if not t.complete and t.inflight)
    if moving:
        ranks = ", ".join(f"{r} ({n})" for r, n in moving[:8]) + (" ..." if len(moving) > 8 else "")
        return f"; windows still in flight (no completion from the engine) to decode rank(s) {ranks}"
    waiting = sorted(r for r, t in req.targets.items() if not t.complete)
    if waiting:
        return f"; decode rank(s) {waiting[:8]} have windows not yet confirmed (queued, or waiting for room)"
    return ""
