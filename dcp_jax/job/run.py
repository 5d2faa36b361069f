"""The main job's orchestrator: processes, one request per mode through the connector, the report.

``dcp-jax transfer`` (``dcp_jax.cli``) calls :func:`run_job`. It spawns ``prefill_dcp_size``
prefill processes and ``dcp_size`` decode processes (:mod:`dcp_jax.job.processes`); per mode:

1. every prefill rank opens a ``KVSender(mode=mode)`` over its KV; every decode rank opens a
   ``KVReceiver`` over its pool and connects to all M senders (versioned handshake);
2. warm-up, untimed: one request of the first chunk (packed) or of one page per rank (direct)
   through the same connectors, so the timed request does not pay first-use costs alone
   (engine connections, page faults of the pack buffer, kernel compiles);
3. the request (``cfg.requests`` times, one after another; the run reports the median one and
   lists every one under ``repeats``): each decode rank fills its pool with the sentinel, ``expect``s the request with its
   page table, the prefill ranks ``send`` it chunk by chunk, and both sides ``poll`` until
   terminal; then every decode rank verifies every byte it owns and every other row's sentinel;
4. the connectors are released and closed.

Counts per (prefill rank, decode rank) come from ``KVSender.request_stats``; seconds are the
prefill's, from its first ``send`` to the sender's SUCCESS (plan and pack seconds as the sender
measured them). A process that dies fails the mode with a message: the others are told to abort
the request, which the connector ends at once, and the next mode is not started. A run's report
(counts, seconds, strategies, the median of repeats) is built in :mod:`dcp_jax.job.report`.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import wait as conn_wait

from dcp_jax.job import gpus, kv
from dcp_jax.job.config import JobConfig, check_device
from dcp_jax.job.mps import MpsDaemon
from dcp_jax.job.processes import Proc, start_processes, stop_all
from dcp_jax.job.report import (  # noqa: F401 - the last three kept importable here
    _failed_run, _median_run, _report, _finite_or_inf, _strategy, _timeline_summary)

__all__ = ["run_job", "run_mode", "FAILURE_GRACE_S"]

FAILURE_GRACE_S = 30.0  # after a failure, how long the live processes get to abort, verify and report
# The senders' kernel warm-up (`KVSender.warm_up`) compiles every index bucket a round can reach:
# a compile, not a wait on a peer, so --timeout-s does not bound it. At 131,072 tokens on an H100:
# 59.2 s for 10 pack buckets (dc6c770), 79.7 s for 12 (9f5c712), past the suite's --timeout-s 60.
WARM_UP_LIMIT_S = 600.0


def switches() -> dict:
    """The environment switches in effect for this job (its processes inherit them), so two
    results files of an A/B tell which is which: the direct launches (``DCP_JAX_DIRECT_LAUNCH``;
    ``direct_off``: the kinds off, ``DCP_JAX_DIRECT_OFF`` and those of `triton_launch.DEFAULT_OFF`
    that ``DCP_JAX_DIRECT_ON`` does not turn on), the fused path's flag gate and the sender's
    ticket a window (``DCP_JAX_PACK_TICKET_EACH``)."""
    from dcp_jax.transfer import _sender_pack, _sender_region
    from pallas_kernels import triton_launch

    return {"direct_launch": not triton_launch._STATE["off"],
            "direct_off": sorted(triton_launch._STATE["off_kinds"]),
            "fused_flag_gate": _sender_region.FUSED_FLAG_GATE,
            "pack_ticket_each": _sender_pack.TICKET_EACH}


def run_job(cfg: JobConfig, *, on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Runs the main job: starts the processes, ships the request once per mode, verifies, reports.

    Args:
        cfg: the configuration.
        on_progress: called as ``on_progress(mode, done, total)`` in (chunk, prefill rank,
            decode rank) units, from the bytes the decode ranks' receivers report landed.

    Returns:
        ``{"config", "switches" (`switches`), "setup_seconds", "warmup_seconds", "prefill_setup", "placement": [{"process",
        "gpu", "cuda_visible_devices", "pci_bus_id"}, ...] (prefills, then decodes; gpu None
        without placement), "runs": [{"mode",
        "engine", "descriptors", "bytes", "batches", "engine_calls", "plan_seconds",
        "pack_seconds", "transfer_seconds", "total_seconds", "gbps", "verified", "failures",
        "ranks": [...], "repeats" (with ``cfg.requests > 1``)}, ...], "comparison": {...},
        "verified"}``. Counts are totals over all
        ranks; seconds are the slowest prefill rank's. Each rank row has ``gpu`` (its placement),
        ``strategy`` (the union
        over the prefill ranks that sent it rows) and ``sources`` (per such prefill rank: rows,
        descriptors, batches, strategy).

    Raises:
        ValueError: ``cfg.device="gpu"`` without CuPy or a CUDA device, a placed GPU that does not
            exist or fused without peer access (:func:`dcp_jax.job.gpus.check_gpus`), or buffers
            larger than the machine's memory.
        RuntimeError: a process failed to start (with its traceback), or ``cfg.mps`` and the MPS daemon did
            not start (`dcp_jax.job.mps.MpsDaemon`).
    """
    check_device(cfg.device)
    gpus.check_gpus(cfg)
    kv.check_host_memory(cfg)
    tag = uuid.uuid4().hex[:8]
    t_start = time.perf_counter()
    prefills, decodes = [], []
    mps, mps_clients = None, None
    old_term = _exit_on_sigterm() if cfg.mps else None  # before the start: a SIGTERM in it quits it too
    try:
        if cfg.mps:
            mps = MpsDaemon().start()
        prefills, decodes, prefill_setup = start_processes(cfg, tag=tag, extra_env=mps.env if mps else None)
        setup_s = time.perf_counter() - t_start
        runs = [run_mode(cfg, mode, f"{tag}-{seq}-{mode}", prefills, decodes, on_progress)
                for seq, mode in enumerate(cfg.modes)]
    finally:
        # Holding a daemon: a second SIGTERM or a Ctrl-C must not cut the clean-up short (it
        # would leave the daemon running); the clean-up's waits are bounded (10 s + 20 s).
        held = _hold_signals() if cfg.mps else None
        try:
            stop_all(prefills + decodes)
            if mps is not None:
                mps_clients = mps.clients()
                mps.close()
        finally:
            _restore_signals(held, old_term)
    for run in runs:  # decode process r is dcp_rank r (run_mode's order)
        for row, d in zip(run["ranks"], decodes):
            row["gpu"] = d.gpu
    out = dict(config=_config_json(cfg), switches=switches(), setup_seconds=setup_s, prefill_setup=prefill_setup,
               placement=[p.placement() for p in prefills + decodes],
               warmup_seconds=sum(r.get("warmup_seconds", 0.0) for r in runs), runs=runs,
               mps=None if mps_clients is None else dict(clients=mps_clients))
    by = {r["mode"]: r for r in runs}
    # Ratios only between two complete, verified runs: a failed mode's times mean nothing.
    if "direct" in by and "packed" in by and by["direct"]["verified"] and by["packed"]["verified"]:
        d, p = by["direct"], by["packed"]
        out["comparison"] = dict(
            descriptor_ratio=d["descriptors"] / max(p["descriptors"], 1),
            total_seconds_ratio=d["total_seconds"] / max(p["total_seconds"], 1e-9),
        )
    out["verified"] = all(r["verified"] for r in runs)
    return out


def _config_json(cfg: JobConfig) -> dict:
    d = cfg.to_dict()
    d["modes"] = list(cfg.modes)
    g = cfg.geometry
    d.update(num_layers=g.num_layers, kv_item_lens=list(g.kv_item_lens), row_bytes=g.row_bytes,  # per layer entry
             request_bytes=g.request_bytes(cfg.send_tokens), chunks=len(cfg.chunks()),
             engine_kind=cfg.engine_kind)
    return d


def run_mode(cfg: JobConfig, mode: str, rid: str, prefills: list[Proc], decodes: list[Proc],
             on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """One mode on these processes: open the connectors, warm up, the timed request, close.

    ``decodes`` form the decode group in list order (``dcp_size = len(decodes)``), so a test can
    serve the next request to the ranks left after a failure.

    Returns:
        The run's report (see :func:`run_job`); a process found dead before the request makes
        a failed run whose first failure starts with ``"mode not started"``.
    """
    n, engine = len(decodes), None
    t0 = time.perf_counter()
    try:
        opened = []
        for p in prefills:
            p.send("open", dict(mode=mode, dcp_size=n))
        opened = [p.recv(cfg.timeout_s, "opened") for p in prefills]
        engine = opened[0]["engine"]
        for r, d in enumerate(decodes):
            d.send("open", dict(mode=mode, dcp_rank=r, dcp_size=n, addresses=[o["address"] for o in opened]))
        # (a decode rank compiles its unpack before it links: `KVReceiver.warm_up`)
        unpack_warm = [d.recv(max(cfg.timeout_s, WARM_UP_LIMIT_S), "opened") for d in decodes]
        for p in prefills:
            p.send("warm", dict(peers=n))
        warmed = [p.recv(max(cfg.timeout_s, WARM_UP_LIMIT_S), "warmed") for p in prefills]
    except RuntimeError as exc:
        # A process died earlier (e.g. in the previous mode): this mode cannot start.
        _close_all(decodes, prefills)
        return _failed_run(mode, engine, n, f"mode not started: {exc}")
    connect_s = time.perf_counter() - t0
    try:
        tw = time.perf_counter()
        first = cfg.chunks()[0]
        warm = min(first[1], n * cfg.page_size) if mode == "direct" else first[1]
        stats, results, failures = _request(cfg, f"{rid}-warm-up", [(first[0], first[0] + warm)], prefills,
                                            decodes, opened, timed=False)
        warmup_s = time.perf_counter() - tw
        if failures or not all(s and s["ok"] for s in stats.values()):
            failures = [f"warm-up failed: {f}" for f in failures] or \
                [f"warm-up failed: prefill {k}: {s and s['reason']}" for k, s in stats.items()]
            return dict(_failed_run(mode, engine, n, failures[0]), failures=failures)
        chunks = [(s, s + length) for s, length in cfg.chunks()]
        reports = []
        for i in range(cfg.requests):
            progress = _Progress(mode, len(chunks) * n * len(prefills), cfg, on_progress)
            stats, results, failures = _request(cfg, rid if cfg.requests == 1 else f"{rid}-{i}", chunks,
                                                prefills, decodes, opened, timed=True, progress=progress)
            reports.append(_report(cfg, mode, engine, n, stats, results, failures))
            if failures or not reports[-1]["verified"]:
                break  # a failed request ends the mode: its report is the run's
    finally:
        _close_all(decodes, prefills)
    run = _median_run(reports)
    run.update(connect_seconds=connect_s, warmup_seconds=warmup_s,
               kernel_warm_up=dict(seconds=max(w["seconds"] for w in warmed),
                                   pack=warmed[0]["pack"], fused=warmed[0]["fused"],
                                   unpack=unpack_warm[0]["unpack"] if unpack_warm else [],
                                   decode_seconds=max((w["seconds"] for w in unpack_warm), default=0.0)))
    return run


class _Progress:
    """Turns the decode ranks' landed bytes into (chunk, prefill rank, decode rank) units."""

    def __init__(self, mode: str, total: int, cfg: JobConfig, fn):
        self.mode, self.total, self.fn = mode, total, fn
        self.bytes = max(cfg.geometry.request_bytes(cfg.send_tokens), 1)
        self.landed: dict[int, int] = {}
        if fn:
            fn(mode, 0, total)

    def update(self, rank: int, landed: int | None) -> None:
        self.landed[rank] = landed
        if self.fn:
            done = min(self.total, int(self.total * sum(self.landed.values()) / self.bytes))
            self.fn(self.mode, done, self.total)


def _request(cfg: JobConfig, rid: str, chunks: list[tuple[int, int]], prefills: list[Proc], decodes: list[Proc],
             opened: list[dict], *, timed: bool, progress: _Progress | None = None):
    """One request through the connectors; returns ``(sender stats, decode results, failures)``."""
    stats: dict[int, dict | None] = {}
    results: dict[int, dict | None] = {}
    failures: list[str] = []
    waiting: dict[int, tuple[str, int, Proc]] = {}  # processes holding the request, until they report
    try:
        for r, d in enumerate(decodes):
            checks = {k: o["checks"][r] for k, o in enumerate(opened) if o["checks"] is not None} if timed else None
            d.send("request", dict(rid=rid, num_tokens=chunks[-1][1], fill=timed, check=timed, hooks=timed,
                                   progress=timed and progress is not None and progress.fn is not None,
                                   checks=checks))
            waiting[id(d.conn)] = ("decode", r, d)
        for d in decodes:
            d.recv(cfg.timeout_s, "ready")
        for k, p in enumerate(prefills):
            p.send("send", dict(rid=rid, chunks=chunks, dcp_size=len(decodes)))
            waiting[id(p.conn)] = ("prefill", k, p)
    except RuntimeError as exc:
        failures.append(str(exc))
        waiting = {key: v for key, v in waiting.items() if v[2].alive}
    give_up_at, last = None, time.monotonic()
    while waiting:
        if failures and give_up_at is None:
            give_up_at = time.monotonic() + min(FAILURE_GRACE_S, cfg.timeout_s)
            for _, _, p in waiting.values():  # the connector ends the request at once everywhere
                _quiet(p, "abort", failures[0])
        if give_up_at is not None and time.monotonic() > give_up_at:
            failures.append("stopped waiting for " + ", ".join(p.who for _, _, p in waiting.values())
                            + f": no result within {min(FAILURE_GRACE_S, cfg.timeout_s):g} s of the first failure")
            break
        ready = conn_wait([p.conn for _, _, p in waiting.values()], timeout=1.0)
        if not ready:
            dead = [p for _, _, p in waiting.values() if not p.alive]
            for p in dead:
                failures.append(f"{p.who} exited (code {p.exit_code()})")
                waiting.pop(id(p.conn))
            if not dead and time.monotonic() - last > 2 * cfg.timeout_s + 30:
                failures.append(f"no message from any process for {2 * cfg.timeout_s + 30:g} s")
                break
            continue
        last = time.monotonic()
        for c in ready:
            side, idx, p = waiting[id(c)]
            try:
                kind, arg = c.recv()
            except (EOFError, OSError):
                failures.append(f"{p.who} exited (code {p.exit_code()})")
                waiting.pop(id(c))
                continue
            if kind in ("progress", "ready"):  # "ready": a rank that was not waited for above
                if progress is not None and kind == "progress":
                    progress.update(idx, arg)
                continue
            waiting.pop(id(c))
            if kind == "sent":
                stats[idx] = arg
                if not arg["ok"]:
                    failures.append(f"{p.who}: request {arg['status']}: {arg['reason']}")
            elif kind == "result":
                results[idx] = arg
                if progress is not None and arg["status"] == "success":
                    progress.update(idx, arg.get("bytes_verified", 0))
            else:
                failures.append(f"{p.who} error:\n{arg}")
                (stats if side == "prefill" else results)[idx] = None
    for p in prefills + decodes:
        _quiet(p, "release", rid)
    return stats, results, failures


def _quiet(p: Proc, kind: str, arg) -> None:
    try:
        p.send(kind, arg)
    except RuntimeError:
        pass


def _close_all(decodes: list[Proc], prefills: list[Proc]) -> None:
    """Closes the receivers, then the senders (a receiver still connecting needs its sender)."""
    _close(decodes)
    _close(prefills)


def _close(procs: list[Proc], timeout_s: float = 20.0) -> None:
    """Closes every live process's connector; a process that does not answer is killed."""
    asked = []
    for p in procs:
        try:
            p.send("close")
            asked.append(p)
        except RuntimeError:
            pass
    deadline = time.monotonic() + timeout_s
    for p in asked:
        try:
            while True:  # skip late messages of the request (progress, results after an abort)
                if not p.conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"{p.who}: no answer to close")
                if p.conn.recv()[0] == "closed":
                    break
        except (TimeoutError, EOFError, OSError):
            if p.alive:
                p.process.kill()
                p.process.join(5)


def _hold_signals():
    """Ignores SIGTERM and SIGINT (main thread only); returns the SIGINT handler to put back, or
    None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prev = signal.getsignal(signal.SIGINT)
    if prev is None:  # a handler set outside Python: left as it is (it could not be put back)
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return prev


def _restore_signals(held_int, old_term) -> None:
    if held_int is not None:
        signal.signal(signal.SIGINT, held_int)
    if old_term is not None:
        signal.signal(signal.SIGTERM, old_term)


def _exit_on_sigterm():
    """While the job holds an MPS daemon: a SIGTERM (``timeout``, a CI runner) exits through the
    ``finally`` that quits it instead of killing the process past it. Returns the handler to put
    back, or None off the main thread (where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _term(signum, frame):
        raise SystemExit(128 + signum)

    prev = signal.signal(signal.SIGTERM, _term)
    return signal.SIG_DFL if prev is None else prev
