"""The job's processes, the orchestrator's side: spawning them (`start_processes`), talking to
each over its pipe (`Proc`) and stopping them (`stop_all`). What runs inside each, a prefill rank
holding a `KVSender` or a decode rank holding a `KVReceiver`, is :mod:`dcp_jax.job.workers`.

Each process is started once (forked from a fork server that imported the connector, and JAX
under it, once) and keeps its KV buffers for the whole job; the connector objects are opened per
mode (``KVSender(mode=...)``) and closed after it. The orchestrator
(:mod:`dcp_jax.job.run`) drives them over one control pipe each, with ``(kind, arg)`` messages:

- prefill: ``open {mode}`` -> ``opened {address, engine, checks}``; ``send {rid, chunks}`` ->
  ``sent {status, reason, seconds, ranks}`` (after the sender reported a terminal status);
  ``release rid``; ``close`` -> ``closed``; ``abort reason`` while sending; ``shutdown``.
- decode: ``open {dcp_rank, dcp_size, addresses}`` -> ``opened``; ``request {rid, num_tokens, ...}``
  -> ``ready`` (after the sentinel fill and ``expect``), ``progress bytes``..., then ``result``
  (after the receiver reported a terminal status and the rank verified its pool); ``release``,
  ``close``, ``abort``, ``shutdown`` as above.

Completion of the KV itself is the connector's word only (``poll``); the pipes carry set-up,
hooks and results. The CRC-32s of ``--verify`` come from the prefill side's own rows.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from dcp_jax.job import gpus, kv
from dcp_jax.job.config import JobConfig
from dcp_jax.job.workers import decode_main, prefill_main

__all__ = ["Proc", "start_processes", "stop_all"]


class Proc:
    """A spawned job process and the orchestrator's end of its control pipe."""

    def __init__(self, who: str, process, conn: Connection, gpu: int | None = None, env: dict | None = None):
        self.who, self.process, self.conn = who, process, conn
        self.gpu, self.env = gpu, env or {}  # placement (dcp_jax.job.gpus): ordinal, the child's CUDA env
        self.device_info: dict = {}  # what the child found (its GPU's PCI bus id), from its hello

    def placement(self) -> dict:
        """Where this process runs: ``{"process", "gpu", "cuda_visible_devices", "pci_bus_id"}``."""
        return {"process": self.who, "gpu": self.gpu, "cuda_visible_devices": self.env.get("CUDA_VISIBLE_DEVICES"),
                "pci_bus_id": self.device_info.get("pci_bus_id")}

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_code(self) -> Any:
        if self.process.exitcode is None:
            self.process.join(1.0)
        return self.process.exitcode

    def send(self, kind: str, arg: Any = None) -> None:
        """Sends one message; a dead process or a closed pipe is RuntimeError naming it."""
        if not self.alive:
            raise RuntimeError(f"{self.who} exited (code {self.exit_code()})")
        try:
            self.conn.send((kind, arg))
        except (OSError, EOFError, ValueError) as exc:
            raise RuntimeError(f"{self.who} exited (code {self.exit_code()}): {type(exc).__name__}") from None

    def recv(self, timeout_s: float, expect: str) -> Any:
        """Receives one message of kind ``expect`` (RuntimeError otherwise, naming the process)."""
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"{self.who}: no {expect!r} within {timeout_s:g} s")
        try:
            kind, arg = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"{self.who} exited (code {self.exit_code()})") from None
        if kind != expect:
            raise RuntimeError(f"{self.who}: expected {expect!r}, got {kind!r}:\n{arg}")
        return arg


def start_processes(cfg: JobConfig, *, tag: str, min_dcp_size: int | None = None,
                    start_timeout_s: float = 180.0,
                    extra_env: dict[str, str] | None = None) -> tuple[list[Proc], list[Proc], list[dict]]:
    """Spawns ``prefill_dcp_size`` prefill and ``dcp_size`` decode processes, waits for their hello.

    The prefill side starts first: filling its multi-GB KV is the longest part of start-up and
    should not compete with the decode processes' start. With ``cfg.prefill_gpus`` /
    ``cfg.decode_gpus`` each process is placed on its GPU (:mod:`dcp_jax.job.gpus`; a side left
    unplaced goes to GPU 0) and ``Proc.gpu`` / ``Proc.device_info`` say where it runs.
    ``extra_env``: set in every child before CUDA starts (the job's MPS daemon, `dcp_jax.job.mps`).

    Returns:
        ``(prefills, decodes, prefill_setup)`` (``prefill_setup``: each prefill's set-up seconds).

    Raises:
        RuntimeError: a process failed to start (its traceback is in the message); every
            process started is killed first.
    """
    ctx = _context()
    procs: list[Proc] = []
    send_pool, pool_pages = kv.decode_pools(cfg, min_dcp_size)
    placed = cfg.prefill_gpus is not None or cfg.decode_gpus is not None
    count = gpus.gpu_count() if placed else 0
    # Placement of one side only: the other side stays on (visible) GPU 0.
    pre_gpus = gpus.place(cfg.prefill_dcp_size, cfg.prefill_gpus or ((0,) if placed else None))
    dec_gpus = gpus.place(cfg.dcp_size, cfg.decode_gpus or ((0,) if placed else None))

    def spawn(target, who, gpu, *args) -> Proc:
        a, b = ctx.Pipe()
        env = {**gpus.child_env(gpu, count), **(extra_env or {})}
        pr = ctx.Process(target=target, name=f"dcp-{who.replace(' ', '-')}", args=(cfg.to_dict(), *args, b),
                         kwargs=dict(gpu_env=env), daemon=True)
        pr.start()
        b.close()
        procs.append(Proc(who, pr, a, gpu, env))
        return procs[-1]

    try:
        prefills = [spawn(prefill_main, f"prefill {k}", pre_gpus[k], k) for k in range(cfg.prefill_dcp_size)]
        setup = [p.recv(max(cfg.timeout_s, start_timeout_s), "hello") for p in prefills]
        for p, hello in zip(prefills, setup):
            p.device_info = hello.pop("device", {})
        decodes = [spawn(decode_main, f"decode process {r}", dec_gpus[r], r, (send_pool, pool_pages), tag)
                   for r in range(cfg.dcp_size)]
        for d in decodes:
            d.device_info = d.recv(max(cfg.timeout_s, start_timeout_s), "hello").get("device", {})
    except BaseException:
        for p in procs:
            p.process.kill()
        raise
    return prefills, decodes, setup


#: What the fork server imports once, so each child starts without importing the connector (and
#: JAX under it) again: seconds per process on a small machine, paid once per job (once per test
#: session under pytest) instead.
PRELOAD = ["dcp_jax.job.processes", "dcp_jax.transfer", "pallas_kernels", "bridge.nixl"]


def _context():
    """Children come from a fork server that preloaded :data:`PRELOAD` (no CUDA, no engine, no
    thread in it: forking it is safe); where there is none (not POSIX), from spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def stop_all(procs: list[Proc], timeout_s: float = 10.0) -> None:
    """Asks every process to shut down, waits for all under one deadline, kills the rest."""
    for p in procs:
        try:
            p.conn.send(("shutdown", None))
        except Exception:  # noqa: BLE001 - already gone
            pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.process.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.process.is_alive():
            p.process.kill()
            p.process.join(5)

