"""Background jobs: the `Job` each adapter runs its engine calls as, and the daemon threads that run them.

A `Job` is one unit of work (post a NIXL transfer, submit a batch's Mooncake windows) run by a
`Worker`, a daemon thread with a FIFO queue; a `Poller` thread follows work the engine finishes
on its own (a posted NIXL transfer). Both are daemons on purpose: a thread stuck inside
an engine (a window blocked on a dead peer) must not keep the interpreter from exiting, and
`TransferEngine.close` must be able to return without joining it. The handles whose completion
these jobs decide are in `bridge.handles`.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "Worker", "Poller"]


class Job:
    """One unit of engine work: ``fn(job, *args)`` run once by a `Worker`.

    States: queued -> running -> done, or queued -> done with ``dropped`` set when it was
    cancelled before it started. A running job sees `cancel_reason` and may stop early (the
    Mooncake window loop does). ``done`` is set only after ``fn`` returned or raised, so once it
    is set the job no longer runs engine code.

    Attributes:
        done: set when finished (ran, failed or dropped).
        result: what fn returned. error: what it raised (None if nothing).
        dropped: True when cancelled before it started (fn never ran).
        cancel_reason: why cancellation was asked for, or None.
        tag: free field for the adapter (the peer name).
    """

    __slots__ = ("fn", "args", "done", "result", "error", "dropped", "cancel_reason", "tag",
                 "_callbacks", "_cb_lock")

    def __init__(self, fn: Callable[..., Any], *args: Any, tag: Any = None):
        self.fn, self.args, self.tag = fn, args, tag
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.dropped = False
        self.cancel_reason: str | None = None
        self._callbacks: list[Callable[[Job], None]] | None = []
        self._cb_lock = threading.Lock()

    def cancel(self, reason: str) -> None:
        """Asks the job to stop: a queued job is dropped; a running one sees `cancel_reason`."""
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def run(self) -> None:
        """Runs fn (or drops the job if cancelled first), then marks it done and calls back."""
        if self.cancel_reason is not None:
            self.dropped = True
        else:
            try:
                self.result = self.fn(self, *self.args)
            except BaseException as exc:  # noqa: BLE001 - kept for the thread that checks the job
                _drop_locals(exc)
                self.error = exc
        self.fn = self.args = None  # the job may outlive its handle: keep no descriptor lists
        with self._cb_lock:
            self.done.set()
            callbacks, self._callbacks = self._callbacks, None
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # noqa: BLE001 - a cleanup callback must not kill the worker
                pass

    def add_done_callback(self, cb: Callable[[Job], None]) -> None:
        """Calls ``cb(job)`` once the job is done (now, in this thread, if it already is)."""
        with self._cb_lock:
            if self._callbacks is not None:
                self._callbacks.append(cb)
                return
        cb(self)


def _drop_locals(exc: BaseException | None) -> None:
    """Clears the local variables of the finished frames in exc's tracebacks (its causes too).

    A stored error otherwise keeps the job's frame alive, and with it the engine object that
    frame used (a reference cycle job -> error -> frame -> job): the engine would then be destroyed
    by a later garbage collection, at any time, in any thread, instead of by `close`.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class _Daemon:
    """What `Worker` and `Poller` share: ``self._thread``, a daemon thread started on first use."""

    _thread: threading.Thread | None

    def join(self, timeout_s: float | None = None) -> bool:
        """Waits for the thread to end after `stop`; True when it has (or never started)."""
        t = self._thread
        if t is None or t.ident is None:  # never started (refused at interpreter exit)
            return True
        t.join(timeout_s)
        return not t.is_alive()


class Worker(_Daemon):
    """A daemon thread running `Job`s in submission order (or inline, in the caller).

    Args:
        name: thread name.
        inline: run each job inside `submit` (no thread): errors then propagate from `submit`.
    """

    def __init__(self, name: str, inline: bool = False):
        self.name, self.inline = name, inline
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._stopped = False
        self._running = False  # a job runs (on the thread, or in a caller through `run_if_idle`)
        self._thread: threading.Thread | None = None

    def run_if_idle(self, job: Job) -> bool:
        """Runs ``job`` in the calling thread at once if nothing is queued or running (so the
        submission order holds, and no two jobs ever run at the same time); returns whether it
        did. Its errors stay in ``job.error``, as on the thread.

        Raises:
            RuntimeError: the worker was stopped.
        """
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"worker {self.name} is stopped")
            if self._queue or self._running:
                return False
            self._running = True
        self._run_marked(job)
        return True

    def in_thread(self) -> bool:
        """Whether the caller is this worker's own thread (not a caller running a job inline)."""
        return threading.current_thread() is self._thread

    def _run_marked(self, job: Job) -> None:
        """Runs a job `_running` was set for (under the lock), then clears it and wakes the
        waiters: the thread (a job queued meanwhile) and `join` (a stop)."""
        try:
            job.run()
        finally:
            with self._cv:
                self._running = False
                if self._queue or self._stopped:  # else no waiter has anything to do: wake none
                    self._cv.notify_all()           # (a woken thread costs the caller a GIL handoff)

    def join(self, timeout_s: float | None = None) -> bool:
        """Waits for the thread to end after `stop`, and for a job a caller runs through
        `run_if_idle` (started before the stop) to return; True when both have."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        ended = super().join(timeout_s)
        with self._cv:
            while self._running and (deadline is None or time.monotonic() < deadline):
                self._cv.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            return ended and not self._running

    def submit(self, job: Job) -> None:
        """Queues a job (starting the thread on first use).

        Raises:
            RuntimeError: the worker was stopped.
            BaseException: inline mode only, whatever the job raised.
        """
        if self.inline:
            if self._stopped:
                raise RuntimeError(f"worker {self.name} is stopped")
            job.run()
            if job.error is not None:
                raise job.error
            return
        with self._cv:
            if self._stopped:
                raise RuntimeError(f"worker {self.name} is stopped")
            if self._thread is None:
                self._thread = _started(self._loop, self.name)
            self._queue.append(job)
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn()`` on the worker after the jobs queued so far and returns its result.

        Raises:
            RuntimeError: the worker was stopped. BaseException: whatever fn raised.
        """
        job = Job(lambda _job: fn())
        self.submit(job)
        job.done.wait()
        if job.dropped:
            raise RuntimeError(f"worker {self.name} stopped before the call ran")
        if job.error is not None:
            raise job.error
        return job.result

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._queue or self._running) and not self._stopped:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = True
            self._run_marked(job)

    def stop(self, reason: str) -> None:
        """Refuses new jobs and drops the queued ones; the running job (if any) finishes."""
        with self._cv:
            self._stopped = True
            for job in self._queue:
                job.cancel(reason)
            self._cv.notify()


#: How a polling wait grows over empty rounds (factor g). Below the cap, a completion is seen at
#: most ~(g - 1) x its wait so far late: 2x (the earlier factor) saw a write that ended after
#: 1.5 ms only at 2.54 ms; 1.25x sees it by 1.74 ms, and reaches the same cap after more rounds
#: (~25 from 20 us to 2 ms, ~12 ms in all).
BACKOFF_GROWTH = 1.25


#: An in-order `Poller` polls every item at least this often (seconds; its other rounds stop at the
#: first unfinished item): a transfer that ends while an older one is stuck (a stopped peer's) is
#: seen at most this much later than a full poll would see it. The fresh-user trial measured the
#: earlier rule (every 4th round) at 3.3 ms median, 5.7 ms worst, against 1.2 / 1.8 polling all.
FULL_ROUND_S = 5e-4


def next_backoff(pause: float, first_s: float, max_s: float) -> float:
    """The next wait of a polling loop after an empty round (seconds): `pause` grown by
    `BACKOFF_GROWTH`, at least `first_s`, at most `max_s`."""
    return min(max(pause * BACKOFF_GROWTH, first_s), max_s)


class Poller(_Daemon):
    """A daemon thread calling ``poll(item)`` for every added item until it returns True.

    Between rounds it sleeps with a backoff (`first_s` growing by `BACKOFF_GROWTH` up to `max_s`
    seconds, `next_backoff`) that
    restarts whenever an item finished; with nothing to poll it waits for `add`. ``poll`` must
    not raise (an exception counts as finished).

    ``in_order``: a round stops at the first item still unfinished (oldest first), and a round at
    least `FULL_ROUND_S` after the last full one polls them all (so an item stuck in progress
    delays the others' notice by at most that, or by one pause once pauses are longer): for
    transfers that mostly end in the order they were posted (NIXL's writes on one GPU). Every poll is a call into the
    engine under the GIL: polling eight writes every 20 us took host time from the thread posting
    the next ones (2026-12-04, H200: a region write's post cost ~480 us of host time in the job).
    """

    def __init__(self, name: str, poll: Callable[[Any], bool], *, first_s: float = 2e-5, max_s: float = 2e-3,
                 in_order: bool = False):
        self.name, self._poll, self._first_s, self._max_s = name, poll, first_s, max_s
        self._in_order = in_order
        self._items: list[Any] = []
        self._cv = threading.Condition(threading.Lock())
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, item: Any) -> None:
        """Starts polling item (and the thread, on first use)."""
        with self._cv:
            if self._thread is None and not self._stopped:
                self._thread = _started(self._loop, self.name)
            self._items.append(item)
            if len(self._items) == 1:  # the thread waits only with nothing to poll
                self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Items not finished yet."""
        return len(self._items)

    def _loop(self) -> None:
        pause, last_full = self._first_s, float("-inf")
        while True:
            with self._cv:
                while not self._items and not self._stopped:
                    self._cv.wait()
                    pause = self._first_s
                if self._stopped:
                    return
                batch = list(self._items)
            now = time.monotonic()
            every = not self._in_order or now - last_full >= FULL_ROUND_S
            if every:
                last_full = now
            done = []
            for item in batch:
                try:
                    finished = self._poll(item)
                except Exception:  # noqa: BLE001 - documented: counts as finished
                    finished = True
                if finished:
                    done.append(item)
                elif not every:
                    break  # in order: the younger ones are seen once this one finished
            with self._cv:
                for item in done:
                    self._items.remove(item)
                if not self._items:
                    self._cv.notify_all()  # `drain` waiters
            if done:
                pause = self._first_s
            else:
                time.sleep(pause)
                pause = next_backoff(pause, self._first_s, self._max_s)

    def drain(self, timeout_s: float) -> bool:
        """Waits until every item finished; True if so within timeout_s seconds."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._items:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cv.wait(min(left, 0.1))
            return True

    def stop(self) -> None:
        """Ends the thread after its current round (unfinished items are abandoned)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


def _started(target: Callable[[], None], name: str) -> threading.Thread:
    """A started daemon thread. Raises RuntimeError (nothing kept) where Python refuses to start
    one: at interpreter exit, an atexit hook running while the caller still submits work."""
    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    return t
