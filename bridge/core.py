"""State, engine hooks, notifications and teardown shared by every `TransferEngine` (see `bridge.base`).

`EngineCore` holds what an engine keeps (registrations, peers, outstanding handles, counters,
received notifications), declares the ``_engine_*`` hooks an adapter implements, closes the
engine (`close`, on a daemon thread; an atexit hook closes engines left open), and keeps the
process-wide count of registered bytes (`registered_bytes`). The public batch API is in
`bridge.base.TransferEngine`.
"""
from __future__ import annotations

import abc
import atexit
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge.errors import BridgeError, TransferTimeout
from bridge.handles import EngineCounters, TransferHandle, check_notif, check_timeout
from bridge.regions import MemoryRegion, PeerInfo, RegionTable

__all__ = ["EngineCore", "registered_bytes"]

_log = logging.getLogger("bridge")

_REG_LOCK = threading.Lock()
_REG_BYTES = 0


def registered_bytes() -> int:
    """Bytes currently registered by all live engines of this process (`register` adds,
    `deregister` and `close` subtract)."""
    return _REG_BYTES


def _account(delta: int) -> None:
    global _REG_BYTES
    with _REG_LOCK:
        _REG_BYTES += delta


# Engines still open when the interpreter exits are closed by an atexit hook: otherwise their worker
# threads and the engines' C++ state are torn down during interpreter finalization, after the Python
# objects they call back into are gone.
_LIVE_ENGINES: "weakref.WeakSet[TransferEngine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for eng in list(_LIVE_ENGINES):
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - exiting anyway; one engine must not stop the others
            pass


class EngineCore(abc.ABC):
    """Engine state, the adapter hooks, notifications and `close`; subclassed by `TransferEngine`."""

    #: engine kind written into `PeerInfo.engine`
    kind: str = ""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{name=} must be a non-empty string")
        self.name = name
        self._lock = threading.RLock()  # bookkeeping only: never held across an engine call that may wait
        self._reg_lock = threading.RLock()  # serialises register / deregister / add_peer
        self._regions: list[MemoryRegion] = []
        self._local_table = RegionTable(())
        self._peers: dict[str, tuple[PeerInfo, RegionTable]] = {}
        self._counters = EngineCounters()
        self._outstanding: dict[int, TransferHandle] = {}  # by seq: submitted, not yet released
        self._seq = itertools.count(1)
        self._notifs: dict[str, list[bytes]] = {}
        self._closed = False
        self._closer: threading.Thread | None = None
        _LIVE_ENGINES.add(self)

    # ---- engine hooks (see the adapters for what each engine does) --------------------------
    @abc.abstractmethod
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abc.abstractmethod
    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abc.abstractmethod
    def _engine_peer_info(self) -> PeerInfo: ...

    @abc.abstractmethod
    def _engine_add_peer(self, info: PeerInfo, refresh: bool) -> None: ...

    @abc.abstractmethod
    def _engine_remove_peer(self, info: PeerInfo) -> None:
        """Forgets the peer; outstanding handles to it must then finish (True or TransferError)."""

    @abc.abstractmethod
    def _engine_submit(self, handle: TransferHandle, descs: np.ndarray, local_mem: tuple[str, np.ndarray],
                       remote_mem: tuple[str, np.ndarray], info: PeerInfo) -> None:
        """Starts the batch in the background (``handle.op``, ``handle.notif``)."""

    @abc.abstractmethod
    def _engine_check(self, handle: TransferHandle) -> bool:
        """Non-blocking. True or TransferError once the engine is done with the batch's memory;
        then the adapter has already forgotten the handle."""

    @abc.abstractmethod
    def _engine_block(self, handle: TransferHandle, max_s: float) -> None:
        """Sleeps at most max_s, returning early if the batch may have progressed."""

    @abc.abstractmethod
    def _engine_cancel(self, handle: TransferHandle) -> None:
        """Asks the engine to stop the batch; `_engine_check` must still report its end."""

    @abc.abstractmethod
    def _engine_abort(self, handle: TransferHandle) -> None:
        """`wait` gave up: stop and forget the batch, freeing its engine state when it ends."""

    @abc.abstractmethod
    def _engine_poll_notifs(self) -> dict[str, list[bytes]]: ...

    @abc.abstractmethod
    def _engine_close(self, regions: tuple[MemoryRegion, ...], peers: tuple[PeerInfo, ...]) -> None:
        """Runs on a daemon thread: stops workers, waits until none is inside the engine, then
        releases transfers, peers, registrations and the engine. Never destroys the engine while
        a worker may still be inside it."""

    def _engine_quiesce(self, timeout_s: float) -> bool:
        """`close` at interpreter exit, where no thread can start (so `_engine_close` runs in the
        caller): stops the adapter's threads and waits at most timeout_s seconds until none may
        still enter the engine. True when so (`_engine_close` then waits for nothing unbounded);
        False leaves the engine alone. Adapters whose `_engine_close` waits are bounded keep this."""
        return True

    # ---- properties -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BridgeError(f"engine {self.name!r} is closed")

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """Regions currently registered by this engine."""
        return tuple(self._regions)

    @property
    def peers(self) -> tuple[str, ...]:
        """Names of the peers this engine can reach."""
        return tuple(self._peers)

    @property
    def counters(self) -> EngineCounters:
        """A snapshot of the submission counters."""
        with self._lock:
            return dataclasses.replace(self._counters)

    @property
    def outstanding(self) -> int:
        """Handles submitted and not yet released (by `check`, `wait` or `close`)."""
        return len(self._outstanding)

    def reset_counters(self) -> None:
        """Sets every counter back to zero."""
        with self._lock:
            self._counters = EngineCounters()

    def _count_engine_call(self, n: int = 1) -> None:
        with self._lock:
            self._counters.engine_calls += n

    def _own(self, handle: Any) -> TransferHandle:
        if not isinstance(handle, TransferHandle):
            raise TypeError(f"handle must be a TransferHandle, got {type(handle).__name__}")
        self._check_open()
        if handle.released or self._outstanding.get(handle.seq) is not handle:
            raise BridgeError(f"handle {handle!r} was already waited or checked to completion, or is "
                              f"not from engine {self.name!r}")
        return handle

    def _release(self, handle: TransferHandle) -> None:
        handle.released = True
        with self._lock:
            self._outstanding.pop(handle.seq, None)


    # ---- notifications --------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """Returns and forgets every notification received so far, by sender name."""
        self._check_open()
        with self._lock:
            self._merge_notifs(self._engine_poll_notifs())
            out, self._notifs = self._notifs, {}
        return out

    def _merge_notifs(self, new: dict[str, list[bytes]]) -> None:
        for sender, msgs in new.items():
            self._notifs.setdefault(sender, []).extend(msgs)

    def wait_notification(self, peer_name: str, tag: bytes, timeout_s: float = 30.0) -> bytes:
        """Waits for a notification from `peer_name` equal to `tag`.

        The other side attaches `tag` as ``notif=`` to `transfer_batch` (WRITE to us, or READ from
        us); it is delivered only after that whole batch is done. The matching message is
        consumed; others stay queued for later calls.

        Args:
            peer_name: the sending engine's name.
            tag: the exact notification bytes.
            timeout_s: deadline in seconds (> 0).

        Returns:
            The notification bytes (equal to tag).

        Raises:
            TransferTimeout: nothing matching arrived in time.
        """
        self._check_open()
        timeout_s = check_timeout(timeout_s)
        tag = check_notif(tag)
        if tag is None:
            raise TypeError("tag must be non-empty bytes")
        deadline = time.monotonic() + timeout_s
        sleep = 1e-4
        while True:
            with self._lock:
                self._merge_notifs(self._engine_poll_notifs())
                msgs = self._notifs.get(peer_name, [])
                if tag in msgs:
                    msgs.remove(tag)
                    return tag
            if time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"no notification {tag!r} from {peer_name!r} within {timeout_s} s",
                    peer=peer_name, num_descriptors=0)
            time.sleep(sleep)
            sleep = min(sleep * 2, 5e-3)

    # ---- teardown -------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Releases handles, peers, registrations and the engine, within timeout_s. Idempotent.

        At once, in the caller: the engine refuses further calls, every outstanding handle is
        released (`check` on it raises BridgeError, `cancel` does nothing), and its peers and
        registrations are forgotten (`registered_bytes` drops by this engine's bytes). Then a
        daemon thread stops the engine: queued batches are dropped, running ones cancelled (as
        `cancel`), and once no worker thread is inside the engine any more, transfers, peers,
        registrations and the engine itself are released. `close` waits for that thread at
        most timeout_s seconds (plus thread start-up, about a millisecond) whatever the engine
        does, e.g. a NIXL posting of 300k descriptors that cannot be interrupted, or a Mooncake
        window blocked on a dead peer.

        If it returns before the teardown finished, the worker and teardown threads are left to
        finish as daemons: they keep the engine object alive (it is never destroyed while one may
        still be inside it), and until they end the engine may still read or write the memory of
        the unfinished batches and keep it registered. A warning is logged ("bridge" logger).

        Args:
            timeout_s: seconds to wait for the teardown (>= 0).
        """
        timeout_s = check_timeout(timeout_s, allow_zero=True)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = tuple(self._regions)
            peers = tuple(info for info, _ in self._peers.values())
            handles = list(self._outstanding.values())
            self._outstanding.clear()
            self._peers.clear()
            self._regions.clear()
            self._local_table = RegionTable(())
        for h in handles:
            h.released = True
        _account(-sum(r.nbytes for r in regions))
        _LIVE_ENGINES.discard(self)
        self._closer = threading.Thread(target=self._teardown, args=(regions, peers),
                                        name=f"bridge-close-{self.name}", daemon=True)
        try:
            self._closer.start()
        except RuntimeError:  # interpreter exit: Python >= 3.12 starts no thread in atexit hooks
            self._closer = None
            self._close_at_exit(regions, peers, timeout_s)
            return
        self._closer.join(timeout_s)
        if self._closer.is_alive():
            _log.warning("engine %r: teardown still running after %.3g s; left to finish in the "
                         "background (the engine may still use the memory of unfinished batches)",
                         self.name, timeout_s)

    @property
    def torn_down(self) -> bool:
        """True once `close` finished the teardown within its wait: the engine reads and writes
        no memory any more. False while open, and while a teardown left to a daemon still runs."""
        return self._closed and (self._closer is None or not self._closer.is_alive())

    def _close_at_exit(self, regions: tuple[MemoryRegion, ...], peers: tuple[PeerInfo, ...],
                       timeout_s: float) -> None:
        # No teardown thread can start, so the caller waits (at most timeout_s) until no worker
        # thread is inside the engine: one returning from an engine call after finalisation began
        # is killed by the interpreter inside C++ code, which aborts the process (SIGABRT).
        if self._engine_quiesce(timeout_s):
            self._teardown(regions, peers)  # nothing left to wait for: fast
        else:
            _log.warning("engine %r: a worker thread is still inside the engine %.3g s after close at "
                         "interpreter exit; the engine is left as it is", self.name, timeout_s)

    def _teardown(self, regions: tuple[MemoryRegion, ...], peers: tuple[PeerInfo, ...]) -> None:
        try:
            self._engine_close(regions, peers)
        except Exception:  # noqa: BLE001 - a daemon thread: report, never raise into nothing
            _log.exception("engine %r: teardown failed", self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
