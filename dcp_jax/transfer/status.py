"""Request states of the connector and the only transitions allowed between them.

The shape follows sglang's ``KVPoll`` (states move forward only, ``Failed`` sticks) and
sglang-jax's ``LEGAL_TRANSITIONS`` table:

    WAITING ──> TRANSFERRING ──> SUCCESS
       │              │
       ├──────────────┴──> FAILED    (sticks; carries a reason)
       └──────────────────> ABORTED  (sticks; carries a reason)

``WAITING -> SUCCESS`` is legal: a request whose every unit is empty (a rank that owns no token
of it) completes without a byte moving. Once terminal (SUCCESS, FAILED, ABORTED) a request stays
so: later events (a late abort, a stale notification, a timeout) are ignored, never applied.
"""
from __future__ import annotations

import enum
import threading
import time

__all__ = ["TransferStatus", "LEGAL_TRANSITIONS", "IllegalTransition", "RequestState"]


class TransferStatus(enum.Enum):
    """Where one request stands on one side (sender or receiver)."""

    WAITING = "waiting"            #: announced or queued; no byte in flight yet
    TRANSFERRING = "transferring"  #: at least one batch submitted, not all landed
    SUCCESS = "success"            #: every byte of every chunk landed (engine's own word)
    FAILED = "failed"              #: an engine error, a timeout or a dead peer; see the reason
    ABORTED = "aborted"            #: aborted by either side before it completed

    @property
    def terminal(self) -> bool:
        """True for SUCCESS, FAILED and ABORTED."""
        return self in _TERMINAL


_TERMINAL = frozenset({TransferStatus.SUCCESS, TransferStatus.FAILED, TransferStatus.ABORTED})

#: state -> states it may move to
LEGAL_TRANSITIONS: dict[TransferStatus, frozenset[TransferStatus]] = {
    TransferStatus.WAITING: frozenset({TransferStatus.TRANSFERRING, TransferStatus.SUCCESS,
                                       TransferStatus.FAILED, TransferStatus.ABORTED}),
    TransferStatus.TRANSFERRING: frozenset({TransferStatus.SUCCESS, TransferStatus.FAILED,
                                            TransferStatus.ABORTED}),
    TransferStatus.SUCCESS: frozenset(),
    TransferStatus.FAILED: frozenset(),
    TransferStatus.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A non-terminal request was asked to move backwards (a bug in the caller of `advance`)."""


class RequestState:
    """Status, failure reason and last-progress time of one request; thread-safe.

    Attributes:
        status: the current `TransferStatus`.
        reason: why it FAILED or was ABORTED ("" otherwise).
        last_progress: `time.monotonic()` of the last transition or `touch` (seconds).
        ended_at: `time.perf_counter()` of the move to a terminal state (None before).
    """

    __slots__ = ("_lock", "_ended", "status", "reason", "last_progress", "created", "ended_at")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self.status = TransferStatus.WAITING
        self.reason = ""
        self.created = self.last_progress = time.monotonic()
        self.ended_at: float | None = None  # time.perf_counter() of the terminal transition

    def advance(self, new: TransferStatus, reason: str = "") -> bool:
        """Moves to ``new`` if legal; a terminal state ignores every later move.

        Returns:
            True if the status changed, False if it was already ``new`` or already terminal.

        Raises:
            IllegalTransition: a non-terminal state asked to move to a state it cannot reach
                (e.g. TRANSFERRING -> WAITING).
        """
        with self._lock:
            cur = self.status
            if cur is new or cur.terminal:
                return False
            if new not in LEGAL_TRANSITIONS[cur]:
                raise IllegalTransition(f"request cannot move from {cur.name} to {new.name}")
            if new in (TransferStatus.FAILED, TransferStatus.ABORTED):
                self.reason = reason or new.value
            if new.terminal:  # set before the status, so a caller who sees it sees the time too
                self.ended_at = time.perf_counter()
            self.last_progress = time.monotonic()
            self.status = new
        if new.terminal:
            self._ended.set()
        return True

    def wait(self, timeout_s: float) -> "TransferStatus":
        """Blocks until the request is terminal or ``timeout_s`` seconds passed; its status then."""
        self._ended.wait(timeout_s)
        return self.status

    def touch(self) -> None:
        """Records progress without a transition (a batch landed, a peer announced itself)."""
        self.last_progress = time.monotonic()

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds since the last progress."""
        return (time.monotonic() if now is None else now) - self.last_progress

    def __repr__(self) -> str:
        extra = f", reason={self.reason!r}" if self.reason else ""
        return f"RequestState({self.status.name}{extra})"
