"""NIXL adapter (UCX backend): one agent per process, out-of-band metadata, one WRITE per batch.

Call sequence per batch: ``get_xfer_descs`` for both sides, ``initialize_xfer("WRITE", ...)``
with the notification, ``transfer``, then `wait` polls ``check_xfer_state`` with a deadline and
backoff and releases the handle. ``transfer`` itself posts every descriptor before it returns
(measured: 400k small descriptors keep it busy ~4 s over CMA, while the GIL is released), so by
default the posting runs on one background thread per engine and `transfer_batch` returns at
once: packing the next chunk overlaps the transfer of this one. The agent is then created with
``NIXL_THREAD_SYNC_STRICT`` (NIXL's default without a listener thread is unsynchronised).
Engine-side refusals (unknown registrations, a disconnected peer) therefore surface in `wait`.
NIXL's typed exceptions (``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...) and its
"ERR" status become `TransferError` here.

Stale metadata: NIXL keeps a peer's old registrations after the peer deregisters, and a WRITE
into them still succeeds. `add_peer` with a refreshed `PeerInfo` therefore drops and reloads the
peer's metadata, and `transfer_batch` validates against the regions of the latest `PeerInfo`.
"""
from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from bridge.base import (
    BridgeError,
    MemoryRegion,
    PeerError,
    PeerInfo,
    RegistrationError,
    TransferEngine,
    TransferError,
    TransferHandle,
    TransferTimeout,
)

__all__ = ["NixlEngine", "nixl_available"]

try:  # the CUDA 12 wheel installs nixl_cu12; the meta package maps `nixl` onto a CUDA build
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    from nixl_cu12 import _bindings as _nixl_bindings
except ImportError:  # pragma: no cover - depends on which wheel is installed
    try:  # the GPU machine's CUDA 13 build
        from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        from nixl_cu13 import _bindings as _nixl_bindings
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
            from nixl import _bindings as _nixl_bindings
        except ImportError:
            nixl_agent = nixl_agent_config = nixl_thread_sync_t = _nixl_bindings = None

# Every NIXL binding error (they derive from Exception directly; there is no common base).
_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(_nixl_bindings, n) for n in dir(_nixl_bindings or object)
    if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_nixl_bindings, n), type)
) if _nixl_bindings is not None else ()

# Poll backoff for check_xfer_state: start fine-grained (small batches finish in ~100 us), cap low
# so a finished transfer is noticed within a few ms.
_POLL_FIRST_S = 2e-5
_POLL_MAX_S = 2e-3


def nixl_available() -> bool:
    """True when a NIXL Python package imports in this environment."""
    return nixl_agent is not None


def _engine_msg(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


# NIXL's Python wrapper hard-codes `pthrDelay = 0`, so every agent's progress thread spins a whole core
# even when idle (measured: 0.95 core per agent; the main job runs N + 1 agents on 2 cores). The wrapper
# offers no knob, so the delay is set on the binding's config while our agent is constructed.
PROGRESS_THREAD_DELAY_US = 1000
_AGENT_CTOR_LOCK = threading.Lock()


def _create_agent(name: str, conf, progress_delay_us: int):
    bind = sys.modules[nixl_agent.__module__].nixlBind
    real_ctor = bind.nixlAgent

    def ctor(agent_name, agent_config):
        agent_config.pthrDelay = int(progress_delay_us)
        return real_ctor(agent_name, agent_config)

    with _AGENT_CTOR_LOCK:  # the patch is process-wide while it lasts
        bind.nixlAgent = ctor
        try:
            return nixl_agent(name, conf)
        finally:
            bind.nixlAgent = real_ctor


class NixlEngine(TransferEngine):
    """`TransferEngine` over a NIXL agent with the UCX backend (host or device memory).

    Args:
        name: agent name; unique among the agents that talk to each other.
        backends: NIXL backends to create (default UCX, the one that moves agent-to-agent bytes).
        async_submit: post batches on a background thread (True) or inside `transfer_batch`.
        progress_delay_us: pause of NIXL's progress thread between polls, microseconds (0 = spin).

    Raises:
        BridgeError: NIXL is not installed or the agent could not be created.
    """

    kind = "nixl"

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), async_submit: bool = True,
                 progress_delay_us: int = PROGRESS_THREAD_DELAY_US):
        super().__init__(name)
        if nixl_agent is None:
            raise BridgeError("NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")
        if progress_delay_us < 0:
            raise ValueError(f"{progress_delay_us=} must be >= 0")
        conf = nixl_agent_config(backends=list(backends))
        if async_submit:  # two threads call into the agent: ask NIXL to lock
            conf.sync_mode = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        try:
            self._agent = _create_agent(name, conf, progress_delay_us)
        except Exception as exc:
            raise BridgeError(f"cannot create NIXL agent {name=}: {_engine_msg(exc)}") from exc
        self._reg_dlists: dict[MemoryRegion, object] = {}
        self._live: dict[int, _Post] = {}  # id(TransferHandle) -> its posting
        self._submitter = (cf.ThreadPoolExecutor(1, thread_name_prefix=f"nixl-{name}")
                           if async_submit else None)

    # ---- registration ---------------------------------------------------------------------
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None:
        done: list[MemoryRegion] = []
        try:
            for r in regions:  # one registration per region so each can be deregistered alone
                dl = self._agent.register_memory([(r.addr, r.nbytes, r.device_id, "")], r.mem_type)
                if dl is None:
                    raise RegistrationError(f"regions: NIXL refused {r}")
                self._reg_dlists[r] = dl
                done.append(r)
        except RegistrationError:
            self._engine_deregister(done)
            raise
        except Exception as exc:
            self._engine_deregister(done)
            raise RegistrationError(f"regions: NIXL could not register {r}: {_engine_msg(exc)}") from exc

    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            dl = self._reg_dlists.pop(r, None)
            if dl is None:
                continue
            try:
                self._agent.deregister_memory(dl)
            except Exception as exc:
                raise RegistrationError(f"regions: NIXL could not deregister {r}: {_engine_msg(exc)}") from exc

    # ---- peers ----------------------------------------------------------------------------
    def _engine_peer_info(self) -> PeerInfo:
        # Metadata lists the registrations made so far: register before publishing it.
        return PeerInfo(engine=self.kind, name=self.name, session="",
                        metadata=bytes(self._agent.get_agent_metadata()), regions=tuple(self._regions))

    def _engine_add_peer(self, info: PeerInfo, refresh: bool) -> None:
        if not info.metadata:
            raise PeerError(f"info: peer {info.name!r} carries no NIXL agent metadata")
        if refresh:
            # Drop what NIXL cached for this peer first, so regions the peer deregistered do not
            # stay writable through stale metadata.
            try:
                self._agent.remove_remote_agent(info.name)
            except Exception:  # noqa: BLE001 - not loaded (an earlier add failed): nothing to drop
                pass
        try:
            loaded = self._agent.add_remote_agent(info.metadata)
        except Exception as exc:
            raise PeerError(f"info: NIXL refused metadata of peer {info.name!r}: {_engine_msg(exc)}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != info.name:
            self._agent.remove_remote_agent(loaded)
            raise PeerError(f"info: metadata is for agent {loaded!r} but PeerInfo.name={info.name!r}")

    def _engine_remove_peer(self, info: PeerInfo) -> None:
        try:
            self._agent.remove_remote_agent(info.name)
        except Exception as exc:
            raise PeerError(f"name: NIXL could not remove peer {info.name!r}: {_engine_msg(exc)}") from exc

    # ---- transfers ------------------------------------------------------------------------
    def _engine_submit(self, handle, descs, local_mem, remote_mem, info) -> None:
        post = _Post()
        args = (handle, descs, local_mem, remote_mem, info.name)
        if self._submitter is None:
            post.future = cf.Future()
            post.future.set_result(self._post(*args))  # errors propagate from transfer_batch
        else:
            post.future = self._submitter.submit(self._post, *args)
        self._live[handle.seq] = post

    def _post(self, handle, descs, local_mem, remote_mem, peer: str):
        """Builds and posts one WRITE; returns (xfer handle or None for an empty batch, state)."""
        if descs.shape[0] == 0:
            if handle.notif is not None:
                try:
                    self._agent.send_notif(peer, handle.notif)
                except Exception as exc:
                    raise handle.error(TransferError, "NIXL could not send the notification",
                                       _engine_msg(exc)) from exc
            return None, "DONE"
        (lkind, ldev), (rkind, rdev) = local_mem, remote_mem
        local = np.stack([descs[:, 0], descs[:, 2], ldev], axis=1)
        remote = np.stack([descs[:, 1], descs[:, 2], rdev], axis=1)
        xfer = None
        try:
            ld = self._agent.get_xfer_descs(local, lkind)
            rd = self._agent.get_xfer_descs(remote, rkind)
            if ld is None or rd is None:
                raise handle.error(TransferError, "NIXL could not build descriptor lists")
            xfer = self._agent.initialize_xfer("WRITE", ld, rd, peer, handle.notif or b"")
            self._count_engine_call()
            state = self._agent.transfer(xfer)
        except TransferError:
            raise
        except _NIXL_ERRORS + (KeyError,) as exc:
            if xfer is not None:
                _release(xfer)
            raise handle.error(TransferError, "NIXL refused the WRITE", _engine_msg(exc)) from exc
        if state == "ERR":
            _release(xfer)
            raise handle.error(TransferError, "NIXL failed to post the WRITE", "transfer() returned ERR")
        return xfer, state

    def _engine_wait(self, handle: TransferHandle, deadline: float) -> None:
        post = self._live[handle.seq]
        try:
            xfer, state = post.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            raise handle.error(TransferTimeout, "NIXL WRITE still being posted at the deadline") from None
        except cf.CancelledError:
            raise handle.error(TransferError, "NIXL WRITE cancelled (engine closing)") from None
        sleep = _POLL_FIRST_S
        while state != "DONE":
            if state == "ERR":
                raise handle.error(TransferError, "NIXL reported a failed WRITE", "check_xfer_state: ERR")
            if time.monotonic() >= deadline:
                raise handle.error(TransferTimeout, "NIXL WRITE not complete by the deadline",
                                   f"last state {state}")
            time.sleep(sleep)
            sleep = min(sleep * 2, _POLL_MAX_S)
            try:
                state = self._agent.check_xfer_state(xfer)
            except _NIXL_ERRORS as exc:
                raise handle.error(TransferError, "NIXL reported a failed WRITE", _engine_msg(exc)) from exc
        self._live.pop(handle.seq, None)
        if xfer is not None:
            _release(xfer)

    def _engine_abort(self, handle: TransferHandle) -> None:
        post = self._live.pop(handle.seq, None)
        if post is not None:
            post.abandon()

    def _engine_poll_notifs(self) -> dict[str, list[bytes]]:
        new = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): [bytes(m) for m in v] for k, v in new.items()}

    def _engine_close(self) -> None:
        if self._submitter is not None:
            # No thread may still be inside the agent when it is destroyed.
            self._submitter.shutdown(wait=True, cancel_futures=True)
        for post in list(self._live.values()):
            post.abandon()
        self._live.clear()
        for name in list(self._peers):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - closing: best effort
                pass
        for r in list(self._reg_dlists):
            try:
                self._engine_deregister([r])
            except RegistrationError:
                pass
        self._agent = None


def _release(xfer) -> None:
    # Releasing an active transfer asks NIXL to cancel it; if it cannot, NIXL keeps the handle,
    # and the caller has already been told the batch failed.
    try:
        xfer.release()
    except Exception:  # noqa: BLE001
        pass


class _Post:
    """A batch's posting (a future of (xfer, state)) and its release once nobody waits for it."""

    __slots__ = ("future",)

    def __init__(self):
        self.future: cf.Future | None = None

    def abandon(self) -> None:
        """Releases the NIXL handle now, or when the posting finishes if it is still running."""

        def _done(f: cf.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                xfer, _ = f.result()
                if xfer is not None:
                    _release(xfer)

        if not self.future.cancel():
            self.future.add_done_callback(_done)
