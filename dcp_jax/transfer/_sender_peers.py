"""The sender's side of its connections: handshakes, announcements, heartbeats, lost peers.

Half of the worker-thread machinery of `dcp_jax.transfer.KVSender` (a mixin: the state it works
on is created in ``KVSender.__init__``; `SenderUnits` is the other half). Every method runs on
the worker thread under the sender's lock.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from bridge import PeerInfo
from dcp_jax.layout import local_len_np
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._region import PeerOffer, choose_path, ipc_open
from dcp_jax.transfer._worker import check_page_table, pings_fit
from pallas_kernels import RowCopier
from dcp_jax.transfer.requests import RankTarget, SendRequest, check_request_id
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec, check_compatible
from dcp_jax.transfer.status import TransferStatus
from dcp_jax.transfer.views import served_group_ranks, stream_view, uses_views, view_path

__all__ = ["SenderPeers", "Conn"]

logger = logging.getLogger("dcp_jax.transfer.sender")
#: Refusals logged per process before the log goes quiet (each is still counted).
MAX_LOGGED_REFUSALS = 1000
_logged = [0]


def _warn(fmt: str, *args) -> None:
    """A refused or dropped peer message, logged with its reason (the first
    `MAX_LOGGED_REFUSALS` of them: a flood of garbage must not flood the log)."""
    _logged[0] += 1
    if _logged[0] <= MAX_LOGGED_REFUSALS:
        logger.warning(fmt, *args)


_UNBOUNDED_PAGES = 1 << 40  # page-id bound for a staged rank (its own `expect` checks its cache)


def _cache_pages(info: PeerInfo, bases: np.ndarray, spec: KVCacheSpec) -> int:
    """Pages of a decode rank's cache that lie inside the regions its engine registered
    (every layer's base must be inside one): the bound its announced page ids must respect.

    Raises:
        HandshakeError: a layer base outside every advertised region.
    """
    pages = None
    for layer, (base, item_len) in enumerate(zip(bases.tolist(), spec.item_lens)):
        reg = next((r for r in info.regions if r.addr <= base < r.addr + r.nbytes), None)
        if reg is None:
            raise HandshakeError("layer_bases", "inside the registered regions", hex(base),
                                 f"layer {layer}'s base is in no region the peer's engine registered")
        n = (reg.addr + reg.nbytes - base) // (spec.page_size * item_len)
        pages = n if pages is None else min(pages, n)
    return int(pages or 0)


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
            if kind == "_bad_version":
                return self._nack(ident, HandshakeError("version", proto.PROTOCOL_VERSION, msg["v"]))
            self._counts["dropped_messages"] += 1
            _warn("dropped a %r for request %r from %s: it did not complete the handshake (not handshaked)",
                  kind, msg.get("rid", ""), ident.hex())
            # A receiver this side dropped (silent too long) or never knew (it restarted) learns
            # it at once, instead of announcing requests nobody serves until its peer timeout.
            self._ctl.send(ident, proto.encode("hello_nack", field="connection", ours="handshaked",
                                               theirs="unknown", message="this sender holds no connection "
                                               "from you (dropped or restarted): connect again"))
            return
        conn.last_seen = time.monotonic()
        if kind == "expect":
            return self._on_expect(conn, msg)
        if kind == "pull_done":
            return self._on_pull_done(conn, msg)
        if kind == "region_grant":
            return self._on_region_grant(conn, msg)
        if kind in ("abort", "failed"):
            req = self._requests.get(msg["rid"])
            t = req.targets.get(conn.spec.group_rank) if req is not None else None
            if t is None or t.inc != msg["inc"] or t.conn is not conn:
                # Nothing of ours is in flight for that incarnation: the rank may reuse its pages.
                self._ctl.send(conn.ident, proto.encode("drained", msg["rid"], msg["inc"]))
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
        elif kind != "ping":
            self._counts["dropped_messages"] += 1

    def _on_hello(self, ident: bytes, msg: dict) -> None:
        try:
            spec = KVCacheSpec.from_dict(msg["spec"])
            check_compatible(self.spec, spec, side="prefill")
            if msg["direction"] not in ("push", "pull"):
                raise HandshakeError("direction", "push|pull", msg["direction"])
            self._check_liveness(msg)
            # The same receiver on a second live connection is refused; one whose old connection
            # went quiet (it dropped us as silent and connects again) replaces it below.
            fresh = time.monotonic() - max(2 * self.heartbeat_s, 1.0)
            if any(c.name == msg["name"] and c.ident != ident and c.last_seen > fresh for c in self._conns.values()):
                raise HandshakeError("connection", "one per receiver", "a second one",
                                     f"receiver {msg['name']!r} is already connected (another address spelling?)")
            group = [c for c in self._conns.values() if c.group == msg["group"] and c.ident != ident]
            for c in group:
                for field in ("dcp_size", "interleave_size", "tp_size"):
                    if getattr(c.spec, field) != getattr(spec, field):
                        raise HandshakeError(field, getattr(c.spec, field), getattr(spec, field),
                                             f"decode group {msg['group']!r} already has rank {c.spec.dcp_rank} with it")
            bases = proto.unpack_i64(msg["layer_bases"], "layer_bases", max_items=self.spec.num_layers)
            if len(bases) != self.spec.num_layers:
                raise HandshakeError("layer_bases", self.spec.num_layers, len(bases))
            info = PeerInfo.from_dict(msg["peer"])
            offer = PeerOffer.of_hello(msg)
            # A staged receiver's pages are not registered (only its region is), and no
            # descriptor of ours addresses them: it checks its page ids against its own cache.
            cache_pages = _UNBOUNDED_PAGES if offer.staged else _cache_pages(info, bases, spec)
            view = self._view_of(spec, msg) if uses_views(self.spec, spec) else None
            path = view_path(self.mode, view, spec.num_layers, self._layers.mem_type, offer) if view is not None \
                else choose_path(self.mode, sender_mem=self._layers.mem_type, offer=offer,
                                 dst_interleave=spec.interleave_size, page_size=self.spec.page_size,
                                 row_bytes=self.spec.row_bytes, sender_staged=self.staged)
        except HandshakeError as exc:
            return self._nack(ident, exc)
        except (TypeError, ValueError, proto.ProtocolError) as exc:
            return self._nack(ident, HandshakeError("spec", None, None, f"not a valid hello: {exc}"))
        for old in [c for c in group if c.spec.group_rank == spec.group_rank]:
            self._drop_conn(old, f"decode rank {spec.dcp_rank} reconnected")
        if self._hold_hello(ident, msg):
            return
        mapping = copier = None
        if path == "fused":  # opened once per connection, closed when it is dropped or at close
            try:
                mapping = ipc_open(list(offer.ipc), self._layers.item_lens)
            except Exception as exc:  # noqa: BLE001 - bad or unopenable handles: refuse, name why
                return self._nack(ident, HandshakeError("ipc", None, None, "its CUDA IPC handles cannot be opened: " +
                                                        f"{type(exc).__name__}: {exc}"))
            try:  # its checks now, not in the first request's round; `KVSender.warm_up` needs it
                copier = RowCopier(self._source, mapping.arrays)
            except Exception as exc:  # noqa: BLE001 - mapped layers the copy cannot take: refuse
                mapping.close()
                return self._nack(ident, HandshakeError("ipc", None, None, "its mapped KV layers cannot take the "
                                                        f"fused copy: {type(exc).__name__}: {exc}"))
        try:
            peer = self.engine.add_peer(info)
        except Exception as exc:  # noqa: BLE001 - refused metadata: tell the receiver why
            if mapping is not None:
                copier.close()
                mapping.close()
            return self._nack(ident, HandshakeError("peer", None, None, f"its engine metadata cannot be used: {exc}"))
        self._conns[ident] = Conn(ident, msg["name"], peer, spec, msg["group"], msg["direction"],
                                   bases, time.monotonic(), path, offer.region_addr, offer.region_bytes, mapping,
                                   staged=offer.staged)
        self._conns[ident].cache_pages = cache_pages
        self._conns[ident].copier = copier
        self._conns[ident].view = view
        self._counts["handshakes"] += 1
        for req in self._requests.values():  # sent before any rank connected: may need nobody here
            if req.needed is None and req.chunks and not req.status.terminal:
                self._to_plan[req] = None
        self._ctl.send(ident, proto.encode(
            "hello_ack", spec=self.spec.to_dict(), peer=self.engine.peer_info().to_dict(),
            layer_bases=proto.pack_i64(self._layers.bases), name=self.engine.name, path=path, staged=self.staged,
            flag=self._flag_name() if path == "fused" else ""))

    def _view_of(self, spec: KVCacheSpec, msg: dict) -> Any:
        """The pair's `views.StreamView` (its path: `views.view_path`); pushed only.

        Raises:
            HandshakeError: a pull, or a hello without its pages.
        """
        if msg["direction"] != "push":
            raise HandshakeError("direction", "push", msg["direction"], "a TP or layout pair is pushed by the sender")
        if msg["num_pages"] < 1:
            raise HandshakeError("num_pages", None, None, "the hello states no cache pages; a per-head layout needs them")
        return stream_view(self.spec, spec, self._layers.min_rows // self.spec.page_size, msg["num_pages"])

    def _check_liveness(self, msg: dict) -> None:
        """Refuses a receiver whose pings would not reach us inside our ``peer_timeout_s`` twice
        over, or whose silence limit our pings would not keep: either side would drop a healthy
        connection as silent (`pings_fit`)."""
        hb, pt = msg["heartbeat_ms"] / 1000, msg["peer_timeout_ms"] / 1000
        if not pings_fit(self.heartbeat_s, pt):
            raise HandshakeError("peer_timeout_s", None, None, f"this sender pings every {self.heartbeat_s:g} s; "
                                 f"the receiver's peer_timeout_s={pt:g} must be >= 2 x that")
        if not pings_fit(hb, self.peer_timeout_s):
            raise HandshakeError("heartbeat_s", None, None, f"the receiver pings every {hb:g} s; this sender's "
                                 f"peer_timeout_s={self.peer_timeout_s:g} must be >= 2 x that")

    def _hold_hello(self, ident: bytes, msg: dict) -> bool:
        """True (the hello waits) while a WRITE of an earlier, dropped connection of the same
        receiver is still in flight: that receiver counted those requests' pages as given back when
        it dropped us (or we it), and a write of ours may still land in them. Its new connection is
        answered only once the engine reported every such write ended, so a receiver whose
        ``connect`` succeeded knows nothing of the old connection can land any more. Held at most
        ``timeout_s``, then refused (``hello_nack(field="connection")``)."""
        name = msg["name"]
        busy = sum(1 for u in self._inflight if u.target.conn.name == name and u.target.conn.ident not in self._conns)
        first = self._held_hellos.get(ident, (msg, time.monotonic()))[1]
        if not busy:
            self._held_hellos.pop(ident, None)
            return False
        if time.monotonic() - first > self.timeout_s:
            self._held_hellos.pop(ident, None)
            self._nack(ident, HandshakeError("connection", "no write of your old connection in flight",
                                             f"{busy} still in flight", f"writes of receiver {name!r}'s previous "
                                             f"connection did not end within {self.timeout_s:g} s"))
            return True
        if ident not in self._held_hellos:
            self._counts["held_hellos"] += 1
            logger.warning("holding the handshake of %s: %d write(s) of its previous connection still in flight",
                           name, busy)
        self._held_hellos[ident] = (msg, first)
        return True

    def _retry_held_hellos(self) -> None:
        for ident, (msg, _) in list(self._held_hellos.items()):
            self._on_hello(ident, msg)

    def _on_stall(self, gap: float) -> None:
        """This worker did not run for ``gap`` seconds (the process was stopped or starved): a
        receiver that heard nothing from us for its ``peer_timeout_s`` dropped us, failed our
        requests and may have given their pages to new requests, while our queued windows and its
        stale pings still wait here. Nothing more is posted on any connection: every one is
        dropped (its requests FAIL); receivers that still hold theirs learn it from the
        ``failed`` messages or a ``hello_nack`` and connect again."""
        self._counts["stalls"] += 1
        reason = (f"this sender was stalled for {gap:.1f} s (> {self._stall_s:g} s): its receivers may have "
                  "dropped it as silent")
        for conn in list(self._conns.values()):
            self._drop_conn(conn, reason)

    def _nack(self, ident: bytes, exc: HandshakeError) -> None:
        self._counts["handshakes_refused"] += 1
        _warn("refused a handshake from %s: %s", ident.hex(), str(exc)[:300])  # the error's own words
        def plain(v):  # msgpack-able as is: scalars and lists of them; anything else as text
            if isinstance(v, (tuple, list)) and all(isinstance(x, (int, str)) for x in v):
                return list(v)
            return v if isinstance(v, (int, str, float, bool, type(None))) else repr(v)

        self._ctl.send(ident, proto.encode("hello_nack", field=exc.field, ours=plain(exc.ours),
                                           theirs=plain(exc.theirs), message=exc.detail[:proto.MAX_TEXT]))

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
        if req is not None and req.status.terminal:
            if rank in req.targets or req.status is TransferStatus.SUCCESS:
                # This rank already had this id: the decode side released and reused it.
                self._early.setdefault(rid, []).append((conn, msg))
            else:  # a late announcement of the request that ended: tell the rank how it ended
                kind = "abort" if req.status is TransferStatus.ABORTED else "failed"
                self._ctl.send(conn.ident, proto.encode(kind, rid, msg["inc"], reason=req.state.reason))
                self._ctl.send(conn.ident, proto.encode("drained", rid, msg["inc"]))  # nothing was sent
            return
        if req is None:
            req = self._new_request(rid)
        old = req.targets.get(rank)
        if old is not None or (req.group is not None and req.group != conn.group):
            self._counts["dropped_messages"] += 1  # a duplicate or a second group: not ours
            _warn("dropped an announcement of request %r from decode rank %d (%s): a duplicate or "
                  "another group's", rid, rank, conn.name)
            return
        if req.needed is None:
            try:
                needed = served_group_ranks(self.spec, conn.spec)
            except HandshakeError:  # a pairing no rank of the group was refused for: wait for all
                needed = frozenset(range(conn.spec.group_size))
            req.group, req.needed = conn.group, needed
        req.targets[rank] = RankTarget(conn, msg["inc"], msg["num_tokens"], msg["prefix_tokens"], table)
        self._to_plan[req] = None
        req.state.touch()
        self._maybe_done(req)

    def _new_request(self, rid: str) -> SendRequest:
        req = self._requests[rid] = SendRequest(rid)
        self._counts["requests"] += 1
        return req

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if now - conn.last_seen > self.peer_timeout_s:
                self._drop_conn(conn, f"decode rank {conn.spec.dcp_rank} silent for {self.peer_timeout_s:g} s")
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            ping = proto.encode("ping")
            for conn in list(self._conns.values()):
                self._ctl.send(conn.ident, ping)

    def _drop_conn(self, conn: Conn, reason: str) -> None:
        """A receiver is gone: fail its requests, forget its engine peer (its handles then end)."""
        logger.warning("dropping the connection of decode rank %d (%s): %s", conn.spec.dcp_rank, conn.name, reason)
        self._conns.pop(conn.ident, None)
        for req in list(self._requests.values()):
            t = req.targets.get(conn.spec.group_rank)
            if t is not None and t.conn is conn:
                self._end(req, TransferStatus.FAILED, reason, notify="failed")
        for key, u in list(self._pulls.items()):
            if u.target.conn is conn:  # a dead reader reads no more: its regions are free
                del self._pulls[key]
                self._unit_finished(u, reason)
        self._drop_asks(lambda u: u.target.conn is conn)
        conn.close_mapping()
        try:
            self.engine.remove_peer(conn.peer)
        except Exception:  # noqa: BLE001 - already gone
            pass
