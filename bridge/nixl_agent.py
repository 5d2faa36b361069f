"""The NIXL agent under `bridge.nixl.NixlEngine`: the installed wheel, agent creation, descriptor lists.

Which NIXL package imports (the CUDA 12 wheel ``nixl_cu12``, the CUDA 13 build ``nixl_cu13``, or
plain ``nixl``) and its binding error types (`NIXL_ERRORS`); `create_agent`, which builds an agent
whose progress thread pauses between polls; `xfer_desc_lists`, which turns a validated descriptor
batch into NIXL's local and remote descriptor lists; and `Posted`, the record of one posted
transfer that the engine's poller follows to DONE or ERR and then releases (`release`).
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np

__all__ = ["nixl_agent", "nixl_agent_config", "nixl_thread_sync_t", "NIXL_ERRORS", "nixl_available",
           "engine_msg", "PROGRESS_THREAD_DELAY_US", "UCX_AGENT_ENV", "agent_config", "create_agent", "xfer_desc_lists",
           "Posted", "release"]

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

#: Every NIXL binding error (they derive from Exception directly; there is no common base).
NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(_nixl_bindings, n) for n in dir(_nixl_bindings or object)
    if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_nixl_bindings, n), type)
) if _nixl_bindings is not None else ()


def nixl_available() -> bool:
    """True when a NIXL Python package imports in this environment."""
    return nixl_agent is not None


def engine_msg(exc: BaseException) -> str:
    """``"TypeName: message"`` of an engine exception, kept as `TransferError.engine_message`."""
    return f"{type(exc).__name__}: {exc}".strip()


# NIXL's Python wrapper hard-codes `pthrDelay = 0`, so every agent's progress thread spins a whole core
# even when idle (measured: 0.95 core per agent; the main job runs N + 1 agents on 2 cores). The wrapper
# offers no knob, so the delay is set on the binding's config while our agent is constructed.
PROGRESS_THREAD_DELAY_US = 1000
_AGENT_CTOR_LOCK = threading.Lock()

#: UCX settings every agent is created with, unless the environment already names them (UCX reads
#: them when the agent's UCX context is made). ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on``: UCX's default
#: ("auto", UCX PR 7566) turns cuda_ipc READs off on a GPU without active NVLink peers, so a READ
#: of another process's VRAM on the same GPU falls back to a host-staged path: the 32k region job
#: pulled 2.30 GB at ~0.5 GB/s and ranks went silent for 30 s on an H100 (2026-12-07), where
#: WRITEs take cuda_ipc. NIXL's own UCX plugin turns it on from its PR 2208 (2026-09).
UCX_AGENT_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def agent_config(backends, shared_lock: bool):
    """A ``nixl_agent_config`` creating ``backends``; ``shared_lock`` selects ``NIXL_THREAD_SYNC_RW``
    (several threads call into the agent: postings and status checks share NIXL's lock)."""
    conf = nixl_agent_config(backends=list(backends))
    if shared_lock:
        conf.sync_mode = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    return conf


def create_agent(name: str, conf, progress_delay_us: int):
    """A ``nixl_agent`` whose progress thread pauses ``progress_delay_us`` microseconds between
    polls, its UCX context made with `UCX_AGENT_ENV` (set in ``os.environ`` where unset). Raises
    whatever NIXL raises when it cannot create the agent."""
    bind = sys.modules[nixl_agent.__module__].nixlBind
    real_ctor = bind.nixlAgent

    def ctor(agent_name, agent_config):
        agent_config.pthrDelay = int(progress_delay_us)
        return real_ctor(agent_name, agent_config)

    for k, v in UCX_AGENT_ENV.items():
        os.environ.setdefault(k, v)
    with _AGENT_CTOR_LOCK:  # the patch is process-wide while it lasts
        bind.nixlAgent = ctor
        try:
            return nixl_agent(name, conf)
        finally:
            bind.nixlAgent = real_ctor


def xfer_desc_lists(agent, descs: np.ndarray, local_mem, remote_mem):
    """NIXL's (local, remote) descriptor lists for a batch, either None where NIXL refused.

    Args:
        agent: the ``nixl_agent``.
        descs: i64[n, 3] of (local_addr, remote_addr, nbytes), validated by `bridge.regions`.
        local_mem, remote_mem: (mem_type "DRAM"/"VRAM", i64[n] device ids) of each side's regions.
    """
    (lkind, ldev), (rkind, rdev) = local_mem, remote_mem
    if descs.shape[0] == 1:  # a region write: NIXL's tuple form skips two numpy stacks
        la, ra, n = descs[0].tolist()
        return (agent.get_xfer_descs([(la, n, int(ldev[0]))], lkind),
                agent.get_xfer_descs([(ra, n, int(rdev[0]))], rkind))
    local = np.stack([descs[:, 0], descs[:, 2], ldev], axis=1)
    remote = np.stack([descs[:, 1], descs[:, 2], rdev], axis=1)
    return agent.get_xfer_descs(local, lkind), agent.get_xfer_descs(remote, rkind)


class Posted:
    """A posted transfer: its NIXL handle until DONE / ERR, then the final state (released)."""

    __slots__ = ("xfer", "state", "message", "final")

    def __init__(self, xfer):
        self.xfer = xfer
        self.state = "PROC"
        self.message = ""
        self.final = threading.Event()

    def finish(self, state: str, message: str = "") -> None:
        """Releases the NIXL handle, records the final state, and wakes `final` waiters."""
        if self.xfer is not None:
            release(self.xfer)
            self.xfer = None
        self.state, self.message = state, message
        self.final.set()


def release(xfer) -> None:
    """Releases a NIXL transfer handle, ignoring NIXL's refusal."""
    # Releasing an active transfer asks NIXL to cancel it; if it cannot, NIXL keeps the handle,
    # and the caller has already been told the batch failed.
    try:
        xfer.release()
    except Exception:  # noqa: BLE001
        pass
