"""``dcp-jax load --netns``: the load run across two hosts (network namespaces), random faults
while it runs, and the memory record over time.

`NetnsPlace` puts the sender on host 0 and the receivers on host 1 of a `dcp_jax.netns.Hosts`
pair (the sender's control plane and Mooncake bound to host 0's veth address, the receivers'
to host 1's; UCX over TCP on the veth devices only, `dcp_jax.netns.ENGINE_ENV`). `FaultInjector`
plays ``--faults`` at random times (gaps uniform in [0.5, 1.5] x ``--fault-every-s``), each for a random outage shorter than the connector's
peer timeout, so requests in flight may FAIL but connections survive:

* ``link_flap``: the veth link down, then up again;
* ``pause``: one receiver process SIGSTOPped, then SIGCONTed (a decode host that stalls);
* ``sender_pause``: the sender process SIGSTOPped for *longer* than the peer timeout (1.2-1.6 x
  it), then SIGCONTed: the receivers drop it as silent while it still holds queued and in-flight
  windows (the late-write case: it must post nothing more, and nothing of it may land in pages
  given back), and connect again.

`Sampler` asks every process for its RSS and ``bridge.registered_bytes()`` every
``SAMPLE_EVERY_S``; `plot_samples` draws them (PNG).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

__all__ = ["NetnsPlace", "FaultInjector", "Sampler", "plot_samples", "FAULTS", "SAMPLE_EVERY_S"]

FAULTS = ("link_flap", "pause", "sender_pause")
SAMPLE_EVERY_S = 2.0
#: Outages last uniformly [MIN_OUTAGE_S, max_outage] with max_outage below the peer timeout.
MIN_OUTAGE_S = 0.2


class NetnsPlace:
    """Where each process of a run lives: two namespaces, made here and removed at `close`."""

    def __init__(self):
        from dcp_jax.netns import Hosts

        self.hosts = Hosts(2, prefix="dcpn")

    def sender_host(self) -> str:
        return self.hosts.addr(0, 1)

    def receiver_host(self) -> str:
        return self.hosts.addr(1)

    def spawn(self, k: int, target, args: tuple, name: str):
        """Process ``k`` (0: the sender) inside its host's namespace."""
        return self.hosts.spawn(0 if k == 0 else 1, target, args, name=name)

    def close(self) -> None:
        self.hosts.close()


class FaultInjector:
    """Random faults during a run (`FAULTS`), each undone after its outage; `step` is called
    from the orchestrator's loop and never blocks."""

    def __init__(self, faults: list[str], every_s: float, max_outage_s: float, place: NetnsPlace,
                 receiver_pids: list[int], seed: int, sender_pid: int | None = None, peer_timeout_s: float = 5.0):
        self.faults, self.every_s, self.max_outage_s = faults, every_s, max(MIN_OUTAGE_S, max_outage_s)
        self.place, self.pids, self.sender_pid, self.peer_timeout_s = place, receiver_pids, sender_pid, peer_timeout_s
        self.rng = np.random.default_rng([seed, 0xFA17])
        self.log: list[dict[str, Any]] = []
        self._undo = None  # (time, fn, record)
        self._next = time.monotonic() + self._gap()

    def _gap(self) -> float:
        return float(self.rng.uniform(0.5, 1.5) * self.every_s)

    def step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._undo is not None:
            t, fn, rec = self._undo
            if now >= t:
                fn()
                rec["end"] = now
                self._undo = None
                self._next = now + self._gap()
            return
        if not self.faults or now < self._next:
            return
        kind = self.faults[int(self.rng.integers(0, len(self.faults)))]
        outage = float(self.rng.uniform(MIN_OUTAGE_S, self.max_outage_s))
        rec = dict(kind=kind, start=now, outage_s=outage)
        if kind == "link_flap":
            self.place.hosts.link_down(1)
            undo = lambda: self.place.hosts.link_up(1)  # noqa: E731
        elif kind == "sender_pause":
            if self.sender_pid is None:
                raise ValueError("sender_pause needs the sender's pid")
            pid = rec["pid"] = self.sender_pid
            rec["outage_s"] = outage = float(self.rng.uniform(1.2, 1.6) * self.peer_timeout_s)
            os.kill(pid, signal.SIGSTOP)
            undo = lambda: os.kill(pid, signal.SIGCONT)  # noqa: E731
        else:
            pid = self.pids[int(self.rng.integers(0, len(self.pids)))]
            rec["pid"] = pid
            os.kill(pid, signal.SIGSTOP)
            undo = lambda: os.kill(pid, signal.SIGCONT)  # noqa: E731
        self.log.append(rec)
        self._undo = (now + outage, undo, rec)

    def stop(self) -> None:
        """Undoes a fault in progress (the run ends with the link up and nobody stopped)."""
        if self._undo is not None:
            _, fn, rec = self._undo
            fn()
            rec["end"] = time.monotonic()
            self._undo = None


class Sampler:
    """RSS and registered bytes of every process over the run: ``samples[name] = [(t, rss,
    registered), ...]`` (t in seconds from the run's start)."""

    def __init__(self, t0: float):
        self.t0, self.last = t0, 0.0
        self.samples: dict[str, list[tuple[float, int, int]]] = {}

    def due(self, now: float) -> bool:
        if now - self.last >= SAMPLE_EVERY_S:
            self.last = now
            return True
        return False

    def add(self, name: str, info: dict) -> None:
        self.samples.setdefault(name, []).append((info["t"] - self.t0, int(info["rss"]), int(info["registered"])))


def plot_samples(samples: dict, faults: list[dict], t0: float, path: str, title: str) -> None:
    """Two panels (RSS MiB, registered MiB) per process over time, faults shaded; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for name, rows in sorted(samples.items()):
        if not rows:
            continue
        a = np.asarray(rows, dtype=float)
        axes[0].plot(a[:, 0], a[:, 1] / 2**20, label=name)
        axes[1].plot(a[:, 0], a[:, 2] / 2**20, label=name)
    for f in faults:
        end = f.get("end", f["start"] + f["outage_s"])
        for ax in axes:
            color = dict(link_flap="red", sender_pause="purple").get(f["kind"], "orange")
            ax.axvspan(f["start"] - t0, end - t0, color=color, alpha=0.15, lw=0)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("registered (MiB)")
    axes[1].set_xlabel("seconds since start (red: link down, orange: receiver stopped, purple: sender stopped)")
    axes[0].legend(loc="lower right", fontsize=8)
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
