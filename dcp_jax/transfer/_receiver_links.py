"""The receiver's links to its prefill senders (a mixin of `dcp_jax.transfer.KVReceiver`).

A link is one connected prefill sender (`Link`). This module holds how one is made (the
versioned handshake of `KVReceiver.connect`: both specs cross, a second live sender of one
prefill position is refused), whether the links cover what a request needs (`expect`'s check:
every prefill DCP rank, `missing_senders`, and every KV head this rank holds,
`views.uncovered_heads`) and how one ends (silent past ``peer_timeout_s``; a dropped push sender
stays "in doubt" until it can write no more). Methods other than `_handshake` run under the
receiver's lock.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from bridge import BridgeError, PeerInfo
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._region import host_info
from dcp_jax.transfer.control import BYE_LINGER_MS, ControlClient
from dcp_jax.transfer.schedule import SideLayout
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec, check_compatible
from dcp_jax.transfer.status import TransferStatus
from dcp_jax.transfer.views import reported_path, stream_view, uncovered_heads, uses_views

__all__ = ["Link", "ReceiverLinks", "missing_senders"]


@dataclasses.dataclass(eq=False)
class Link:
    """One connected prefill sender."""

    client: ControlClient
    spec: KVCacheSpec
    peer: str                  # its engine name (notifications come under it)
    layer_bases: np.ndarray    # its KV layer addresses (direct pulls read from them)
    direction: str
    last_seen: float
    registered: bool = False
    path: str = "direct"       # the transfer path the sender chose at the handshake
    staged: bool = False       # the sender stages (its KV is not registered)
    row_bytes: int = 0         # bytes one token row of this link lands (all layers; head pieces only)
    view: Any = None           # TP or layout pair: its `views.StreamView` (the region path's unpack)
    flag: Any = None           # fused path: the sender's flag page, opened here (`bridge.host_flag.OpenedFlag`)
    src_layout: Any = None     # the sender's `schedule.SideLayout` (made once: a chunk's row count uses it)

    def close_flag(self) -> None:
        """Closes the sender's flag page (idempotent)."""
        fl, self.flag = self.flag, None
        if fl is not None:
            fl.close()


def missing_senders(specs: list[KVCacheSpec]) -> list[int]:
    """The prefill DCP ranks (``range(dcp_size)``, the largest ``dcp_size`` when connected
    senders disagree) that no connected sender holds, sorted. Every prefill DCP rank holds tokens
    of every request; which TP ranks a decode rank needs depends on the heads they share, checked
    apart (`dcp_jax.transfer.views.uncovered_heads`)."""
    if not specs:
        return []
    have = {sp.dcp_rank for sp in specs}
    return sorted(set(range(max(sp.dcp_size for sp in specs))) - have)


def _open_flag(reply: dict) -> Any:
    """The sender's fused-path flag page of a ``hello_ack`` opened here, or None (none offered).

    Raises:
        HandshakeError: field ``"flag"``: offered on another path than fused, a name of another
            form, or a page this rank cannot open and read (`OpenedFlag`: its gated ``fused_done``s
            could never be credited).
    """
    if not reply["flag"]:
        return None
    if reply["path"] != "fused":
        raise HandshakeError("flag", None, None, f"the sender offered a flag page on the {reply['path']} path")
    from bridge.host_flag import OpenedFlag

    try:
        return OpenedFlag(reply["flag"])
    except Exception as exc:  # noqa: BLE001 - ValueError, FlagError: refused
        raise HandshakeError("flag", None, None,
                             f"the sender's flag page cannot be opened here: {type(exc).__name__}: {exc}") from None


class ReceiverLinks:
    """Handshake, coverage of the prefill group, silent senders and senders in doubt."""

    def _handshake(self, address: str, direction: str, timeout_s: float) -> Link:
        """`connect` after its argument checks: the hello and its answer, both specs checked,
        the sender added as an engine peer. Returns the new link (not yet in ``_links``).

        Raises:
            HandshakeError, TimeoutError, ValueError: as `KVReceiver.connect` (the socket is
                closed then; nothing was registered with the peer).
        """
        client, reply = ControlClient(address, source=self.host), None
        try:
            client.send(proto.encode("hello", spec=self.spec.to_dict(), peer=self.engine.peer_info().to_dict(),
                                     group=self.group, direction=direction, name=self.engine.name,
                                     layer_bases=proto.pack_i64(self._layers.bases),
                                     region_addr=self._region.addr, region_bytes=self._region.nbytes,
                                     mem=self._layers.mem_type, ipc=self._ipc, host=host_info(),
                                     heartbeat_ms=max(1, round(self.heartbeat_s * 1000)),
                                     peer_timeout_ms=max(1, round(self.peer_timeout_s * 1000)), staged=self.staged,
                                     num_pages=self._layers.min_rows // self.spec.page_size))
            reply = self._await_reply(client, timeout_s)
            if reply["k"] == "hello_nack":  # the sender's ours/theirs are the other way round
                raise HandshakeError(reply["field"], reply["theirs"], reply["ours"], reply["message"])
            sender_spec = KVCacheSpec.from_dict(reply["spec"])
            check_compatible(sender_spec, self.spec, side="decode")
            with self._lock:
                if any(link.peer == reply["name"] for link in self._links):
                    raise ValueError(f"address={address!r} reaches a sender this receiver is already "
                                     f"connected to ({reply['name']!r})")
                self._refuse_twin(address, sender_spec)
            bases = proto.unpack_i64(reply["layer_bases"], "layer_bases", max_items=self.spec.num_layers)
            with self._lock:  # the sender acks a reconnect only once no write of the old link is in flight
                self._clear_doubt(reply["name"])
            if reply["path"] == "region" and not self._region.nbytes:
                raise HandshakeError("path", None, None,
                                     "the sender chose the region path, this receiver offers no region")
            try:  # checked before the flag page is opened: a bad peer info opens nothing
                info = PeerInfo.from_dict(reply["peer"])
            except BridgeError as exc:  # a PeerError: named as a handshake field, as the sender does
                raise HandshakeError("peer", None, None, f"the sender's engine metadata is not valid: {exc}") from None
            flag = _open_flag(reply)
            try:
                peer = self.engine.add_peer(info)
            except BaseException:
                if flag is not None:
                    flag.close()
                raise
        except BaseException as exc:
            if reply is not None and reply["k"] == "hello_ack":  # the sender took it: tell it at once
                client.send(proto.encode("bye", reason=f"the receiver refused the handshake: {exc}"[:proto.MAX_TEXT],
                                         drained=False))
            client.close(linger_ms=BYE_LINGER_MS)
            raise
        row_bytes, view = self.spec.row_bytes, None
        if uses_views(sender_spec, self.spec):  # only the heads this pair shares land here
            # The source geometry is not used here (this side only places what lands).
            view = stream_view(sender_spec, self.spec, 1, self._layers.min_rows // self.spec.page_size)
            row_bytes = view.row_bytes() * self.spec.num_layers
        return Link(client, sender_spec, peer, bases, direction, time.monotonic(), path=reply["path"],
                    staged=reply["staged"], row_bytes=row_bytes, view=view, flag=flag,
                    src_layout=SideLayout.of(sender_spec))

    def _refuse_twin(self, address: str, sender_spec: KVCacheSpec) -> None:
        """HandshakeError if the sender does not fit the prefill group of the live links: field
        ``"dcp_size"``, ``"interleave_size"`` or ``"tp_size"`` when it declares another layout of
        the group (the ranks would own other tokens or heads than the plan assumes: rows never
        written, others written twice), ``"position"`` when a live link holds its (dcp_rank,
        tp_rank) (both would write its rows). A restarted sender is accepted once the old link
        was dropped (it said bye, was silent for peer_timeout_s, or refused)."""
        for field in ("dcp_size", "interleave_size", "tp_size"):
            other = next((link for link in self._links if getattr(link.spec, field) != getattr(sender_spec, field)),
                         None)
            if other is not None:
                raise HandshakeError(field, getattr(other.spec, field), getattr(sender_spec, field),
                                     f"the sender at {address!r} declares another prefill group layout than the live "
                                     f"sender at {other.client.address!r} this receiver is connected to")
        twin = next((link for link in self._links if (link.spec.dcp_rank, link.spec.tp_rank)
                     == (sender_spec.dcp_rank, sender_spec.tp_rank)), None)
        if twin is not None:
            raise HandshakeError("position", None, None, f"the sender at {address!r} is prefill dcp_rank "
                                 f"{sender_spec.dcp_rank}, tp_rank {sender_spec.tp_rank}, the position of "
                                 f"the live sender at {twin.client.address!r} this receiver is connected to "
                                 "(a restarted sender is accepted once the old one said bye or was dropped as silent)")

    @staticmethod
    def _await_reply(client: ControlClient, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            for msg in client.recv(timeout_ms=max(1, int(left * 1000))):
                if msg["k"] in ("hello_ack", "hello_nack"):
                    return msg
        raise TimeoutError(f"no handshake answer from {client.address} within {timeout_s:g} s "
                           f"(is a KVSender listening there, of protocol version {proto.PROTOCOL_VERSION}?)")

    def _check_coverage(self) -> None:
        """`expect`'s check that the links cover every token and head of this rank: without
        them the request would end SUCCESS with their rows never written.

        Raises:
            RuntimeError: no link, a prefill DCP rank with no link (`missing_senders`), or heads
                of this rank no linked TP rank sends (`views.uncovered_heads`; names the DCP
                rank, the heads and the TP ranks sending them).
        """
        s = self.spec
        if not self._links:
            if self._last_drop:  # it was connected: say why it no longer is (not "before connect()")
                raise RuntimeError(f"expect(): no connected sender: the last link was dropped ({self._last_drop}); "
                                   "connect() again")
            raise RuntimeError("expect() before connect(): no sender to announce the request to")
        missing = missing_senders([link.spec for link in self._links])
        if missing:
            raise RuntimeError(f"expect() while connected to prefill dcp_rank(s) "
                               f"{sorted({link.spec.dcp_rank for link in self._links})} of a prefill DCP group of "
                               f"{max(link.spec.dcp_size for link in self._links)}: dcp_rank(s) {missing} not "
                               "connected (connect() to every prefill DCP rank first)")
        gaps = uncovered_heads(s, tuple(link.spec for link in self._links))
        if gaps:  # connected to part of a prefill TP group: those heads would never be written
            raise RuntimeError(f"expect() on decode dcp_rank {s.dcp_rank}, tp_rank {s.tp_rank}: the connected "
                               "senders do not move every KV head of this rank: " + "; ".join(
                                   f"prefill dcp_rank {r}: heads [{h0}, {h1}) not covered (sent by prefill "
                                   f"tp_rank(s) {list(src)})" for r, h0, h1, src in gaps)
                               + " (connect() to those prefill TP ranks first)")

    def _link_list(self) -> list[dict[str, Any]]:
        """`KVReceiver.peers` (under the lock)."""
        now = time.monotonic()
        return [dict(address=link.client.address, name=link.peer, dcp_rank=link.spec.dcp_rank,
                     tp_rank=link.spec.tp_rank, path=reported_path(link.path, link.spec, self.spec),
                     direction=link.direction, staged=link.staged,
                     silent_s=now - link.last_seen) for link in self._links]

    # ---- silent senders and senders in doubt (worker thread) ------------------------------------
    def _heartbeat(self) -> None:
        now = time.monotonic()
        for link in list(self._links):
            if now - link.last_seen > self.peer_timeout_s:
                self._drop_link(link, f"prefill sender {link.client.address} silent for {self.peer_timeout_s:g} s")
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            self._ping_peers()

    def _ping_peers(self) -> None:
        ping = proto.encode("ping")
        self._outbox.extend((link, ping) for link in self._links)

    def _drop_link(self, link: Link, reason: str, *, tell: bool = True, in_doubt: bool = True) -> None:
        """Fails the link's requests and forgets it; with ``tell`` a ``bye`` says why, so a sender
        that still listens drops this connection now rather than after its ``peer_timeout_s``
        (False when the sender itself ended it: a ``bye`` or a refusal from it). ``in_doubt=False``:
        the sender's engine is torn down (its ``bye`` said drained), none of its writes can land."""
        self._links.remove(link)
        self._last_drop = reason  # what `expect` says once no link is left
        self._by_peer.pop(link.peer, None)
        for req in list(self._requests.values()):
            if link in req.senders:
                self._end(req, TransferStatus.FAILED, reason, "failed")
        if link.direction == "pull" or not in_doubt:
            self._free_grants(lambda key, g: g.link is link)  # nothing of the sender can land any more
        else:
            # A push sender dropped as silent may only be stopped (SIGSTOP, a stalled host): the
            # WRITEs its engine had taken still land when it resumes, whatever remove_peer did.
            # Its requests' pages and receive-region ranges stay held ("in doubt") until it
            # reconnects (its hello_ack comes only once none of those writes is in flight) or
            # `drain_grace_s` passed.
            self._doubt[link.peer] = (time.monotonic(), link)
        self._worker.remove_socket(link.client.sock)
        if tell:
            self._say_bye(link, reason)
        else:
            link.client.close()
        link.close_flag()
        try:
            self.engine.remove_peer(link.peer)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _say_bye(self, link: Link, reason: str, *, drained: bool = False) -> None:
        """Sends the ``bye`` after what is queued for the link, then closes its socket (the
        frames get `control.BYE_LINGER_MS` to leave, in the background). ``drained``: this
        side's engine is torn down."""
        self._flush()
        link.client.send(proto.encode("bye", reason=reason[:proto.MAX_TEXT], drained=drained))
        link.client.close(linger_ms=BYE_LINGER_MS)

    def _clear_doubt(self, peer: str) -> None:
        """A dropped push sender can write no more: its ranges are free, its requests drained."""
        entry = self._doubt.pop(peer, None)
        if entry is not None:
            link = entry[1]
            self._free_grants(lambda key, g: g.link is link)
