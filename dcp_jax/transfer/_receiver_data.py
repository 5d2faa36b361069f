"""What arrives at a decode rank: engine notifications (push), its own reads (pull), the
bookkeeping that turns landed parts into covered token ranges and SUCCESS, and the other endings
(abort, failure, no progress; a sender gone silent: `dcp_jax.transfer._receiver_links`).

Part of the worker-thread machinery of `dcp_jax.transfer.KVReceiver` (a mixin over the state
``KVReceiver.__init__`` creates). Every method runs on the worker thread under the receiver's
lock. A part is credited only to the live request of the same id AND incarnation, from a sender
it announced to, once; a chunk counts when all its parts landed and their rows add up to the
rows this rank owns in it.
"""
from __future__ import annotations

from typing import Any

import time

import numpy as np

from bridge import TransferError
from dcp_jax import plan as planmod
from dcp_jax.packing import layer_offsets
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._sender_endings import batch_allowance
from dcp_jax.transfer._worker import ACTIVE, IDLE, PENDING, TIMEOUT_CHECK_S
from dcp_jax.transfer.requests import RecvRequest
from dcp_jax.transfer.schedule import SideLayout, owned_count, owned_rows
from dcp_jax.transfer.status import TransferStatus

__all__ = ["ReceiverData"]


class ReceiverData:
    """The worker's round; notifications, pull reads, parts and chunks landing, SUCCESS."""

    # ---- the worker's round -------------------------------------------------------------------
    def _round(self) -> int:
        with self._lock:
            busy = False
            for link in self._links:
                if not link.registered:
                    self._worker.add_socket(link.client.sock)
                    link.registered = True
            self._flush()
            busy |= self._poll_gated()  # first: a flag seen by the spin ends its request now
            # Each frame and notification is isolated (`Worker.isolate`: counted, logged rate-limited):
            # the batch was drained already, and one failing must not lose the others nor the round.
            for link in list(self._links):
                for msg in link.client.recv():
                    busy = True
                    link.last_seen = time.monotonic()
                    self._worker.isolate(self._on_message, link, msg)
            # Rounds follow the busy backoff only while a notification is due (a "sent" hint came)
            # or a read is in flight; otherwise the worker idles until a control message wakes it.
            live = [r for r in self._requests.values() if not r.status.terminal]
            pending = any(r.due > 0 for r in live)
            if live or self._reads:  # idle rounds still come every IDLE_POLL_MS: no note is missed
                for peer, notes in self.engine.notifications().items():
                    for note in notes:
                        busy = True
                        self._worker.isolate(self._on_notification, peer, note)
            busy |= self._poll_reads()
            busy |= self._poll_gated()  # gated parts that arrived in this round
            if self._waiting:  # room freed, or a waiting window's request ended
                busy |= self._grant_waiting()
            self._check_timeouts()
            if self._released:
                self._reap_released()
            self._heartbeat()
            self._flush()
            if busy:
                return ACTIVE
            if self._gated:
                return self._spin() if self._gated_waiting() else PENDING
            if pending or self._reads:
                return PENDING
            # A ``done`` due as a control frame wakes an idle worker; on a device it is spun for.
            return self._spin() if self._ctl_spinning() else IDLE

    def _flush(self) -> None:
        while self._outbox:
            link, frame = self._outbox.popleft()
            link.client.send(frame)

    def _send(self, link: Any, frame: bytes) -> None:
        """Sends one frame to ``link``'s sender now, after the frames queued before it (an
        ``abort`` passed on to this request's other senders must reach a sender before this
        rank's answer to its late ``pull_ready``, or it fails on that answer instead of ending
        ABORTED). Off the worker thread (which alone uses the sockets) it is queued instead."""
        if not self._worker.owns_sockets():
            self._outbox.append((link, frame))
            self._worker.wake()
            return
        if self._outbox:
            self._flush()
        link.client.send(frame)

    # ---- control messages from the senders ----------------------------------------------------
    def _live(self, link: Any, msg: dict) -> RecvRequest | None:
        req = self._requests.get(msg["rid"])
        if req is None or req.inc != msg["inc"] or req.status.terminal or link not in req.senders:
            self._counts["dropped_messages"] += 1
            return None
        return req

    def _on_message(self, link: Any, msg: dict) -> None:
        kind = msg["k"]
        if kind == "moving":
            return self._on_moving(link, msg)
        if kind in ("region_ask", "fused_done"):
            return self._on_region_ask(link, msg) if kind == "region_ask" else self._on_fused_done(link, msg)
        if kind == "pull_ready":
            done = self._requests.get(msg["rid"])
            if (not msg["nrows"] and done is not None and done.inc == msg["inc"] and link in done.senders
                    and done.status is TransferStatus.SUCCESS):
                # An empty window (a chunk inside the prefix) announced after the request already
                # completed: nothing to read and nothing owed, so the sender's request may succeed.
                self._send(link, proto.encode("pull_done", msg["rid"], msg["inc"], chunk=msg["chunk"],
                                              part=msg["part"], ok=True, reason=""))
                return
            req = self._live(link, msg)
            if req is None:  # the sender holds a region for it: let it go at once
                self._send(link, proto.encode("pull_done", msg["rid"], msg["inc"], chunk=msg["chunk"],
                                              part=msg["part"], ok=False, reason="request not live here"))
                return
            if link.path == "region" and msg["nrows"]:
                return self._queue_region_pull(req, link, msg)
            return self._start_read(req, link, msg)
        if kind == "done":  # a region write's notice its sender told itself (region_notify="round")
            if link.path != "region" or not msg["nrows"]:
                self._counts["dropped_messages"] += 1
                return
            return self._region_landed(link, msg, by_ctl=True)
        if kind == "sent":
            req = self._requests.get(msg["rid"])
            if req is not None and req.inc == msg["inc"] and not req.status.terminal:
                req.due += 1
                req.state.advance(TransferStatus.TRANSFERRING)  # its bytes are on their way
            return
        if kind == "drained":
            req = self._requests.get(msg["rid"])
            # Its writes into this request's ranges are over too (even if it was released here).
            self._free_grants(lambda key, g: key[:3] == (id(link), msg["rid"], msg["inc"]))
            if req is None or req.inc != msg["inc"]:  # released here, its pages held until drained
                req = self._released.get((msg["rid"], msg["inc"]))
            if req is not None and req.inc == msg["inc"] and link in req.senders:
                req.drained.add(id(link))
            else:
                self._counts["dropped_messages"] += 1
            return
        if kind == "_refused":  # a frame `protocol.decode` refused, naming a request (`protocol.refusal`)
            return self._on_refused(link, msg)
        if kind in ("abort", "failed"):
            req = self._live(link, msg)
            if req is not None:
                status = TransferStatus.ABORTED if kind == "abort" else TransferStatus.FAILED
                # The request's other senders (prefill DCP/TP > 1) hear it from this rank: else one
                # that finished its part ends SUCCESS and never says drained (the pages stay held),
                # and one still live goes on and keeps the id from its next use.
                self._end(req, status, f"prefill rank {link.spec.dcp_rank}: {msg['reason']}", kind, skip=link)
        elif kind == "hello_nack":  # the sender no longer knows this connection (dropped, restarted)
            if link in self._links:
                self._drop_link(link, f"prefill sender {link.client.address} refused the connection: {msg['message']}",
                                tell=False)
        elif kind == "bye":  # the sender closed or dropped this connection: no need to wait out its silence
            if link in self._links:  # drained: its engine is torn down, none of its writes can land
                self._drop_link(link, f"prefill sender {link.client.address} ended the connection: {msg['reason']}",
                                tell=False, in_doubt=not msg["drained"])
        elif kind != "ping":
            self._counts["dropped_messages"] += 1

    def _on_refused(self, link: Any, msg: dict) -> None:
        """A sender's frame that `protocol.decode` refused, naming one of its requests: the
        request fails here now (and the senders hear it), saying why, instead of waiting out
        ``timeout_s``. A refused ``pull_ready`` that names its window is answered
        ``pull_done(ok=False)`` whatever the request's state: no READ of it starts, and the
        sender lets its pack region go."""
        why = f"prefill rank {link.spec.dcp_rank} sent a malformed {msg['what']} frame (refused here): {msg['reason']}"
        if msg["what"] == "pull_ready" and msg["window"] is not None:
            chunk, part = msg["window"]
            self._send(link, proto.encode("pull_done", msg["rid"], msg["inc"], chunk=chunk, part=part, ok=False,
                                          reason=why[:proto.MAX_TEXT]))
        req = self._live(link, msg)
        if req is not None:
            self._end(req, TransferStatus.FAILED, why, "failed")

    def _on_moving(self, link: Any, msg: dict) -> None:
        """A sender's report (``moving``, validated by `protocol.decode`) of this rank's requests
        with an engine batch or a pull it still sees in flight within its bound: each such live
        request, of that incarnation and announced to that sender, counts as progressing until
        the entry's lease ends (a lease of at most this side's ``peer_timeout_s``: a sender silent
        that long is dropped anyway); its ``timeout_s`` runs from then. Entries of a request
        ended or released here meanwhile (a race) are ignored."""
        now = time.monotonic()
        for rid, inc, lease_ms in msg["reqs"]:
            req = self._requests.get(rid)
            if req is None or req.inc != inc or req.status.terminal or link not in req.senders:
                continue
            req.moving_until = max(req.moving_until, now + min(lease_ms / 1000, self.peer_timeout_s))

    # ---- engine notifications and reads -------------------------------------------------------
    def _on_notification(self, peer: str, note: bytes) -> None:
        link = self._by_peer.get(peer)
        try:
            msg = proto.decode(note, max_bytes=proto.MAX_NOTIF_BYTES)
            if msg["k"] != "done" or link is None:
                raise proto.ProtocolError(f"unexpected notification {msg['k']!r} from {peer!r}")
        except proto.ProtocolError:
            self._counts["rejected_notifications"] += 1
            return
        if link.path == "region" and msg["nrows"]:  # a window into the receive region: unpack it
            return self._region_landed(link, msg)
        req = self._live(link, msg)
        if req is not None:
            req.due = max(0, req.due - 1)
            self._part_landed(req, link, msg)

    def _rows_of(self, req: RecvRequest, link: Any, start: int, stop: int) -> np.ndarray:
        """This rank's rows of tokens [start, stop) that ``link``'s prefill rank holds."""
        key = (req, id(link), start, stop)
        rows = self._chunk_rows.get(key)
        if rows is None:
            a = max(start, req.prefix_tokens)
            # expect() checked the whole table once; only its length is checked here (the
            # duplicate check of the pages the tokens touch cost ~35 us of a 4096-row lookup).
            rows = self._chunk_rows[key] = owned_rows(a, max(a, stop), dst=self._layout, page_table=req.page_table,
                                                      src=link.src_layout or SideLayout.of(link.spec))
        return rows

    def _owned_rows(self, req: RecvRequest, link: Any, start: int, stop: int) -> int:
        """How many rows of tokens [start, stop) this rank takes from ``link``'s prefill rank:
        counted, not listed, unless the rows are at hand (a fused or direct chunk needs only
        the count; listing them through the page table cost ~0.2 ms per chunk)."""
        rows = self._chunk_rows.get((req, id(link), start, stop))
        if rows is not None:
            return len(rows)
        a = max(start, req.prefix_tokens)
        return owned_count(a, max(a, stop), dst=self._layout, src=link.src_layout or SideLayout.of(link.spec))

    def _part_landed(self, req: RecvRequest, link: Any, msg: dict) -> None:
        start, stop, chunk = msg["start"], msg["stop"], msg["chunk"]
        if stop > req.num_tokens:
            self._inconsistent(req, f"chunk [{start}, {stop}) passes num_tokens={req.num_tokens}")
            return
        key = (id(link), chunk)
        parts = self._parts_of(req, key, msg["nparts"])
        if msg["part"] in parts[1]:
            self._counts["dropped_messages"] += 1  # a duplicate part: credit it once
            return
        parts[1].add(msg["part"])
        req.timeline.mark("part", self.spec.group_rank)
        req.rows_landed[key] = req.rows_landed.get(key, 0) + msg["nrows"]
        req.bytes += msg["nrows"] * link.row_bytes
        self._counts["bytes"] += msg["nrows"] * link.row_bytes
        req.state.advance(TransferStatus.TRANSFERRING)
        req.state.touch()
        if len(parts[1]) == parts[0]:
            expected = self._owned_rows(req, link, start, stop)
            if req.rows_landed[key] != expected:
                self._inconsistent(req, f"chunk {chunk} [{start}, {stop}) brought {req.rows_landed[key]} rows, "
                                        f"this rank owns {expected}")
                return
            self._chunk_rows.pop((req, id(link), start, stop), None)
            req.coverage[id(link)].add(start, stop)
            self._maybe_done(req)

    @staticmethod
    def _parts_of(req: RecvRequest, key: tuple, nparts: int) -> list:
        """A part key's [nparts, parts credited] entry of the request, made on first use."""
        entry = req.parts.get(key)
        if entry is None:
            entry = req.parts[key] = [nparts, set()]
        return entry

    def _inconsistent(self, req: RecvRequest, why: str) -> None:
        self._counts["inconsistent_messages"] += 1
        self._end(req, TransferStatus.FAILED, f"inconsistent completion: {why}", "failed")

    def _start_read(self, req: RecvRequest, link: Any, msg: dict) -> None:
        if msg["stop"] > req.num_tokens:  # checked before any row is computed from the page table
            self._inconsistent(req, f"pull of tokens [{msg['start']}, {msg['stop']}) passes num_tokens={req.num_tokens}")
            return
        rows = self._rows_of(req, link, msg["start"], msg["stop"])
        lo, n = msg["lo"], msg["nrows"]
        if lo + n > len(rows):
            self._inconsistent(req, f"pull of rows [{lo}, {lo + n}) of a chunk this rank holds {len(rows)} rows of")
            return
        done = dict(chunk=msg["chunk"], part=msg["part"], nparts=msg["nparts"], start=msg["start"],
                    stop=msg["stop"], nrows=n)
        if n == 0:
            self._send(link, proto.encode("pull_done", req.rid, req.inc, chunk=msg["chunk"], part=msg["part"],
                                          ok=True, reason=""))
            return self._part_landed(req, link, {"rid": req.rid, "inc": req.inc, **done})
        dst = rows[lo:lo + n]
        try:
            if msg["src_rows"]:
                src = proto.unpack_i64(msg["src_rows"], "src_rows", max_items=n)
                if len(src) != n:
                    raise proto.ProtocolError(f"src_rows has {len(src)} rows, nrows={n}")
                src_bases = link.layer_bases
            else:
                src = np.arange(n, dtype=np.int64)
                src_bases = msg["src_addr"] + layer_offsets(n, self.spec.item_lens)
            descs = planmod.build_descriptors(planmod.group_runs(src, dst), src_bases, self._layers.bases,
                                              self._layers.item_lens)
            self._reading(req, descs)
            # READ rows are (local, remote, nbytes): local is this rank's KV, remote the sender's.
            h = self.engine.transfer_batch(link.peer, descs[:, [1, 0, 2]], op="READ",
                                           dcp_rank=self.spec.dcp_rank, chunk=msg["chunk"])
        except Exception as exc:  # noqa: BLE001 - refused before a byte moved
            self._send(link, proto.encode("pull_done", req.rid, req.inc, chunk=msg["chunk"], part=msg["part"],
                                          ok=False, reason=str(exc)[:proto.MAX_TEXT]))
            self._end(req, TransferStatus.FAILED, f"pull refused: {exc}", "failed")
            return
        self._reads[h.seq] = (req, link, done, h)
        req.inflight += 1
        self._counts["reads"] += 1
        req.state.advance(TransferStatus.TRANSFERRING)

    @staticmethod
    def _reading(req: RecvRequest, descs: np.ndarray) -> None:
        """A READ of ``descs`` is about to be posted: it holds the request as progressing for its
        size allowance (`_sender_endings.batch_allowance`, the sender's rule for its own batches),
        counted from now: a long READ, or an engine call that keeps the thread meanwhile, is not
        "no progress" while it may still be moving."""
        allow = batch_allowance(len(descs), int(descs[:, 2].sum()))
        req.reading_until = max(req.reading_until, time.monotonic() + allow)

    def _poll_reads(self) -> bool:
        busy = False
        for seq, (req, link, done, h) in list(self._reads.items()):
            err = None
            try:
                if not self.engine.check(h):
                    continue
            except TransferError as exc:
                err = str(exc)
            busy = True
            del self._reads[seq]
            req.inflight -= 1
            self._send(link, proto.encode("pull_done", req.rid, req.inc, chunk=done["chunk"], part=done["part"],
                                          ok=err is None and not req.status.terminal, reason=(err or "")[:proto.MAX_TEXT]))
            live = not req.status.terminal and self._requests.get(req.rid) is req
            # A region read: unpack into the pages (when it landed for a live request); the
            # range is given back either way, the engine being done with it.
            unpack_err = self._read_landed(seq, err is None and live)
            if not live:
                continue
            err = err if err is not None else unpack_err
            if err is not None:
                self._end(req, TransferStatus.FAILED, f"read failed: {err}", "failed")
            else:
                self._part_landed(req, link, {"rid": req.rid, "inc": req.inc, **done})
        return busy

    def _maybe_done(self, req: RecvRequest) -> None:
        if not req.status.terminal and req.complete():
            if req.finish(TransferStatus.SUCCESS):
                req.timeline.mark("end", self.spec.group_rank)
                self._counts["succeeded"] += 1

    # ---- endings: aborts, failures, timeouts ----------------------------------------------------
    def _end(self, req: RecvRequest, status: TransferStatus, reason: str, notify: str | None,
             skip: Any = None) -> bool:
        """Ends the request here; with ``notify`` ("abort" / "failed") tells its senders, all but
        ``skip`` (the one whose word ended it). False if it had ended already."""
        if not req.finish(status, reason):
            return False
        self._counts["failed" if status is TransferStatus.FAILED else "aborted"] += 1
        for _, (r, _, _, h) in self._reads.items():
            if r is req:
                self.engine.cancel(h)
        self._quarantine_grants(req)  # held until the sender says drained (or is gone)
        if notify:
            frame = proto.encode(notify, req.rid, req.inc, reason=reason[:proto.MAX_TEXT])
            self._outbox.extend((link, frame) for link in req.senders if link in self._links and link is not skip)
        return True

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        if now < self._next_timeout_check:
            return
        self._next_timeout_check = now + TIMEOUT_CHECK_S
        self._expire_doubt(now)
        for req in list(self._requests.values()):
            if not req.status.terminal:
                # A sender's ``moving`` lease is progress up to its end (a batch of it in flight
                # within its bound): the clock runs from the later of that and the last landing.
                reading = req.reading_until if req.inflight else 0.0  # this rank's own READs in flight
                if now - max(req.state.last_progress, req.moving_until, reading) > self.timeout_s:
                    lapsed = (f"; its sender's last report of an engine batch in flight lapsed "
                              f"{now - req.moving_until:.1f} s ago" if req.moving_until else "")
                    self._end(req, TransferStatus.FAILED,
                              f"no progress for {self.timeout_s:g} s{req.missing()}{lapsed}", "failed")
            elif req.status is not TransferStatus.SUCCESS and req.state.stalled_for(now) > self.timeout_s:
                self._ask_drained(req)

    def _expire_doubt(self, now: float) -> None:
        """Push senders in doubt for ``drain_grace_s`` are done: they never came back (or this
        side closed), and their writes are long over."""
        for peer, (since, _) in list(self._doubt.items()):
            if now - since > self.drain_grace_s:
                self._clear_doubt(peer)

    def _ask_drained(self, req: RecvRequest) -> None:
        """Asks again, once per ``timeout_s``, the push senders that have not said ``drained`` for
        an ended request: a ``failed`` or its answer can be lost with a connection that broke
        and came back, and the pages stay held until the word comes (or the sender is dropped)."""
        req.state.touch()
        kind = "abort" if req.status is TransferStatus.ABORTED else "failed"
        frame = proto.encode(kind, req.rid, req.inc, reason="still waiting for drained")
        self._outbox.extend((link, frame) for link in req.senders if link in self._links
                            and link.direction != "pull" and id(link) not in req.drained)

    # ---- pages of ended requests --------------------------------------------------------------
    def _free_pages(self, req: RecvRequest) -> None:
        for page in req.written_pages:
            self._page_owner.pop(page, None)

    def _reap_released(self) -> None:
        """Released requests whose writers are done: their pages may be expected again."""
        for key, req in list(self._released.items()):
            if self._drained(req):
                del self._released[key]
                self._free_pages(req)

    def _drained(self, req: RecvRequest) -> bool:
        """`KVReceiver.is_drained`'s rule."""
        if req.status is TransferStatus.SUCCESS:
            return True
        return req.status.terminal and req.inflight == 0 and all(
            link.direction == "pull" or id(link) in req.drained
            or (link not in self._links and link.peer not in self._doubt)
            for link in req.senders)
