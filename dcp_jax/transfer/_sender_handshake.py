"""The sender's handshakes: a decode rank's ``hello`` checked, held or refused, and its connection made.

A mixin of `dcp_jax.transfer.KVSender` (its state is created in ``KVSender.__init__``); every
method runs on the worker thread under the sender's lock. A ``hello`` is answered ``hello_ack``
(with the path chosen for the pair: `_region.choose_path`, `views.view_path`) or
``hello_nack(field=...)`` naming why; it waits (held, retried every round) while the receiver's
place is taken by a connection that still pings (`SenderHandshake._hold_while_taken`) or a write
of its previous connection is still in flight (`SenderHandshake._hold_hello`).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from bridge import BridgeError, PeerInfo
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._region import PeerOffer, choose_path, ipc_open
from dcp_jax.transfer._sender_peers import Conn, _warn, logger
from dcp_jax.transfer._worker import pings_fit
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec, check_compatible
from dcp_jax.transfer.views import stream_view, uses_views, view_path
from pallas_kernels import RowCopier

__all__ = ["SenderHandshake", "MAX_TAKEN_HOLD_S"]

#: Longest wait (s) of a hello whose place a live connection holds before it is refused.
MAX_TAKEN_HOLD_S = 2.0

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



class SenderHandshake:
    """Hellos: checks, holds, refusals (``hello_nack``) and new connections (`Conn`)."""

    def _on_hello(self, ident: bytes, msg: dict) -> None:
        try:
            spec = KVCacheSpec.from_dict(msg["spec"])
            check_compatible(self.spec, spec, side="prefill")
            if msg["direction"] not in ("push", "pull"):
                raise HandshakeError("direction", "push|pull", msg["direction"])
            self._check_liveness(msg)
            group = [c for c in self._conns.values() if c.group == msg["group"] and c.ident != ident]
            for c in group:
                for field in ("dcp_size", "interleave_size", "tp_size"):
                    if getattr(c.spec, field) != getattr(spec, field):
                        raise HandshakeError(field, getattr(c.spec, field), getattr(spec, field),
                                             f"decode group {msg['group']!r} already has rank {c.spec.dcp_rank} with it")
            bases = proto.unpack_i64(msg["layer_bases"], "layer_bases", max_items=self.spec.num_layers)
            if len(bases) != self.spec.num_layers:
                raise HandshakeError("layer_bases", self.spec.num_layers, len(bases))
            try:
                info = PeerInfo.from_dict(msg["peer"])
            except BridgeError as exc:  # a PeerError: not a ValueError, named here before any engine call
                raise HandshakeError("peer", None, None, f"its engine metadata is not valid: {exc}") from None
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
        olds = [c for c in group if c.spec.group_rank == spec.group_rank]
        if self._hold_while_taken(ident, msg, spec, olds):
            return
        for old in olds:  # quiet (a crashed or stopped receiver, a refused try): the newcomer takes its place
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
        self._conns[ident].heartbeat_s = msg["heartbeat_ms"] / 1000
        self._conns[ident].peer_timeout_s = msg["peer_timeout_ms"] / 1000
        self._update_stall_limit()
        self._conns[ident].copier = copier
        self._conns[ident].view = view
        self._counts["handshakes"] += 1
        for req in self._requests.values():  # sent before any rank connected: may need nobody here
            if req.needed is None and req.chunks and not req.status.terminal:
                self._to_plan[req] = None
        self._tell(ident, proto.encode(
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

    def _hold_while_taken(self, ident: bytes, msg: dict, spec: KVCacheSpec, olds: list) -> bool:
        """True (the hello waits, or was refused) while another connection that still pings holds
        the receiver's place: the same receiver (its name) on a second connection, or another
        receiver at the same (group, DCP rank, TP rank), which would be sent that rank's rows too.
        A connection that ended said ``bye`` and is gone already; one whose process crashed, or
        a handshake its receiver refused, goes quiet, and the hello is taken once it is not
        `Conn.live`. One that pings on through two of its ping intervals after the hello came is
        alive (the hold is at most `MAX_TAKEN_HOLD_S`, inside a `connect`'s default timeout): the
        hello is refused (``hello_nack``, field ``"connection"`` for the same
        receiver, ``"position"`` for another one) and the live connection keeps its requests."""
        now = time.monotonic()
        same = [c for c in self._conns.values() if c.name == msg["name"] and c.ident != ident]
        live = [c for c in same + [c for c in olds if c not in same] if c.live(now)]
        if not live:
            return False
        first = self._held_hellos.get(ident, (msg, now))[1]
        if now - first <= min(2 * live[0].heartbeat_s, MAX_TAKEN_HOLD_S):
            if ident not in self._held_hellos:
                self._counts["held_hellos"] += 1
            self._held_hellos[ident] = (msg, first)
            return True
        self._held_hellos.pop(ident, None)
        if live[0].name == msg["name"]:
            exc = HandshakeError("connection", "one per receiver", "a second one",
                                 f"receiver {msg['name']!r} is already connected (another address spelling?)")
        else:
            exc = HandshakeError("position", None, None, f"decode group {msg['group']!r} dcp_rank {spec.dcp_rank}, "
                                 f"tp_rank {spec.tp_rank} is held by the live receiver {live[0].name!r} (heard from "
                                 f"{now - live[0].last_seen:.1f} s ago); a rank takes a position once its previous "
                                 f"holder closed (bye) or was silent for two of its pings ({2 * live[0].heartbeat_s:g} s)")
        self._nack(ident, exc)
        return True

    def _retry_held_hellos(self) -> None:
        for ident, (msg, _) in list(self._held_hellos.items()):
            self._on_frame(ident, msg)  # isolated: one that fails does not skip the round's timeouts, pings

    def _nack(self, ident: bytes, exc: HandshakeError) -> None:
        self._counts["handshakes_refused"] += 1
        _warn("refused a handshake from %s: %s", ident.hex(), str(exc)[:300])  # the error's own words
        def plain(v):  # msgpack-able as is: scalars and lists of them; anything else as text
            if isinstance(v, (tuple, list)) and all(isinstance(x, (int, str)) for x in v):
                return list(v)
            return v if isinstance(v, (int, str, float, bool, type(None))) else repr(v)

        self._tell(ident, proto.encode("hello_nack", field=exc.field, ours=plain(exc.ours),
                                      theirs=plain(exc.theirs), message=exc.detail[:proto.MAX_TEXT]))
