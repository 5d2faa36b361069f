"""Shared pieces of the sender and the receiver: the worker thread, the common part of closing
a side, and argument checks."""
from __future__ import annotations

import atexit
import logging
import reprlib
import threading
import time
import traceback
import uuid
import weakref
from typing import Any, Callable

import numpy as np
import zmq

import bridge.core  # noqa: F401 - registers the engines' atexit hook before `_close_live_sides`
from bridge.workers import next_backoff
from dcp_jax._validate import check_int_type, pages_required_text, plural
from dcp_jax.transfer.control import zmq_context
from dcp_jax.transfer.status import TransferStatus
from pallas_kernels._buffer_args import as_1d

__all__ = ["Worker", "IDLE", "PENDING", "ACTIVE", "TIMEOUT_CHECK_S", "MAX_TOKENS", "check_page_table", "check_seconds",
           "check_tokens", "shut_down", "close_at_exit"]

logger = logging.getLogger(__name__)

#: The worker's waits. Engine completions and notifications wake no socket, so while anything
#: is awaited the engine is polled on a backoff: right after a round that did something, then
#: growing from `MIN_BACKOFF_S` to `MAX_BACKOFF_S` over empty rounds (`bridge.workers.next_backoff`:
#: by 1.25x, so below the cap a completion is seen at most ~25% of its wait late; a pending request with
#: nothing in flight costs ~1,000 wake-ups a second, not a core). The cap bounds how late a
#: completion is seen: on one H200 a whole 2.3 GB request takes ~10 ms, and a 2 ms cap showed
#: as up to 2 ms between a write's end and its rank's notice (timelines of the GPU job). Idle,
#: only a control message or `wake` ends a wait of `IDLE_POLL_MS`.
MIN_BACKOFF_S = 20e-6
MAX_BACKOFF_S = 1e-3
IDLE_POLL_MS = 20
#: After a `SPIN` round with a ``spin_fn``, the worker checks only it (no sockets, no engine)
#: for up to this long before the next full round: a round took ~0.1-0.2 ms on the H200 host, so
#: a flag seen at a round's start was credited that much later. Longer than the 2.30 GB fused
#: copy (1.24 ms) so one spin covers it: with 0.5 ms, 8 ranks saw one flag over 0.14-0.23 ms.
SPIN_WINDOW_S = 2e-3

#: Requests are scanned for no-progress timeouts at most this often (seconds), not every round.
TIMEOUT_CHECK_S = 0.05

#: Largest token position or count `send` / `expect` take: the plans compute positions in int64
#: (sums of a position and an interleave block stay inside it).
MAX_TOKENS = 1 << 62
_I64 = (-(1 << 63), (1 << 63) - 1)

#: What a round returns. SPIN: something is due within microseconds (a device copy a peer
#: said it launched): the next round follows after `MIN_BACKOFF_S`, the backoff does not grow.
IDLE, PENDING, ACTIVE, SPIN = 0, 1, 2, 3

#: Worker errors logged with their traceback; then one line per `ERROR_LOG_INTERVAL_S` counts the
#: rest (a peer that makes every frame fail must not flood the log; each is counted in ``errors``).
MAX_LOGGED_ERRORS = 10
ERROR_LOG_INTERVAL_S = 60.0
_SHORT = reprlib.Repr()  # a frame may hold 16 MiB: its log line shows the start of each field
_SHORT.maxstring = _SHORT.maxother = 80


class Worker:
    """One daemon thread calling ``round_fn`` until stopped.

    ``round_fn()`` returns `ACTIVE` (it did something: the next round follows at once),
    `SPIN` (something is due within microseconds: the next round follows after `MIN_BACKOFF_S`),
    `PENDING` (something is awaited from the engine: the next round follows after the backoff)
    or `IDLE` (it waits up to `IDLE_POLL_MS` for a control message on a registered socket or a
    `wake`). An exception in a round, or in one frame's handling (`isolate`), is counted
    (``errors``, ``last_error``) and logged rate-limited (`note_error`), never fatal.

    ``spin_fn`` (optional, called on the worker thread without any lock): after a `SPIN` round
    the worker calls it back to back (yielding the GIL between calls) until it returns True or
    `SPIN_WINDOW_S` passed, then runs the next round: the wait for a device copy's end costs a
    memory read, not a round.
    """

    def __init__(self, name: str, round_fn: Callable[[], int], sock: zmq.Socket | None,
                 spin_fn: Callable[[], bool] | None = None):
        self.name, self._round, self.errors = name, round_fn, 0
        self._spin = spin_fn
        self.last_error = ""
        self._unlogged, self._next_log = 0, 0.0  # errors past MAX_LOGGED_ERRORS not yet reported
        addr = f"inproc://wake-{uuid.uuid4().hex}"
        self._rx = zmq_context().socket(zmq.PULL)
        self._rx.setsockopt(zmq.LINGER, 0)
        self._rx.bind(addr)
        self._tx = zmq_context().socket(zmq.PUSH)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.connect(addr)
        self._tx_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._rx, zmq.POLLIN)
        self._socks = []
        if sock is not None:
            self.add_socket(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def add_socket(self, sock: zmq.Socket) -> None:
        """Also end idle waits on messages to ``sock`` (call from the worker or before start)."""
        self._poller.register(sock, zmq.POLLIN)
        self._socks.append(sock)

    def remove_socket(self, sock: zmq.Socket) -> None:
        if sock in self._socks:
            self._poller.unregister(sock)
            self._socks.remove(sock)

    def start(self) -> None:
        self._thread.start()

    def owns_sockets(self) -> bool:
        """True on the worker's own thread, and on any thread once the worker is not running
        (before `start`, after `stop`): whoever may use the sockets it polls. A zmq socket is not
        thread-safe, and the worker polls its registered sockets outside any lock."""
        return threading.current_thread() is self._thread or not self._thread.is_alive()

    def wake(self) -> None:
        """Ends the worker's idle wait now (any thread)."""
        with self._tx_lock:
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def stop(self, timeout_s: float) -> bool:
        """Asks the loop to end and waits up to ``timeout_s``; True if it ended."""
        self._stop.set()
        self.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        ended = not self._thread.is_alive()
        if ended:
            self._rx.close(0)
        with self._tx_lock:
            self._tx.close(0)
        return ended

    def _spin_wait(self) -> None:
        if self._spin is None:
            time.sleep(MIN_BACKOFF_S)
            return
        end = time.perf_counter() + SPIN_WINDOW_S
        try:
            while not self._spin() and time.perf_counter() < end and not self._stop.is_set():
                time.sleep(0)  # yields the GIL: the serving loop's calls go on
        except Exception:  # noqa: BLE001 - the round that follows sees (and reports) the same state
            logger.debug("%s: spin check failed", self.name, exc_info=True)

    def note_error(self, what: str | Callable[[], str], exc: BaseException) -> None:
        """Counts an exception the worker caught and logs it (``what``: where, or a callable
        saying it, called only to log): the first `MAX_LOGGED_ERRORS` with their traceback,
        then a count at most every `ERROR_LOG_INTERVAL_S`. Call from an ``except`` block."""
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:1000]
        now = time.monotonic()
        if self.errors > MAX_LOGGED_ERRORS and now < self._next_log:
            self._unlogged += 1
            return
        where = what() if callable(what) else what
        if self.errors <= MAX_LOGGED_ERRORS:
            logger.error("%s: error in %s: %s%s", self.name, where, traceback.format_exc(),
                         " (further errors are counted, and logged once a minute)" * (self.errors == MAX_LOGGED_ERRORS))
            self._next_log = now + ERROR_LOG_INTERVAL_S
        else:
            logger.error("%s: %d more error(s) since (%d in all); the last in %s: %s", self.name, self._unlogged + 1,
                         self.errors, where, self.last_error[:300])
            self._unlogged, self._next_log = 0, now + ERROR_LOG_INTERVAL_S

    def isolate(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Calls ``fn(*args)`` (the handling of one control frame or notification); an exception
        is counted and logged (`note_error`), not raised: the frames read with it and the rest of
        the round (polls, timeouts, pings) still run. True when it returned."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - one bad frame must not cost the others
            self.note_error(lambda: f"{getattr(fn, '__name__', 'a handler')}({', '.join(map(_SHORT.repr, args))})",
                            exc)
            return False

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _loop(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                state = self._round()
            except Exception as exc:  # noqa: BLE001 - a bad round must not kill the connector
                self.note_error("worker round", exc)
                state = IDLE
            if self._stop.is_set():
                break
            if state == ACTIVE:
                backoff, timeout_ms = 0.0, 0
            elif state == SPIN:
                backoff, timeout_ms = 0.0, 0
                self._spin_wait()
            elif state == PENDING:
                backoff = next_backoff(backoff, MIN_BACKOFF_S, MAX_BACKOFF_S)
                if backoff >= 1e-3:
                    timeout_ms = int(backoff * 1000)
                else:  # zmq's poll takes whole milliseconds: sleep the fraction, then peek
                    time.sleep(backoff)
                    timeout_ms = 0
            else:
                backoff, timeout_ms = 0.0, IDLE_POLL_MS
            events = dict(self._poller.poll(timeout_ms))
            if self._rx in events:
                while True:
                    try:
                        self._rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break


# Senders and receivers not closed when the interpreter exits are closed by an atexit hook (weakly
# held: the hook keeps nothing alive). Else their worker and the engine's threads are still inside
# engine calls at finalisation, and one returning then is killed inside C++ code: SIGABRT
# ("terminate called without an active exception") instead of the process's own exit code. This
# module imports `bridge.core` first, so this hook runs before the engines' own (atexit is LIFO).
_LIVE_SIDES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def close_at_exit(side: Any) -> None:
    """Has ``side`` (a `KVSender` / `KVReceiver`) closed at interpreter exit unless closed before."""
    _LIVE_SIDES.add(side)


@atexit.register
def _close_live_sides() -> None:
    for side in list(_LIVE_SIDES):
        if getattr(side, "_closed", True):
            continue
        try:
            side.close()
        except Exception:  # noqa: BLE001 - exiting anyway; one side must not stop the others
            logger.exception("closing %s at interpreter exit failed", type(side).__name__)


def shut_down(side: Any, timeout_s: Any, what: str, close_sockets: Callable[[], None],
              flush: Callable[[], None] = lambda: None) -> None:
    """The part of `KVSender.close` and `KVReceiver.close` both share: marks ``side`` closed,
    stops its worker, FAILS its live requests and sends their ``failed`` frames (``flush``),
    closes its engine (pinging its peers meanwhile: ``side._ping_peers``), then calls
    ``close_sockets`` under its lock (the ``bye``s: they can say whether the engine is torn down,
    `bridge` ``torn_down``), all within ``timeout_s`` seconds
    (+ a small margin) whatever the engine does. ``what`` ("sender" / "receiver") names the side
    in the reason and the log. The caller releases its own memory afterwards.

    Raises:
        TypeError, ValueError: ``timeout_s`` is not a number of seconds in (0, 86400].
    """
    deadline = time.monotonic() + check_seconds("timeout_s", timeout_s)
    side._closed = True
    # The worker gets all but the last second: that one is the engine's.
    if not side._worker.stop(max(0.1, deadline - time.monotonic() - 1.0)):
        logger.warning("%s worker did not stop in time; closing under it", what)
    with side._lock:
        for req in list(side._requests.values()):
            side._end(req, TransferStatus.FAILED, f"{what} closed", notify="failed")
        flush()
    # The engine's close can outlast a peer's silence limit (Mooncake's took about a second): the
    # side keeps pinging meanwhile, so its peers wait for the bye instead of dropping it as silent.
    closer = threading.Thread(target=side.engine.close, kwargs=dict(timeout_s=max(0.1, deadline - time.monotonic())),
                              name=f"dcp-{what}-close", daemon=True)
    try:
        closer.start()
    except RuntimeError:  # interpreter exit: Python >= 3.12 starts no thread in atexit hooks
        side.engine.close(timeout_s=max(0.1, deadline - time.monotonic()))
    while closer.is_alive() and time.monotonic() < deadline + 1.0:
        with side._lock:
            side._ping_peers()
            flush()
        closer.join(min(side.heartbeat_s / 2, max(0.01, deadline + 1.0 - time.monotonic())))
    with side._lock:
        close_sockets()


def check_seconds(name: str, value: Any, *, zero_ok: bool = False) -> float:
    """A positive number of seconds (or 0 with ``zero_ok``), at most a day; Python or numpy
    scalars (ValueError/TypeError naming ``name``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    above_floor = value >= 0 if zero_ok else value > 0  # NaN fails both comparisons
    if not (above_floor and value <= 86400):
        raise ValueError(f"{name}={value!r} must be in {'[' if zero_ok else '('}0, 86400] seconds")
    return float(value)


class _Slot:
    """A connector attribute kept in ``_<name>``, its value passed through `_checked` on every
    assignment (the base: as given)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, self._checked(value))

    def _checked(self, value: Any) -> Any:
        return value


class CheckedSeconds(_Slot):
    """A settable attribute of seconds, checked by `check_seconds` on every assignment (a
    connector's ``timeout_s`` may be changed while it runs; a string or NaN there would only
    fail later, inside its worker's deadline arithmetic)."""

    def _checked(self, value: Any) -> Any:
        return check_seconds(self.name, value)


class SetOnce(_Slot):
    """An attribute set once, at construction, once the constructor checked it: a connector's
    ``spec``, ``mode``, ``direction``, ``group``, ``host``, ``staged`` and ``max_batch_indices``
    are what its handshake and its checks of every page table rest on (a ``spec`` swapped
    afterwards passed the handshake and let a peer write pages outside the request, 2026-12-07).
    Reassigning raises AttributeError naming it (before any check of the new value)."""

    why = "checked then, and the handshake and every request rest on it"

    def __set__(self, obj: Any, value: Any) -> None:
        if hasattr(obj, self.slot):
            raise AttributeError(f"{self.name} is fixed at construction ({self.why}); "
                                 "make a new connector to change it")
        super().__set__(obj, value)


class FixedSeconds(SetOnce, CheckedSeconds):
    """Seconds checked like `CheckedSeconds` and set once, at construction: a connector's
    ``peer_timeout_s`` and ``heartbeat_s`` are sent to its peers at hello and checked against
    theirs (`pings_fit`), so a later change would break what both sides agreed (``0`` dropped
    every peer as silent within a second). Reassigning raises AttributeError."""

    why = "sent to the peers at hello"


def check_tokens(name: str, value: Any) -> int:
    """A token position or count: an int in ``[0, MAX_TOKENS]``, returned as a Python int.

    Raises:
        TypeError: not an int (bools and floats such as ``8.0`` refused; names ``name``).
        ValueError: negative or beyond `MAX_TOKENS` (names ``name``).
    """
    value = check_int_type(name, value)
    if not 0 <= value <= MAX_TOKENS:
        raise ValueError(f"{name}={value!r} must be an int in [0, 2**62] (tokens)")
    return int(value)


#: Default ping interval of a sender and a receiver (seconds).
DEFAULT_HEARTBEAT_S = 0.5


def pings_fit(heartbeat_s: float, peer_timeout_s: float) -> bool:
    """True when pings every ``heartbeat_s`` fit twice into a silence limit of ``peer_timeout_s``
    (seconds): else one late ping drops a healthy connection as silent. The one rule for both a
    side's own pair (`check_liveness`) and each side's pings against the other's limit (hello)."""
    return 2 * heartbeat_s <= peer_timeout_s


def check_liveness(heartbeat_s: float, peer_timeout_s: float) -> None:
    """One side's ping interval must fit twice into its own peer timeout (`pings_fit`).

    Raises:
        ValueError: ``2 * heartbeat_s > peer_timeout_s`` (the message names both).
    """
    if not pings_fit(heartbeat_s, peer_timeout_s):
        raise ValueError(f"heartbeat_s={heartbeat_s:g} must be <= peer_timeout_s / 2 (peer_timeout_s="
                         f"{peer_timeout_s:g}): a connection would be dropped as silent between pings")


def check_page_table(page_table: Any, rows: int, page_size: int, num_pages: int,
                     name: str = "page_table") -> np.ndarray:
    """A page table as i64[pages], checked against the rows it must map and the cache's pages.

    Args:
        page_table: int sequence or array of page ids.
        rows: local rows ``[0, rows)`` it must cover (rows).
        page_size: tokens per page.
        num_pages: pages of the cache (ids must be below it).

    Raises:
        TypeError: not a sequence or array (None, a number, a string), or not integers.
        ValueError: not 1-D, too few pages (says how many are needed),
            page ids beyond int64 (names the entry), negative, repeated or >= num_pages.
    """
    a = as_1d(page_table, name)
    # An id beyond int64 makes numpy pick object or float (a list) or uint64 (which would wrap).
    if a.dtype.kind in "Of" or (a.dtype == np.uint64 and a.size and int(a.max()) > _I64[1]):
        ids = a.tolist() if isinstance(page_table, np.ndarray) else list(page_table)
        for k, v in enumerate(ids):
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and not _I64[0] <= v <= _I64[1]:
                raise ValueError(f"{name}[{k}]={v} does not fit int64 (page ids are int64, below the cache's "
                                 f"{num_pages} pages)")
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integer page ids, got dtype {a.dtype}")
    a = a.astype(np.int64)
    need = -(-rows // page_size)
    if a.size < need:
        raise ValueError(f"{name} has {plural(a.size, 'page')}; {pages_required_text(need)} for "
                         f"{plural(rows, 'local row')} of page_size={page_size}")
    used = a[:need]
    if used.size:
        if int(used.min()) < 0 or int(used.max()) >= num_pages:
            k = int(np.flatnonzero((used < 0) | (used >= num_pages))[0])
            raise ValueError(f"{name}[{k}]={int(used[k])} is outside [0, {num_pages}) (the cache's pages; "
                             f"min {int(used.min())}, max {int(used.max())})")
        ids, counts = np.unique(used, return_counts=True)
        if ids.size != used.size:
            dup = int(ids[counts > 1][0])
            at = np.flatnonzero(used == dup)[:2].tolist()
            raise ValueError(f"{name} repeats page id {dup} (at {name}[{at[0]}] and {name}[{at[1]}])")
    return a
