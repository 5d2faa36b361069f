"""Batch handles, counters, and how a handle completes through a background `Job`.

A `TransferHandle` is what `TransferEngine.transfer_batch` returns. Behind it each adapter keeps
a `Job` (`bridge.workers`): one unit of work run by a `Worker` thread, or followed by a `Poller`;
`JobCompletion` finishes handles from the jobs' outcome. `Job`, `Worker` and `Poller` are
re-exported here unchanged.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from bridge.errors import PeerError, TransferError
from bridge.workers import Job, Poller, Worker  # noqa: F401 - re-exported

__all__ = ["EngineCounters", "TransferHandle", "Job", "Worker", "Poller", "OPS"]

#: Transfer directions: "WRITE" moves local -> remote, "READ" remote -> local.
OPS = ("WRITE", "READ")


@dataclasses.dataclass
class EngineCounters:
    """Running totals of what an engine submitted (the main job reports them).

    Attributes:
        descriptors: descriptors submitted (rows of every accepted batch, WRITE and READ).
        bytes: payload bytes submitted.
        batches: `transfer_batch` calls accepted.
        engine_calls: submit calls made into the engine library (a Mooncake batch larger than its
            window costs several).
    """

    descriptors: int = 0
    bytes: int = 0
    batches: int = 0
    engine_calls: int = 0


class TransferHandle:
    """One submitted batch; finish it with `TransferEngine.check` (until True or it raises) or
    `TransferEngine.wait`, once.

    Attributes:
        peer: the peer's name (destination of a WRITE, source of a READ).
        num_descriptors: rows in the batch.
        nbytes: payload bytes.
        notif: notification the peer receives on completion, or None.
        dcp_rank, chunk: caller context copied into any `TransferError`.
        op: "WRITE" or "READ".
        released: True once `check` returned True or raised, `wait` returned or raised, or the
            engine was closed. The batch's memory may be reused only then (see `check`).
        seq: unique per engine, set at submission (keys the engine's bookkeeping).
    """

    __slots__ = ("peer", "num_descriptors", "nbytes", "notif", "dcp_rank", "chunk", "released",
                 "submitted_at", "seq", "op")

    def __init__(self, peer: str, num_descriptors: int, nbytes: int, notif: bytes | None,
                 dcp_rank: int | None, chunk: int | None, op: str = "WRITE"):
        self.peer = peer
        self.num_descriptors = num_descriptors
        self.nbytes = nbytes
        self.notif = notif
        self.dcp_rank = dcp_rank
        self.chunk = chunk
        self.op = op
        self.released = False
        self.submitted_at = time.monotonic()
        self.seq = 0  # set by the engine: unique per engine, keys its bookkeeping

    def __repr__(self) -> str:
        ctx = "" if self.dcp_rank is None else f", dcp_rank={self.dcp_rank}"
        ctx += "" if self.chunk is None else f", chunk={self.chunk}"
        return (f"TransferHandle({self.op}, peer={self.peer!r}, descriptors={self.num_descriptors:,}, "
                f"bytes={self.nbytes:,}{ctx}, released={self.released})")

    def error(self, cls: type[TransferError], message: str, engine_message: str = "") -> TransferError:
        """Builds a `TransferError` (or subclass) carrying this batch's peer, size and context."""
        return cls(message, peer=self.peer, num_descriptors=self.num_descriptors,
                   engine_message=engine_message, dcp_rank=self.dcp_rank, chunk=self.chunk)


class JobCompletion:
    """Completion of batches that run as `Job` s on worker threads (Mooncake, jax-transfer):
    ``_engine_check`` / ``_engine_block`` / ``_engine_cancel`` / ``_engine_abort`` of a
    `bridge.base.TransferEngine` over ``self._jobs`` (handle.seq -> Job), which `_submit_job`
    fills from ``self._workers`` (one `Worker` per peer). ``JOB_LABEL`` names the engine in errors."""

    JOB_LABEL = "engine"
    _jobs: dict
    _workers: dict  # peer name -> its `Worker`

    def _submit_job(self, handle: TransferHandle, job: Job) -> None:
        """Queues ``job`` on the worker of ``handle.peer``, known by ``handle.seq`` until checked.

        Raises:
            PeerError: the peer has no worker (removed, or the engine closed, perhaps concurrently).
        """
        worker = self._workers.get(handle.peer)
        try:
            if worker is None:
                raise RuntimeError("no worker")
            self._jobs[handle.seq] = job
            worker.submit(job)
        except RuntimeError as exc:  # worker stopped by a concurrent remove_peer or close
            self._jobs.pop(handle.seq, None)
            raise PeerError(f"peer={handle.peer!r} was removed") from exc

    def _engine_check(self, handle: TransferHandle) -> bool:
        job = self._jobs[handle.seq]
        if not job.done.is_set():
            return False
        self._jobs.pop(handle.seq, None)
        if job.dropped:
            raise handle.error(TransferError, f"{self.JOB_LABEL} {handle.op} cancelled before it started",
                               job.cancel_reason or "")
        if job.error is not None:
            if isinstance(job.error, TransferError):
                raise job.error
            raise handle.error(TransferError, f"{self.JOB_LABEL} {handle.op} failed",
                               f"{type(job.error).__name__}: {job.error}")
        return True

    def _engine_block(self, handle: TransferHandle, max_s: float) -> None:
        job = self._jobs.get(handle.seq)
        if job is not None:
            job.done.wait(max_s)
        else:
            time.sleep(max_s)

    def _engine_cancel(self, handle: TransferHandle) -> None:
        job = self._jobs.get(handle.seq)
        if job is not None:
            job.cancel("cancelled by the caller")

    def _engine_abort(self, handle: TransferHandle) -> None:
        job = self._jobs.pop(handle.seq, None)
        if job is not None:  # stops further windows; the one inside the engine ends on its own
            job.cancel("abandoned after a timeout")


def check_notif(notif: Any) -> bytes | None:
    """Validates a notification tag: None, or non-empty bytes (returned as bytes)."""
    if notif is None:
        return None
    if not isinstance(notif, (bytes, bytearray)):
        raise TypeError(f"notif must be bytes or None, got {type(notif).__name__}")
    if len(notif) == 0:
        raise ValueError("notif must be non-empty bytes (an empty tag cannot be matched)")
    return bytes(notif)


def check_timeout(timeout_s: Any, *, allow_zero: bool = False) -> float:
    """Validates a timeout in seconds: a number > 0 (>= 0 with allow_zero)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    if not (timeout_s >= 0 if allow_zero else timeout_s > 0) or timeout_s != timeout_s:
        raise ValueError(f"{timeout_s=} must be {'>=' if allow_zero else '>'} 0 seconds")
    return float(timeout_s)
