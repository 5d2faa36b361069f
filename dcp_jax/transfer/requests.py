"""Per-request bookkeeping of the connector: token-range coverage, sender and receiver records.

One object per request per side holds everything that request needs (state, page tables,
what landed, counters); the `KVSender` / `KVReceiver` only hold what requests share (engine,
pack arena, connections). Nothing here touches an engine or a socket.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from dcp_jax.transfer._worker import check_seconds
from dcp_jax.transfer.protocol import MAX_REQUEST_ID
from dcp_jax.transfer.status import RequestState, TransferStatus

__all__ = ["Coverage", "RankCounters", "RankTarget", "SendRequest", "RecvRequest", "RequestQueries", "check_request_id"]


def check_request_id(request_id: Any, name: str = "request_id") -> str:
    """Request ids are non-empty strings of at most `protocol.MAX_REQUEST_ID` (256) bytes in
    UTF-8: 256 ASCII characters, fewer of others (each side's engine notification carries the id).

    Raises:
        TypeError: not a str.  ValueError: empty, too long, or not encodable as UTF-8 (a lone
            surrogate, as `os.fsdecode` makes); the message names ``name``.
    """
    if not isinstance(request_id, str):
        raise TypeError(f"{name} must be a str, got {type(request_id).__name__}")
    if not 0 < len(request_id) <= MAX_REQUEST_ID:  # (cheap first: most ids are ASCII)
        raise ValueError(f"{name} must have 1..{MAX_REQUEST_ID} characters, got {len(request_id)}")
    if not request_id.isascii():
        try:
            n = len(request_id.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name}={request_id!r} is not valid UTF-8 text ({exc.reason} at "
                             f"position {exc.start})") from None
        if n > MAX_REQUEST_ID:
            raise ValueError(f"{name} must have at most {MAX_REQUEST_ID} bytes in UTF-8, got {n} "
                             f"({len(request_id)} characters)")
    return request_id


class Coverage:
    """Union of half-open token ranges ``[start, stop)`` (kept merged and sorted)."""

    __slots__ = ("_spans",)

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []

    def add(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        spans = sorted(self._spans + [(start, stop)])
        merged = [spans[0]]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self._spans = merged

    def covers(self, start: int, stop: int) -> bool:
        """True when every token of ``[start, stop)`` is inside one added range (empty: True)."""
        if stop <= start:
            return True
        return any(a <= start and stop <= b for a, b in self._spans)

    def overlaps(self, start: int, stop: int) -> bool:
        return any(a < stop and start < b for a, b in self._spans)

    def gaps(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The ranges of ``[start, stop)`` no added range covers, in order."""
        out, at = [], start
        for a, b in self._spans:
            if b <= at or a >= stop:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < stop:
            out.append((at, stop))
        return out

    def __repr__(self) -> str:
        return f"Coverage({self._spans})"


def ranges_text(ranges: list[tuple[int, int]], shown: int = 4) -> str:
    """Token ranges for a message: ``"[16, 32), [40, 48) and 3 more"`` (at most ``shown`` listed)."""
    text = ", ".join(f"[{a}, {b})" for a, b in ranges[:shown])
    return text + (f" and {len(ranges) - shown} more" if len(ranges) > shown else "")


@dataclasses.dataclass
class RankCounters:
    """What one (request, decode rank) cost: the figures the cost report predicts."""

    rows: int = 0
    descriptors: int = 0
    bytes: int = 0
    batches: int = 0
    engine_calls: int = 0
    strategies: set = dataclasses.field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strategy"] = ",".join(sorted(d.pop("strategies")))
        return d


@dataclasses.dataclass(eq=False)
class RankTarget:
    """One decode rank's announcement of a request, as the sender holds it."""

    conn: Any                 # the receiver connection (sender._Conn)
    inc: int                  # the receiver's incarnation of the request id
    num_tokens: int
    prefix_tokens: int
    page_table: np.ndarray    # i64[pages], section-10 convention (local rows from token 0)
    next_chunk: int = 0       # index of the next request chunk to plan for this rank
    coverage: Coverage = dataclasses.field(default_factory=Coverage)
    parts_left: dict = dataclasses.field(default_factory=dict)  # chunk -> windows not yet done
    counters: RankCounters = dataclasses.field(default_factory=RankCounters)
    inflight: int = 0         # windows of this rank the engine (or the reader) still works on
    drained: bool = False     # the rank was told no write of ours is in flight any more

    @property
    def complete(self) -> bool:
        return not self.parts_left and self.coverage.covers(self.prefix_tokens, self.num_tokens)


#: Timeline events kept per request (`Timeline`): enough for every window of a long request;
#: later events are counted, not kept, so a request's memory stays bounded.
MAX_EVENTS = 4096


class Timeline:
    """What happened to a request when: ``(event, rank, time.monotonic())`` triples, the clock
    every process of a host shares, so a sender's and its ranks' timelines line up.

    ``rank`` is the decode rank's group rank, ``tp_rank * dcp_size + dcp_rank``
    (`KVCacheSpec.group_rank`, the key a sender files a decode rank under; ``dcp_rank`` itself
    without TP): one per decode process, so TP ranks of one DCP rank stay apart. A sender's events
    name the decode rank they concern; a receiver's, itself.

    Events (sender): ``pack`` / ``packed`` (a window's pack kernel enqueued / returned), ``ask``
    (region room asked: region push, right after the pack is enqueued, so before its
    ``packed``), ``post`` (engine batch posted; pull: ``pull_ready`` sent), ``complete`` (the
    engine said done; pull: the rank's ``pull_done`` arrived); fused: ``copy`` (the round's copy
    begins: index staging and the launch follow), ``checked`` / ``staged`` (the launch's indices
    checked / in the slot the kernel reads: `pallas_kernels.copy_fanout`'s phases), ``launched`` (the kernel enqueued),
    ``flagged`` (the flag page's bump enqueued behind it), ``told`` (``fused_done`` sent),
    ``copied`` (the sender's host wait for it returned). Receiver: ``landed`` (a region window's ``done`` seen), ``unpacked`` (placed into
    the pages), ``part`` (a window credited), ``end`` (SUCCESS). At most `MAX_EVENTS` kept;
    ``dropped`` counts the rest.
    """

    __slots__ = ("events", "dropped")

    def __init__(self):
        self.events: list[tuple[str, int, float]] = []
        self.dropped = 0

    def mark(self, event: str, rank: int) -> None:
        """Records ``event`` for decode group rank ``rank`` now."""
        if len(self.events) < MAX_EVENTS:
            self.events.append((event, int(rank), time.monotonic()))
        else:
            self.dropped += 1

    def as_list(self) -> list[list]:
        return [list(e) for e in self.events]


class SendRequest:
    """The sender's record of one request: its chunks, its decode ranks, its state."""

    def __init__(self, request_id: str):
        self.rid = request_id
        self.state = RequestState()
        self.page_table: np.ndarray | None = None
        self.reborn = False  # started under an id released < timeout_s ago (`KVSender.send`'s page check)
        # `KVSender.abort` was called on it: the prefill ended this use itself, so a later `send`
        # of the id is a chunk of it (dropped), never the next use's first (until `release`).
        self.aborted_here = False
        self.chunks: list[tuple[int, int]] = []
        self.sent = Coverage()
        self.group: str | None = None
        # The decode group ranks this sender moves bytes to (`views.served_group_ranks`), set by
        # the first announcement: the ranks the request waits for here.
        self.needed: frozenset[int] | None = None
        self.targets: dict[int, RankTarget] = {}
        # Ranks that announced the request only after it ended and were told how (not targets):
        # their next announcement of the id, once it is released, is its next use.
        self.told: dict[int, int] = {}  # rank -> the incarnation it was told of
        self.inflight = 0          # units submitted and not yet reported done by the engine
        self.plan_seconds = 0.0
        self.pack_seconds = 0.0
        self.stage_seconds = 0.0  # staged sender: device -> host copies (part of pack_seconds)
        self.copy_seconds = 0.0           # fused path: copy kernels, waited for
        self.launches = 0  # pack calls / fused fan-out launches that carried its windows
        self.t_first_submit: float | None = None
        self.first_byte_at: float | None = None  # time.monotonic() of the first pack or submit
        self.timeline = Timeline()

    @property
    def status(self) -> TransferStatus:
        return self.state.status

    def complete(self) -> bool:
        return (self.needed is not None and self.needed <= self.targets.keys()
                and all(t.complete for t in self.targets.values()))

    def finish(self, status: TransferStatus, reason: str = "") -> bool:
        return self.state.advance(status, reason)

    @property
    def t_done(self) -> float | None:
        """`time.perf_counter()` when the request ended (None while live)."""
        return self.state.ended_at


class RecvRequest:
    """A decode rank's record of one request it expects."""

    def __init__(self, request_id: str, inc: int, page_table: np.ndarray, num_tokens: int,
                 prefix_tokens: int, senders: list):
        self.rid = request_id
        self.inc = inc
        self.state = RequestState()
        self.page_table = page_table
        self.num_tokens = num_tokens
        self.prefix_tokens = prefix_tokens
        self.senders = list(senders)                     # the sender links announced to
        self.coverage = {id(s): Coverage() for s in self.senders}
        self.parts: dict[tuple[int, int], set] = {}      # (sender id, chunk) -> parts landed
        self.rows_landed: dict[tuple[int, int], int] = {}
        self.inflight = 0                                # pull reads submitted, not yet done
        self.drained: set[int] = set()                   # id(sender link) that said "drained"
        self.written_pages: list[int] = []               # pages the transfer writes (prefix pages excluded)
        self.due = 0                                     # "done"s expected: "sent" hints, region grants
        # `time.monotonic()` until which a sender's ``moving`` report holds this request as
        # progressing (an engine batch of it in flight within its bound); 0.0: none came.
        self.moving_until = 0.0
        # Pull: until when this rank's own READs in flight hold the request as progressing (each
        # READ's post + its size allowance, as the sender's batches; `ReceiverData._start_read`).
        self.reading_until = 0.0
        self.bytes = 0
        self.unpack_seconds = 0.0                        # region path: unpacks into the pages, waited for
        self.stage_seconds = 0.0  # staged on a GPU: host -> device window copies (part of unpack_seconds)
        self.unpacks = 0
        self.created = time.perf_counter()
        self.timeline = Timeline()

    @property
    def status(self) -> TransferStatus:
        return self.state.status

    def complete(self) -> bool:
        return self.inflight == 0 and all(
            c.covers(self.prefix_tokens, self.num_tokens) for c in self.coverage.values())

    def missing(self) -> str:
        """The token ranges that have not landed yet (from some sender), for a failure reason:
        ``"; tokens [16, 32) have not landed"``, or "" when every range has."""
        gaps = sorted({g for c in self.coverage.values() for g in c.gaps(self.prefix_tokens, self.num_tokens)})
        if not gaps:
            return ""
        return f"; tokens {ranges_text(gaps)} have not landed (a chunk never sent, or still moving)"

    def finish(self, status: TransferStatus, reason: str = "") -> bool:
        return self.state.advance(status, reason)

    @property
    def t_done(self) -> float | None:
        """`time.perf_counter()` when the request ended (None while live)."""
        return self.state.ended_at


class RequestQueries:
    """`wait` and `failure_reason` of `KVSender` and `KVReceiver` (a mixin: each side's `_get`
    finds the request or raises KeyError naming the id)."""

    def wait(self, request_id: str, timeout_s: float) -> TransferStatus:
        """Blocks until the request ends on this side (this prefill or decode rank) or
        ``timeout_s`` seconds passed (no polling: the worker wakes the caller when it ends the
        request); its status then.
        ``timeout_s=0`` answers at once (as `poll`). The wait is on the request object of the
        call: one released and expected again under the same id meanwhile is another request.

        Raises:
            KeyError: unknown request id. ValueError, TypeError: ``timeout_s`` not a number of
                seconds in [0, 86400]; an id no request can have (`check_request_id`).
        """
        limit = check_seconds("timeout_s", timeout_s, zero_ok=True)  # before the id: the same error either way
        return self._get(request_id).state.wait(limit)

    def failure_reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED ("" otherwise). Raises KeyError if unknown,
        TypeError / ValueError for an id no request can have (`check_request_id`)."""
        return self._get(request_id).state.reason
