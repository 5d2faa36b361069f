"""The load run's orchestrator: starts the processes, keeps ``--concurrency`` requests in flight,
collects every side's word on every request, and judges the run (`report.summarize`).

A request is *in flight* from the moment its orders go out (``expect`` to every decode rank,
``start`` to the sender) until every side reported it finished, drained (``is_drained``) and its
pages checked and back on the free list. Planned aborts by a decode rank are relayed: the sender says ``armed`` once every rank's
``expect`` reached it (and, for ``after_first_chunk``, the first chunk was sent), then the
orchestrator tells that rank to ``abort``.

The first ``--warmup`` requests run as their own phase; at its end every process reports a
snapshot (RSS, stats, the sender's kernel compiles), and the measured phase starts.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import signal
import threading
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any

from bridge.engine_env import quiet_engines
from dcp_jax.loadgen.config import LoadConfig, RequestPlan, iter_plans
from dcp_jax.loadgen.report import summarize
from dcp_jax.loadgen.tally import Tally
from dcp_jax.loadgen.worker import receiver_main, rss_bytes, sender_main

__all__ = ["run_load"]

START_TIMEOUT_S = 180.0
FINAL_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0  # all processes together, once their pipes are closed
_INTERRUPTED = threading.Event()


def _on_sigint(signum, frame):
    """Ctrl-C: remembered (`_Orchestrator._events` raises it again), then raised here."""
    _INTERRUPTED.set()
    raise KeyboardInterrupt


@dataclasses.dataclass
class _Track:
    plan: RequestPlan
    t_issue: float
    phase: str
    sender: dict | None = None
    recv: list = dataclasses.field(default_factory=list)
    t_done: float = 0.0

    def finished(self) -> bool:
        return self.sender is not None and all(r is not None for r in self.recv)


class _Procs:
    """The sender (index 0) and receiver processes with their pipe ends."""

    def __init__(self, cfg: LoadConfig):
        ctx = mp.get_context("spawn")
        self.names, self.conns, self.procs = [], [], []
        self.place = None
        if cfg.netns:  # two hosts: the sender on one namespace, the receivers on the other
            from dcp_jax.loadgen.soak import NetnsPlace

            self.place = NetnsPlace()
        hs, hr = (self.place.sender_host(), self.place.receiver_host()) if self.place else ("127.0.0.1", None)
        targets = [("sender", sender_main, (hs,))] + [(f"receiver{r}", receiver_main, (r, hr))
                                                      for r in range(cfg.dcp_size)]
        for k, (name, fn, extra) in enumerate(targets):
            parent, child = ctx.Pipe()
            args = (child, cfg.to_dict(), *extra)
            if self.place is not None:
                p = self.place.spawn(k, fn, args, name=f"dcp-load-{name}")
            else:
                p = ctx.Process(target=fn, args=args, name=f"dcp-load-{name}", daemon=True)
                p.start()
            child.close()
            self.names.append(name)
            self.conns.append(parent)
            self.procs.append(p)

    def send(self, k: int, msg: tuple) -> None:
        self.conns[k].send(msg)

    def dead(self) -> list[str]:
        return [f"{n} (exit code {p.exitcode})" for n, p in zip(self.names, self.procs) if not p.is_alive()]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ends every process within ``timeout_s`` (+ 5 s for a terminated one). The pipes close
        first: a worker that was not told to ``finish`` (the run was interrupted: each leads a
        process group of its own, so a terminal's Ctrl-C reached only this process) reads EOF,
        closes its connector and exits, instead of each being waited for in turn."""
        for c in self.conns:
            c.close()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if self.place is not None:
            self.place.close()


class _Orchestrator:
    def __init__(self, cfg: LoadConfig, progress):
        self.cfg, self.progress = cfg, progress
        self._plans = iter_plans(cfg)  # drawn as issued, in order
        self.planned_issued = 0  # issued requests with a planned abort
        self.tracks: dict[int, _Track] = {}
        self.tally = Tally(cfg.geometry.row_bytes, bool(cfg.faults), cfg.requests <= cfg.warmup_requests)
        self.errors: list[str] = []
        self.finals: dict[str, dict] = {}
        self.snapshots: dict[str, dict] = {}
        self.phase_times: dict[str, list[float]] = {}
        self.next = 0
        self.closed: set[int] = set()
        self.last_event = time.monotonic()
        self.sampler = self.faults = None

    # ---- pipes ---------------------------------------------------------------------------------
    def _events(self, timeout: float, only=None):
        """Messages from the processes (those in ``only``, default all) that arrive within
        ``timeout``; a pipe at EOF (its process gone) is an error and is not waited on again."""
        if _INTERRUPTED.is_set():  # a Ctrl-C whose KeyboardInterrupt a gc callback swallowed (JAX has one)
            raise KeyboardInterrupt
        ks = [k for k in range(len(self.p.conns)) if k not in self.closed and (only is None or k in only)]
        if not ks:
            time.sleep(timeout)
            return
        for c in mp_wait([self.p.conns[k] for k in ks], timeout=timeout):
            k = self.p.conns.index(c)
            try:
                while c.poll():
                    yield k, c.recv()
            except (EOFError, OSError):
                self.closed.add(k)
                self.errors.append(f"{self.p.names[k]}: pipe closed ({', '.join(self.p.dead()) or 'alive'})")
                return

    def _collect(self, kind: str, timeout: float, first: int = 0) -> dict[int, Any]:
        """One ``kind`` message from every process from index ``first`` on (other messages are
        handled as usual)."""
        got, deadline = {}, time.monotonic() + timeout
        want = set(range(first, len(self.p.conns))) - self.closed
        while (left := want - set(got) - self.closed) and (kind == "final" or not self.errors):
            if time.monotonic() > deadline:
                missing = [self.p.names[k] for k in sorted(left)]
                self.errors.append(f"no {kind!r} from {', '.join(missing)} within {timeout:g} s")
                break
            for k, msg in self._events(0.2, only=left):
                if msg[0] == kind:
                    got[k] = msg[1] if len(msg) > 1 else None
                else:
                    self._on(k, msg)
        return got

    # ---- requests ------------------------------------------------------------------------------
    def _issue(self, plan: RequestPlan, phase: str) -> None:
        self.planned_issued += plan.abort is not None
        self.tracks[plan.index] = _Track(plan, time.monotonic(), phase, recv=[None] * self.cfg.dcp_size)
        msg = plan.as_msg()
        for r in range(self.cfg.dcp_size):
            self.p.send(1 + r, ("expect", msg))
        self.p.send(0, ("start", msg))

    def _on(self, k: int, msg: tuple) -> None:
        kind = msg[0]
        if kind != "sample":  # memory samples are not progress: a stalled run must still show
            self.last_event = time.monotonic()
        if kind == "error":
            self.errors.append(f"{msg[1]} raised:\n{msg[2]}")
        elif kind == "sample":
            if self.sampler is not None:
                self.sampler.add(self.p.names[k], msg[1])
        elif kind == "armed":
            t = self.tracks[msg[1]]
            self.p.send(1 + t.plan.abort.by, ("abort", msg[1]))
        elif kind == "done":
            t = self.tracks[msg[1]]
            if k == 0:
                t.sender = msg[2]
            else:
                t.recv[k - 1] = msg[2]
            if t.finished():
                t.t_done = time.monotonic()
                self.tally.add(self.tracks.pop(msg[1]))
                if self.progress is not None:
                    self.progress.advance(t)
        else:
            self.errors.append(f"{self.p.names[k]}: unexpected message {kind!r}")

    def _phase(self, name: str, stop: int) -> None:
        t0 = time.monotonic()
        self.last_event = t0
        limit = self.cfg.timeout_s + 10.0 + (2 * self.cfg.peer_timeout_s if self.cfg.faults else 0.0)
        bound = self.cfg.duration_s if name == "main" and self.cfg.duration_s else None
        while not self.errors and (self.next < stop or self.tracks):
            if bound is not None and time.monotonic() - t0 > bound and stop > self.next:
                stop = self.next  # time is up: finish what is in flight, with no new faults
                if self.faults is not None:
                    self.faults.stop()
                    self.faults.faults = []
            self._tick()
            while self.next < stop and len(self.tracks) < self.cfg.concurrency:
                self._issue(next(self._plans), name)
                self.next += 1
            for k, msg in self._events(0.05):
                self._on(k, msg)
            if self.p.dead():
                self.errors.append(f"process died: {', '.join(self.p.dead())}")
            elif time.monotonic() - self.last_event > limit:
                stuck = sorted(self.tracks)[:8]
                self.errors.append(f"stalled: nothing finished for {limit:g} s; {len(self.tracks)} requests "
                                   f"in flight (e.g. {stuck}: sender={[self.tracks[i].sender for i in stuck[:2]]}, "
                                   f"receivers={[self.tracks[i].recv for i in stuck[:2]]})")
        self.phase_times[name] = [t0, time.monotonic()]

    def _tick(self) -> None:
        """The soak's periodic work: memory samples and faults (no-ops on a plain run)."""
        now = time.monotonic()
        if self.sampler is not None and self.sampler.due(now):
            self.sampler.add("orchestrator", dict(t=now, rss=rss_bytes(), registered=0))
            for k in range(len(self.p.conns)):
                if k not in self.closed:
                    self.p.send(k, ("sample",))
        if self.faults is not None:
            self.faults.step(now)

    def run(self) -> dict:
        cfg = self.cfg
        rss0 = rss_bytes()
        t_start = time.monotonic()
        _INTERRUPTED.clear()
        # Only where Ctrl-C raises KeyboardInterrupt anyway (the main thread, Python's default
        # handler): an ignored SIGINT (a job started in the background) stays ignored.
        ours = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if ours:
            signal.signal(signal.SIGINT, _on_sigint)
        try:
            return self._run(cfg, rss0, t_start)
        finally:
            if ours:
                signal.signal(signal.SIGINT, signal.default_int_handler)

    def _run(self, cfg: LoadConfig, rss0: int, t_start: float) -> dict:
        self.p = _Procs(cfg)
        try:
            ready = self._collect("ready", START_TIMEOUT_S)
            if not self.errors:
                for r in range(cfg.dcp_size):
                    self.p.send(1 + r, ("connect", ready[0]["address"]))
                self._collect("connected", START_TIMEOUT_S, first=1)
            t_ready = time.monotonic()
            if cfg.netns or cfg.duration_s:
                from dcp_jax.loadgen.soak import Sampler

                self.sampler = Sampler(t_start)
            if not self.errors:
                self._phase("warmup", cfg.warmup_requests)
            if not self.errors:
                for k in range(len(self.p.conns)):
                    self.p.send(k, ("snapshot",))
                snaps = self._collect("snapshot", 60.0)
                self.snapshots = {self.p.names[k]: v for k, v in snaps.items()}
                self.rss_orch_warm = rss_bytes()
            if not self.errors and cfg.faults:
                from dcp_jax.loadgen.soak import FaultInjector

                self.faults = FaultInjector(cfg.fault_list, cfg.fault_every_s, 0.6 * cfg.peer_timeout_s, self.p.place,
                                            [p.pid for p in self.p.procs[1:]], cfg.seed, sender_pid=self.p.procs[0].pid,
                                            peer_timeout_s=cfg.peer_timeout_s)
            if not self.errors:
                self._phase("main", cfg.requests)
            if self.faults is not None:
                self.faults.stop()
            self.rss_orch_end = rss_bytes()
            for k in range(len(self.p.conns)):
                if self.p.procs[k].is_alive():
                    try:
                        self.p.send(k, ("finish",))
                    except (BrokenPipeError, OSError):
                        pass
            finals = self._collect("final", FINAL_TIMEOUT_S)  # even after an error: what each side saw
            self.finals = {self.p.names[k]: v for k, v in finals.items()}
        finally:
            if self.faults is not None:  # interrupted during a fault: nobody stays stopped, the link comes up
                self.faults.stop()
            self.p.stop()
        return summarize(self, rss0=rss0, t_start=t_start, t_ready=t_ready, t_end=time.monotonic())


def run_load(cfg: LoadConfig, *, progress=None) -> dict:
    """Runs one load test and returns its report (the ``--json`` document).

    Args:
        cfg: the run's options.
        progress: an object with ``advance(track)`` called once per finished request (the CLI's
            progress bar), or None.

    Returns:
        The report dict: ``ok`` (every check passed), ``failures`` (what did not), the figures.
    """
    if not isinstance(cfg, LoadConfig):
        raise TypeError(f"cfg must be a LoadConfig, got {type(cfg).__name__}")
    quiet_engines(loopback=not cfg.netns)  # on two hosts each host sets its own devices
    return _Orchestrator(cfg, progress).run()
