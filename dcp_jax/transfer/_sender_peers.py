"""The sender's side of its connections: messages, announcements, heartbeats, stalls, lost peers.

Part of the worker-thread machinery of `dcp_jax.transfer.KVSender` (a mixin: the state it works
on is created in ``KVSender.__init__``; `SenderHandshake` makes the connections, `SenderUnits`
moves the windows). Every method runs under the sender's lock, on the worker thread unless
named (an abort or a release ends a request on the caller's thread: `_tell` queues its frames).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from dcp_jax.layout import local_len_np
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._worker import check_page_table
from dcp_jax.transfer.requests import RankTarget, SendRequest, check_request_id
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec
from dcp_jax.transfer.status import TransferStatus
from dcp_jax.transfer.views import served_group_ranks

__all__ = ["SenderPeers", "Conn"]

logger = logging.getLogger("dcp_jax.transfer.sender")
#: Refusals logged per process before the log goes quiet (each is still counted).
MAX_LOGGED_REFUSALS = 1000
_logged = [0]
#: Longest wait (s) for a closing rank's WRITEs in flight before its connection is dropped anyway.
BYE_DRAIN_S = 2.0


def _warn(fmt: str, *args) -> None:
    """A refused or dropped peer message, logged with its reason (the first
    `MAX_LOGGED_REFUSALS` of them: a flood of garbage must not flood the log)."""
    _logged[0] += 1
    if _logged[0] <= MAX_LOGGED_REFUSALS:
        logger.warning(fmt, *args)


@dataclasses.dataclass(eq=False)
class Conn:
    """One connected decode rank (its control identity, engine peer and cache geometry)."""

    ident: bytes
    name: str
    peer: str
    spec: KVCacheSpec
    group: str
    direction: str
    layer_bases: np.ndarray
    last_seen: float
    path: str = "direct"        # the transfer path chosen at the handshake (`_region.choose_path`)
    region_addr: int = 0        # region path: the rank's receive region (bytes)
    region_bytes: int = 0
    mapping: Any = None         # fused path: the rank's KV layers mapped here (`bridge.cuda_ipc.IpcMapping`)
    copier: Any = None          # fused path: `pallas_kernels.RowCopier` into `mapping` (made at the handshake)
    cache_pages: int = 0        # pages of the rank's cache inside its registered regions
    staged: bool = False        # the rank stages: its KV is not registered (`dcp_jax.transfer.staging`)
    view: Any = None            # TP or layout pair: its `views.StreamView` (head pieces, both layouts)
    heartbeat_s: float = 0.5    # how often the rank pings (its hello)
    closing: Any = None         # (reason, since) once the rank said bye: `SenderPeers._drop_closing`
    peer_timeout_s: float = 1.0  # how long the rank waits for our pings before it drops us (its hello)
    moving_at: float = 0.0      # when the last ``moving`` frame went to it (`SenderEndings._tell_moving`)
    moving_told: set = dataclasses.field(default_factory=set)  # (rid, inc) that frame held, still in flight
    queue_moved_at: float = float("-inf")  # a window to it last left the queue or gave its pack room back

    def stall_limit(self, our_heartbeat_s: float) -> float:
        """Seconds this sender's worker may stand still before the rank may have dropped it as
        silent: its ``peer_timeout_s`` less 1.5 of our ping intervals (the last ping may have
        left up to one interval before the stop), at least half its ``peer_timeout_s``."""
        return max(self.peer_timeout_s - 1.5 * our_heartbeat_s, self.peer_timeout_s / 2)

    def live(self, now: float) -> bool:
        """Heard from within two of its own ping intervals (`_worker.pings_fit`'s margin), and
        not closing (it said bye)."""
        return self.closing is None and now - self.last_seen <= 2 * self.heartbeat_s

    def close_mapping(self) -> None:
        """Closes the IPC mapping (once; at close or when the connection is dropped), after
        dropping the copier that writes into it."""
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        m, self.mapping = self.mapping, None
        if m is not None:
            try:
                m.close()
            except Exception:  # noqa: BLE001 - the peer's memory may already be gone
                logger.debug("closing an IPC mapping failed", exc_info=True)


class SenderPeers:
    """Handshakes, announcements, aborts from decode ranks, heartbeats and lost peers."""

    def _on_message(self, ident: bytes, msg: dict) -> None:
        kind = msg["k"]
        if kind == "hello":
            return self._on_hello(ident, msg)
        conn = self._conns.get(ident)
        if conn is None:
            if kind == "bye":  # a connection this side already dropped, or one that never finished
                self._held_hellos.pop(ident, None)
                return
            if kind == "_bad_version":
                return self._nack(ident, HandshakeError("version", proto.PROTOCOL_VERSION, msg["v"]))
            if kind == "_refused":  # a malformed frame of a stranger: counted (rejected), unanswered
                return
            self._counts["dropped_messages"] += 1
            _warn("dropped a %r for request %r from %s: it did not complete the handshake (not handshaked)",
                  kind, msg.get("rid", ""), ident.hex())
            # A receiver this side dropped (silent too long) or never knew (it restarted) learns
            # it at once, instead of announcing requests nobody serves until its peer timeout.
            self._tell(ident, proto.encode("hello_nack", field="connection", ours="handshaked",
                                          theirs="unknown", message="this sender holds no connection "
                                          "from you (dropped or restarted): connect again"))
            return
        conn.last_seen = time.monotonic()
        if kind == "expect":
            return self._on_expect(conn, msg)
        if kind == "_refused":
            return self._on_refused(conn, msg)
        if kind == "pull_done":
            return self._on_pull_done(conn, msg)
        if kind == "region_grant":
            return self._on_region_grant(conn, msg)
        if kind in ("abort", "failed"):
            req = self._requests.get(msg["rid"])
            t = req.targets.get(conn.spec.group_rank) if req is not None else None
            if t is None or t.inc != msg["inc"] or t.conn is not conn:
                # Nothing of ours is in flight for that incarnation: the rank may reuse its pages.
                # An announcement of it parked for the id's next use is void: replayed at the
                # release, it would send into pages the rank has given to another request.
                if self._drop_early(msg["rid"], lambda c, m: c is conn and m["inc"] == msg["inc"]):
                    self._cancelled_early.setdefault(msg["rid"], {})[conn.spec.group_rank] = msg["inc"]
                self._tell(conn.ident, proto.encode("drained", msg["rid"], msg["inc"]))
                self._counts["dropped_messages"] += 1
                if t is not None and t.conn is not conn:  # another connection's request
                    _warn("dropped a %r for request %r from decode rank %d (%s): not its request", kind,
                          msg["rid"], conn.spec.dcp_rank, conn.name)
                return
            if req.status.terminal:
                self._counts["dropped_messages"] += 1
                self._maybe_drained(req, t, asked=True)
                return
            status = TransferStatus.ABORTED if kind == "abort" else TransferStatus.FAILED
            self._end(req, status, f"decode rank {conn.spec.dcp_rank}: {msg['reason']}", notify=kind)
        elif kind == "bye":  # closed or dropped on purpose: dropped once its writes in flight ended
            conn.closing = (f"decode rank {conn.spec.dcp_rank} ({conn.name}) ended the connection: {msg['reason']}",
                            time.monotonic())
            self._drop_closing()
        elif kind != "ping":
            self._counts["dropped_messages"] += 1

    def _update_stall_limit(self) -> None:
        """``_stall_s``: the shortest `Conn.stall_limit` of the connections (inf with none), what
        the worker compares its own gaps with before reading or posting anything."""
        self._stall_s = min((c.stall_limit(self.heartbeat_s) for c in self._conns.values()), default=float("inf"))

    def _on_stall(self, gap: float) -> None:
        """This worker did not run for ``gap`` seconds (the process was stopped or starved): a
        receiver that heard nothing from us for its ``peer_timeout_s`` dropped us, failed our
        requests and may have given their pages to new requests, while our queued windows and its
        stale pings still wait here. Nothing more is posted on such a connection: each one whose
        receiver may have dropped us (`Conn.stall_limit` < ``gap``, by that receiver's own
        ``peer_timeout_s``) is dropped (its requests FAIL); receivers that still hold theirs learn
        it from the ``bye`` or a ``hello_nack`` and connect again. Connections of receivers
        that wait longer live on."""
        self._counts["stalls"] += 1
        for conn in list(self._conns.values()):
            limit = conn.stall_limit(self.heartbeat_s)
            if gap > limit:
                self._drop_conn(conn, f"this sender was stalled for {gap:.1f} s (> {limit:g} s): decode rank "
                                f"{conn.spec.dcp_rank} may have dropped it as silent")

    def _on_expect(self, conn: Conn, msg: dict) -> None:
        rid, rank = msg["rid"], conn.spec.group_rank  # the (DCP, TP) rank: its key in req.targets
        try:
            check_request_id(rid)
            if msg["dcp_rank"] != conn.spec.dcp_rank or msg["prefix_tokens"] > msg["num_tokens"]:
                raise proto.ProtocolError("expect: rank or token range inconsistent")
            table = proto.unpack_i64(msg["page_table"], "page_table")
            s = conn.spec  # once per announcement, so planning each chunk need not check it again
            rows = int(local_len_np(msg["num_tokens"], s.dcp_size, s.dcp_rank, s.interleave_size))
            table = check_page_table(table, rows, s.page_size, conn.cache_pages)
            need = -(-rows // s.page_size)
            if len(table) > need:
                raise ValueError(f"page_table has {len(table)} pages; {need} are needed for {rows} local rows "
                                 "(longer than the request)")
        except (TypeError, ValueError) as exc:
            _warn("refused an announcement of request %r from decode rank %d (%s): %s", rid, rank, conn.name,
                  str(exc)[:300])
            self._counts["dropped_messages"] += 1
            return
        req = self._requests.get(rid)
        if req is not None and req.group is not None and req.group != conn.group:
            # One id names one request here, held by the group that announced it first until this
            # side releases it: another decode group's use is refused at once (nothing is written
            # to that rank), not left to wait out its timeout_s.
            self._counts["dropped_messages"] += 1
            reason = (f"request id {rid!r} is taken on this prefill sender by decode group {req.group!r}: "
                      f"one id names one request (give each decode instance's request its own id)")
            _warn("refused an announcement of request %r from decode rank %d (%s) of group %r: %s", rid, rank,
                  conn.name, conn.group, reason)
            self._tell_ended(conn, rid, msg["inc"], TransferStatus.FAILED, reason)
            return
        if req is not None and req.told.get(rank) not in (None, msg["inc"]):
            # A rank told of, or cancelled, another incarnation of this id: this one is the id's
            # next use, parked until this request is released or dropped.
            self._early.setdefault(rid, []).append((conn, msg))
            return
        if req is not None and req.status.terminal:
            if rank in req.targets or req.status is TransferStatus.SUCCESS:
                # This rank already had this id: the decode side released and reused it.
                self._early.setdefault(rid, []).append((conn, msg))
            else:  # a late announcement of the request that ended: tell the rank how it ended
                self._tell_ended(conn, rid, msg["inc"], req.status, req.state.reason)
                req.told[rank] = msg["inc"]  # (`release` files it with the targets: its next use is new)
            return
        if req is None:
            gone = self._released_ended.get(rid)
            if gone is not None and time.monotonic() < gone[0] and rank not in gone[1]:
                # Released here before this rank announced it: tell it how it ended, not a wait
                # of timeout_s for a transfer nobody will send. (A rank that had announced it
                # announces the id's next use: a new request.)
                self._tell_ended(conn, rid, msg["inc"], gone[2], gone[3])
                gone[1].add(rank)  # told: its next announcement of the id is a new use
                return
            req = self._new_request(rid)
        old = req.targets.get(rank)
        if old is not None:
            self._counts["dropped_messages"] += 1  # a duplicate: not ours
            _warn("dropped an announcement of request %r from decode rank %d (%s): a duplicate", rid, rank,
                  conn.name)
            return
        if req.needed is None:
            try:
                needed = served_group_ranks(self.spec, conn.spec)
            except HandshakeError:  # a pairing no rank of the group was refused for: wait for all
                needed = frozenset(range(conn.spec.group_size))
            req.group, req.needed = conn.group, needed
        first = next(iter(req.targets.items()), None)
        req.targets[rank] = RankTarget(conn, msg["inc"], msg["num_tokens"], msg["prefix_tokens"], table)
        if first is not None and (first[1].num_tokens, first[1].prefix_tokens) != (msg["num_tokens"], msg["prefix_tokens"]):
            # One request has one length and one prefix hit in its whole group: a rank that says
            # otherwise would wait for tokens never sent (or take rows past its pages), and the
            # request would fail only at timeout_s as "tokens [a, b) have not landed".
            (r0, t0) = first
            self._end(req, TransferStatus.FAILED, (
                f"the decode ranks announced request {rid!r} differently: rank {r0} num_tokens={t0.num_tokens} "
                f"prefix_tokens={t0.prefix_tokens}, rank {rank} num_tokens={msg['num_tokens']} "
                f"prefix_tokens={msg['prefix_tokens']} (one request has one length and prefix on every rank)"),
                notify="failed")
            return
        self._to_plan[req] = None
        req.state.touch()
        self._maybe_done(req)

    def _replay_early(self, rid: str) -> None:
        """The announcements parked for ``rid``'s next use, taken up now that the request holding
        the id is gone (released, or dropped unsent). Ranks whose parked announcement was
        cancelled meanwhile are marked on the request the rest start as having had the id: their
        next announcement is a later use, not a late one of this (`_on_expect`)."""
        cancelled = self._cancelled_early.pop(rid, {})
        for conn, msg in self._early.pop(rid, []):
            self._on_expect(conn, msg)
        req = self._requests.get(rid)
        if req is not None and cancelled:
            for rank, inc in cancelled.items():
                if rank not in req.targets:
                    req.told.setdefault(rank, inc)

    def _drop_early(self, rid: str, pred) -> bool:
        """Forgets the announcements parked for ``rid``'s next use (`_early`) that ``pred(conn,
        msg)`` names: cancelled by their rank, or of a connection that is gone. True if any."""
        parked = self._early.get(rid)
        if not parked:
            return False
        kept = [(c, m) for c, m in parked if not pred(c, m)]
        if kept:
            self._early[rid] = kept
        else:
            del self._early[rid]
        return len(kept) < len(parked)

    def _on_refused(self, conn: Conn, msg: dict) -> None:
        """A frame of this rank's that `protocol.decode` refused, naming one of its requests
        (`protocol.refusal`): the request fails now, and its ranks hear why, instead of both
        sides waiting out ``timeout_s`` for what the frame was to bring. Only a request this
        connection takes part in, of that incarnation: a frame naming another's is dropped."""
        why = f"decode rank {conn.spec.dcp_rank} sent a malformed {msg['what']} frame (refused here): {msg['reason']}"
        req = self._requests.get(msg["rid"])
        t = req.targets.get(conn.spec.group_rank) if req is not None else None
        if msg["what"] == "expect" and (t is None or t.inc != msg["inc"] or t.conn is not conn):
            # An announcement this side could not take: only its rank hears it, at once (failed,
            # then drained: nothing was sent to it). A request of that id here belongs to other
            # connections or another incarnation (as for a good announcement): left alone.
            return self._tell_ended(conn, msg["rid"], msg["inc"], TransferStatus.FAILED, why[:proto.MAX_TEXT])
        if msg["what"] == "pull_done" and msg["window"] is not None:
            chunk, part = msg["window"]
            u = self._pulls.get((msg["rid"], msg["inc"], conn.spec.dcp_rank, chunk, part))
            if u is not None and u.target.conn is conn:  # any pull_done says the read is over
                return self._on_pull_done(conn, dict(rid=msg["rid"], inc=msg["inc"], chunk=chunk, part=part,
                                                     ok=False, reason=why))
        if t is None or t.inc != msg["inc"] or t.conn is not conn or req.status.terminal:
            self._counts["dropped_messages"] += 1
            return
        self._end(req, TransferStatus.FAILED, why, notify="failed")

    def _tell_ended(self, conn: Conn, rid: str, inc: int, status: TransferStatus, reason: str) -> None:
        """Answers a late announcement of a request that ended without success: how it ended,
        then ``drained`` (nothing of it was sent to this rank)."""
        kind = "abort" if status is TransferStatus.ABORTED else "failed"
        self._tell(conn.ident, proto.encode(kind, rid, inc, reason=reason))
        self._tell(conn.ident, proto.encode("drained", rid, inc))

    def _new_request(self, rid: str) -> SendRequest:
        """A new request record, "reborn" when its id was released less than timeout_s ago
        (whether a `send` or a rank's announcement starts it: `KVSender.send`'s page check)."""
        req = self._requests[rid] = SendRequest(rid)
        # The id names this request from now on: an older use's ending is answered no more (its
        # late announcements join this one, as any announcement of a live id does).
        self._released_ended.pop(rid, None)
        self._forgotten.pop(rid, None)  # the dropped request's record: the id names this one now
        req.reborn = self._released_at.pop(rid, 0.0) > time.monotonic()
        self._counts["requests"] += 1
        return req

    def _ping_peers(self) -> None:
        ping = proto.encode("ping")
        for conn in list(self._conns.values()):
            self._tell(conn.ident, ping)

    def _drop_closing(self) -> None:
        """Drops the connections whose receivers said bye once none of their WRITEs is in flight
        (or `BYE_DRAIN_S` passed): a rank that had every row of a request and closed at once
        must not fail it here only because the engine's completion was not polled yet. Nothing
        new is posted to a closing rank meanwhile (`SenderUnits._submit_units`)."""
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.closing is not None]:
            busy = any(u.target.conn is conn for u in self._inflight)
            if not busy or now - conn.closing[1] > BYE_DRAIN_S:
                self._drop_conn(conn, conn.closing[0], tell=False)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if any(c.closing is not None for c in self._conns.values()):
            self._drop_closing()
        for conn in list(self._conns.values()):
            if now - conn.last_seen > self.peer_timeout_s:
                self._drop_conn(conn, f"decode rank {conn.spec.dcp_rank} silent for {self.peer_timeout_s:g} s")
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            self._ping_peers()

    def _drop_conn(self, conn: Conn, reason: str, *, tell: bool = True) -> None:
        """A receiver is gone: fail its requests, forget its engine peer (its handles then end).
        With ``tell`` a ``bye`` (after the ``failed`` frames) tells a receiver that still listens,
        so it need not wait out its ``peer_timeout_s`` (False when the receiver said bye)."""
        # A receiver that said bye closed in order: not a warning (every clean shutdown does it).
        logger.log(logging.WARNING if tell else logging.INFO, "dropping the connection of decode rank %d (%s): %s",
                   conn.spec.dcp_rank, conn.name, reason)
        self._conns.pop(conn.ident, None)
        self._update_stall_limit()
        for req in list(self._requests.values()):
            t = req.targets.get(conn.spec.group_rank)
            # A rank that has every row of the request (its windows all done) fails nothing.
            if t is not None and t.conn is conn and not (t.complete and t.inflight == 0):
                self._end(req, TransferStatus.FAILED, reason, notify="failed")
        for key, u in list(self._pulls.items()):
            if u.target.conn is conn:  # a dead reader reads no more: its regions are free
                del self._pulls[key]
                self._unit_finished(u, reason)
        self._drop_asks(lambda u: u.target.conn is conn)
        for rid in list(self._early):  # its parked announcements: a gone rank's pages are not ours
            self._drop_early(rid, lambda c, m: c is conn)
        if tell:
            self._tell(conn.ident, proto.encode("bye", reason=reason[:proto.MAX_TEXT], drained=False))
        conn.close_mapping()
        try:
            self.engine.remove_peer(conn.peer)
        except Exception:  # noqa: BLE001 - already gone
            pass
