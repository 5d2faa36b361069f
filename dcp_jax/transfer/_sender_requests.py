"""The per-request public calls of `dcp_jax.transfer.KVSender` (a mixin; any thread): `send`
queues a chunk, `poll` / `wait` / `failure_reason` read a request's state, `abort`, `release`,
`is_drained`. Each takes the sender's lock for what it reads or changes; the worker thread does
the rest (`dcp_jax.transfer.sender`)."""
from __future__ import annotations

import time
from typing import Any

from dcp_jax.layout import local_len_np
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._sender_reuse import moved_page, redundant
from dcp_jax.transfer._worker import check_page_table, check_tokens
from dcp_jax.transfer.requests import RequestQueries, SendRequest, check_request_id
from dcp_jax.transfer.status import TransferStatus

__all__ = ["SenderRequests"]


class SenderRequests(RequestQueries):
    """`send`, `poll`, `abort`, `release`, `is_drained` (and `_get`)."""

    def send(self, request_id: str, page_table: Any, start: int, stop: int) -> None:
        """Queues tokens ``[start, stop)`` of a request for every decode rank; returns at once.

        Call once per chunk (chunked prefill) in any order of non-overlapping ranges. Ranks that
        have not announced the request yet (`KVReceiver.expect`) get it when they do.

        Args:
            request_id: the request's id (str of 1..256 bytes in UTF-8), the same on both sides.
            page_table: int[pages]: ``page_table[k]`` is the physical page holding this prefill
                rank's local tokens ``[k*page_size, (k+1)*page_size)`` (spec section 10); it must
                cover local rows up to ``stop`` and may grow between chunks; each chunk is moved
                from the table it came with. For an id released less than ``timeout_s`` ago, a
                later chunk's table must keep the pages that hold the rows earlier chunks sent:
                one that moves such a page raises ValueError and FAILS the request here and at
                its ranks (its first chunk was most likely a late one of the released request,
                under an id that named a new request from then on: `release` it and send the new
                one again). This catches only such a late chunk whose pages the next table moves:
                a scheduler must not send chunks of requests it released (`release`).
            start, stop: token positions, ``0 <= start < stop <= 2**62`` (`_worker.MAX_TOKENS`).
                A request every decode rank already holds in full (``prefix_tokens == num_tokens``)
                is SUCCESS as soon as they announced it; a `send` for it then does nothing, as a
                chunk of any SUCCESS request does when it lies within the ranks' ``num_tokens``
                and overlaps no chunk sent before (e.g. a chunk inside their prefix, sent after
                the tail completed the request), or, overlapping none, on a sender no decode rank
                takes anything from (a TP rank whose heads another rank sends). A
                request that FAILED or was ABORTED (here or by a decode rank) drops its later
                chunks without raising (a decode-side cancel is no error of the scheduler's
                loop): `poll` and `failure_reason` say why; `release` it before reusing its id.
                Tokens past a decode rank's announced ``num_tokens`` are no error here: the
                request FAILS on both sides, and no row lands past the rank's announced ones.

        Raises:
            RuntimeError: the sender is closed.
            TypeError, ValueError: bad id, range or page table (page ids outside the cache, too
                few pages, a page moved under a recently released id), a range overlapping one
                already sent, or the id of a SUCCESS request that was not released yet (a chunk
                past the ranks' tokens, naming ``stop``, also on a full prefix hit nothing was
                sent for; or a chunk over a range already sent).
        """
        self._check_open()
        rid = check_request_id(request_id)
        start, stop = check_tokens("start", start), check_tokens("stop", stop)
        if not start < stop:
            raise ValueError(f"start={start!r}, stop={stop!r} must be ints with 0 <= start < stop")
        rows = int(local_len_np(stop, self.spec.dcp_size, self.spec.dcp_rank, self.spec.interleave_size))
        table = check_page_table(page_table, rows, self.spec.page_size,
                                 self._layers.min_rows // self.spec.page_size)
        with self._lock:
            req = self._requests.get(rid)
            if (req is not None and req.status in (TransferStatus.FAILED, TransferStatus.ABORTED)
                    and not req.chunks and req.inflight == 0 and self._early.get(rid) and not req.aborted_here):
                # Ended before this prefill sent it anything (it started from announcements a
                # cancel then caught up with), while the ranks already announced the id's next
                # use: this chunk is that use's. Drop the old record, take up the parked ones.
                self._forget_unsent(req)
                req = self._requests.get(rid)
            if req is None:  # the prefill uses the id again: a new request
                req = self._new_request(rid)
            if req.status is TransferStatus.SUCCESS:
                if redundant(req, start, stop):
                    return  # every rank already holds these tokens (a prefix hit, or the chunks sent): nothing to send
                held = min((t.num_tokens for t in req.targets.values()), default=None)
                if held is not None and stop > held:  # also on a full prefix hit nothing was sent for
                    raise ValueError(f"stop={stop} passes the {held} tokens the decode ranks announced for "
                                     f"request_id={rid!r}, which is SUCCESS; release() it before reusing the id")
            if req.status in (TransferStatus.FAILED, TransferStatus.ABORTED):
                return  # ended (a rank aborted, a peer failed): later chunks are dropped, `poll` says why
            if req.status.terminal:
                raise ValueError(f"request_id={rid!r} is {req.status.name}; release() it before reusing the id")
            if req.sent.overlaps(start, stop):
                raise ValueError(f"tokens [{start}, {stop}) of request_id={rid!r} overlap a range already sent")
            moved = moved_page(rid, req.chunks, table, self.spec) if req.reborn else None
            if moved is not None:  # two requests' chunks under one id: it fails here and at the ranks
                self._end(req, TransferStatus.FAILED, moved, notify="failed")
                raise ValueError(moved)
            req.sent.add(start, stop)
            self._to_plan[req] = None
            req.chunks.append((start, stop, table))  # each chunk is planned on its own table
            req.page_table = table
            req.state.touch()
        self._worker.wake()

    def poll(self, request_id: str) -> TransferStatus:
        """The request's `TransferStatus` on this side.

        Raises:
            KeyError: unknown (never sent nor announced, or released) request id; also one that
                ended before any chunk of it was sent, ``2 * timeout_s`` after it ended (the
                sender drops those itself, as a prefill that never sent usually never knew the id;
                for the second ``timeout_s`` it still answers for them here, in `wait`,
                `failure_reason`, `request_stats` and `release`, so a caller that knew the id
                and polls it, then releases it, meets no KeyError in between).
            TypeError, ValueError: ``request_id`` is not a str, or no request can have it (empty,
                over 256 bytes in UTF-8, not UTF-8: `requests.check_request_id`).
        """
        return self._get(request_id).status

    def abort(self, request_id: str, reason: str = "aborted by the prefill side") -> bool:
        """Aborts a request on this side and tells its decode ranks; idempotent.

        Queued windows are dropped; windows the engine is moving are cancelled as far as the
        engine can, and their pack regions stay quarantined until the engine reports them done.
        The request's source pages may be reused once `is_drained` says so.

        An id this sender does not know yet (no `send` of it, and its ranks' announcements not
        here yet: a scheduler cancelling before the first chunk races them) is recorded ABORTED
        now, so the answer does not depend on that race: a rank announcing it later is told it
        was aborted, a `send` of it drops the chunk (also once the ranks announced the id's next
        use: that waits for `release`). Like any request never sent, the record goes at `release`
        or by itself ``timeout_s`` after (`_forget_unsent`); the id is free after. An id released
        less than ``timeout_s`` ago is not recorded: its request ended (False), and the id's next
        use is left alone, unless that use already started here (its ranks announced it before
        the `release`, which starts it): this side cannot tell a late cancel from a cancel of that
        use, and aborts it. So a scheduler cancels before it releases.

        Args:
            reason: text for both sides' `failure_reason` (``str()`` of it, cut to 4096 characters).

        Returns:
            True if the request moved to ABORTED now (also one recorded so), False if it was
            already terminal.

        Raises:
            KeyError: unknown request id on a closed sender. TypeError, ValueError: a
                ``request_id`` no request can have (`requests.check_request_id`).
        """
        with self._lock:
            known = isinstance(request_id, str) and (request_id in self._requests or request_id in self._forgotten)
            if known or self._closed:
                req = self._get(request_id)
            elif self._released_at.get(check_request_id(request_id), 0.0) > time.monotonic():
                return False  # a late or repeated cancel of a request that ended and was released
            else:
                req = self._new_request(request_id)
            req.aborted_here = True
            return self._end(req, TransferStatus.ABORTED, str(reason)[:proto.MAX_TEXT], notify="abort")

    def release(self, request_id: str) -> None:
        """Forgets a request (aborting it first if it is still live); its id may then be reused.
        For ``timeout_s`` after releasing a request that did not succeed, a decode rank that
        announces it only now (it had not yet) is told how it ended instead of waiting for a
        transfer nobody sends; a `send` of the id starts a new request and ends that. So a
        scheduler must not `send` chunks of a request it released (this side cannot tell such a
        late chunk from the first chunk of a reused id; for ``timeout_s`` after the release, one
        whose pages the new request's later tables move FAILS it, `send`'s ``page_table``, but
        one on pages they share is not caught).

        Raises:
            KeyError: unknown request id. TypeError, ValueError: an id no request can have.
        """
        with self._lock:
            req = self._get(request_id)
            if self._requests.get(req.rid) is not req:  # dropped unsent already: its record only
                del self._forgotten[req.rid]
                self._released_at[req.rid] = time.monotonic() + self.timeout_s  # released all the same
                return
            if not req.status.terminal:
                self._end(req, TransferStatus.ABORTED, "released before completion", notify="abort")
            del self._requests[req.rid]
            until = self._released_at[req.rid] = time.monotonic() + self.timeout_s
            self._keep_ending(req, until)  # ranks that announce it late hear how it ended
            self._replay_early(req.rid)  # announcements that came for the next use of this id

    def is_drained(self, request_id: str) -> bool:
        """True when no engine operation of this request reads its pages any more (its source
        pages may be freed): always after SUCCESS; after FAILED/ABORTED once every window in
        flight was reported done by the engine or the reader. Raises KeyError if unknown,
        TypeError / ValueError for an id no request can have (`requests.check_request_id`)."""
        with self._lock:
            req = self._get(request_id)
            return req.status.terminal and req.inflight == 0

    def _get(self, request_id: str) -> SendRequest:
        req = self._requests.get(request_id) if isinstance(request_id, str) else None
        if req is None and isinstance(request_id, str) and request_id in self._forgotten:
            req = self._forgotten[request_id][1]
        if req is None:
            check_request_id(request_id)  # not a str: TypeError naming request_id, not "unhashable"
            raise KeyError(f"request_id={request_id!r} is not known to this sender")
        return req
