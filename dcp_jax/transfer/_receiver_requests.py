"""The per-request public calls of `dcp_jax.transfer.KVReceiver` (a mixin; any thread):
`expect` announces a request, `poll` / `wait` / `failure_reason` read its state, `abort`,
`release`, `is_drained`. Each takes the receiver's lock for what it reads or changes; the
worker thread does the rest (`dcp_jax.transfer.receiver`)."""
from __future__ import annotations

import secrets
import time
from typing import Any

from dcp_jax.layout import local_len_np
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._worker import check_page_table, check_tokens
from dcp_jax.transfer.requests import RequestQueries, RecvRequest, check_request_id
from dcp_jax.transfer.status import TransferStatus
from dcp_jax.transfer.views import pair_moves

__all__ = ["ReceiverRequests"]


class ReceiverRequests(RequestQueries):
    """`expect`, `poll`, `abort`, `release`, `is_drained` (and `_get`)."""

    def expect(self, request_id: str, page_table: Any, num_tokens: int, prefix_tokens: int = 0) -> None:
        """Announces a request: this rank's rows of tokens ``[prefix_tokens, num_tokens)`` go
        where ``page_table`` says; returns at once.

        Args:
            request_id: the request's id (the one the sender's `send` uses).
            page_table: int[pages]: ``page_table[k]`` is the physical page holding this rank's
                local rows ``[k*page_size, (k+1)*page_size)``; local row of token t is
                ``layout.local_index(t)`` counted from token 0 (spec section 10). It must cover
                ``local_len(num_tokens)`` rows. The pages it writes (past the prefix) must belong to no
                other held request (ValueError); prefix pages may be shared.
            num_tokens: tokens of the request (prompt length), in ``[0, 2**62]`` (`_worker.MAX_TOKENS`).
            prefix_tokens: tokens this rank's group already holds (a prefix-cache hit); only
                ``[prefix_tokens, num_tokens)`` is transferred.

        Raises:
            RuntimeError: the receiver is closed; not connected to any sender, not to every
                prefill DCP rank (each ``dcp_rank`` of the senders' ``dcp_size``), or, for some prefill DCP rank, not to
                the TP ranks that move every KV head this rank holds (`views.uncovered_heads`; the
                message names the DCP rank, the heads and the TP ranks sending them): the missing
                tokens or heads would never come.
            TypeError, ValueError: bad id, token counts or page table, an id still held
                (release it first), or more pages than one announcement carries
                (`protocol.MAX_EXPECT_PAGES`, 2,096,640: the control plane's 16 MiB frame).
                Nothing is held when it raises.
        """
        self._check_open()
        rid = check_request_id(request_id)
        num_tokens, prefix_tokens = check_tokens("num_tokens", num_tokens), check_tokens("prefix_tokens", prefix_tokens)
        if prefix_tokens > num_tokens:
            raise ValueError(f"prefix_tokens={prefix_tokens} must be <= num_tokens={num_tokens}")
        s = self.spec
        rows = int(local_len_np(int(num_tokens), s.dcp_size, s.dcp_rank, s.interleave_size))
        proto.check_expect_pages(rows, s.page_size, int(num_tokens))
        table = check_page_table(page_table, rows, s.page_size, self._layers.min_rows // s.page_size)
        with self._lock:
            self._check_coverage()
            if rid in self._requests:
                raise ValueError(f"request_id={rid!r} is still held ({self._requests[rid].status.name}); "
                                 "release() it first")
            # Pages the transfer writes (rows of [prefix_tokens, num_tokens)) must belong to no other
            # held request; prefix pages may be shared (a prefix cache hands one block to many).
            lo = int(local_len_np(int(prefix_tokens), s.dcp_size, s.dcp_rank, s.interleave_size))
            written = [int(p) for p in table[lo // s.page_size: -(-rows // s.page_size)]]
            clash = next((p for p in written if p in self._page_owner), None)
            if clash is not None:
                owner = self._page_owner[clash]
                if owner in self._requests:
                    raise ValueError(f"page_table: page {clash} is written by request {owner!r}, still held "
                                     "(requests must write disjoint pages; release that one first)")
                raise ValueError(f"page_table: page {clash} belongs to request {owner}: a sender's write may "
                                 "still land there; it is free once its sender says drained, or after drain_grace_s")
            self._layers.check_pages(written, self._page_owner)  # entries viewing one buffer
            # Only the senders that move this rank something (`views.pair_moves`): a pair with
            # no head in common has nothing to send, and its sender does not wait for this rank.
            inc = secrets.randbits(62) + 1
            # Encoded before anything is held: a frame that cannot go leaves no request behind.
            frame = proto.encode("expect", rid, inc, num_tokens=int(num_tokens),
                                 prefix_tokens=int(prefix_tokens),
                                 page_table=proto.pack_i64(table[:-(-rows // s.page_size)]),
                                 dcp_rank=s.dcp_rank)
            req = RecvRequest(rid, inc, table, int(num_tokens), int(prefix_tokens),
                              [link for link in self._links if pair_moves(link.spec, s)])
            req.written_pages = written
            self._page_owner.update(dict.fromkeys(written, rid))
            self._requests[rid] = req
            self._counts["requests"] += 1
            self._outbox.extend((link, frame) for link in req.senders)
            if prefix_tokens == num_tokens and req.finish(TransferStatus.SUCCESS):
                self._counts["succeeded"] += 1  # all of it is here already: nothing will come
        self._worker.wake()

    def poll(self, request_id: str) -> TransferStatus:
        """The request's `TransferStatus` on this rank. Raises KeyError if unknown,
        TypeError / ValueError for an id no request can have (`requests.check_request_id`)."""
        return self._get(request_id).status

    def abort(self, request_id: str, reason: str = "aborted by the decode side") -> bool:
        """Aborts the request here and tells its senders; reads in flight are cancelled and
        reported to the sender once the engine is done with them. Idempotent. The request's
        pages may be reused once `is_drained` says so (a push sender may still be writing).

        Args:
            reason: text for both sides' `failure_reason` (``str()`` of it, cut to 4096 characters).

        Returns:
            True if it moved to ABORTED now. Raises KeyError if unknown, TypeError / ValueError
            for an id no request can have (`requests.check_request_id`).
        """
        with self._lock:
            return self._end(self._get(request_id), TransferStatus.ABORTED, str(reason)[:proto.MAX_TEXT], "abort")

    def release(self, request_id: str) -> None:
        """Forgets a request (aborting it first if live); the id may then be expected again.
        Its pages stay held until no engine can write them any more (`is_drained`'s rule, checked
        by the worker): until then an `expect` writing one of them is refused (ValueError naming
        the page and the released request). Raises KeyError if unknown, TypeError / ValueError
        for an id no request can have (`requests.check_request_id`)."""
        with self._lock:
            req = self._get(request_id)
            if not req.status.terminal:
                self._end(req, TransferStatus.ABORTED, "released before completion", "abort")
            del self._requests[request_id]
            if self._drained(req):
                self._free_pages(req)
            else:  # an engine may still write them: held (a new expect() on them is refused) until drained
                self._released[(req.rid, req.inc)] = req
                self._page_owner.update(dict.fromkeys(req.written_pages, f"{req.rid} (released, not drained yet)"))
            for key in [k for k in self._chunk_rows if k[0] is req]:
                del self._chunk_rows[key]

    def is_drained(self, request_id: str) -> bool:
        """True when nothing can write into this request's pages any more, so the decode side
        may hand them to another request: after SUCCESS; after FAILED/ABORTED once this rank's
        own reads (pull) finished and every push sender said it has no write in flight (or is
        gone: dropped, then reconnected or silent for ``drain_grace_s``). Raises KeyError if unknown,
        TypeError / ValueError for an id no request can have (`requests.check_request_id`)."""
        with self._lock:
            req = self._get(request_id)
            if self._closed:  # no worker any more: the senders in doubt expire here
                self._expire_doubt(time.monotonic())
            return self._drained(req)

    def _get(self, request_id: str) -> RecvRequest:
        req = self._requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            check_request_id(request_id)  # not a str: TypeError naming request_id, not "unhashable"
            raise KeyError(f"request_id={request_id!r} is not known to this receiver")
        return req
