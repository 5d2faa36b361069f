"""The ``dcp-jax load`` command body: options -> run (with a progress bar) -> table and JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dcp_jax.cli_options import check_out_path, check_plot_path
from dcp_jax.loadgen.config import LoadConfig
from dcp_jax.loadgen.report import render
from dcp_jax.loadgen.run import run_load

__all__ = ["load_command", "check_outputs"]


class _Bar:
    """rich progress bar fed by the orchestrator (one advance per finished request)."""

    def __init__(self, progress, task):
        self.p, self.task, self.ok, self.ab = progress, task, 0, 0

    def advance(self, track) -> None:
        st = [track.sender["status"]] + [r["status"] for r in track.recv]
        self.ok += all(s == "success" for s in st)
        self.ab += all(s == "aborted" for s in st)
        self.p.update(self.task, advance=1, ok=self.ok, ab=self.ab)


def check_outputs(cfg: LoadConfig, json_path: Path | None, plot_path: Path | None) -> None:
    """The output options' rules, before the run: both paths writable (`check_out_path`), and a
    plot only on a run that takes samples (``netns`` or ``duration_s``; else nothing is drawn).

    Raises:
        ValueError: naming the option.
    """
    check_out_path(json_path, "--json")
    check_plot_path(plot_path, "--plot")
    if plot_path is not None and not (cfg.netns or cfg.duration_s):
        raise ValueError("--plot needs --netns or --duration-s: only those runs take the samples it draws")


def load_command(cfg: LoadConfig, json_path: Path | None = None, *, progress: bool = True,
                 console=None, plot_path: Path | None = None) -> int:
    """Runs ``cfg``, prints the table, writes ``json_path`` (and ``plot_path``: RSS and
    registered bytes over time, a PNG); returns the exit code (0: every check passed, 1: a
    request or a check failed).

    Raises:
        ValueError: ``json_path`` or ``plot_path`` cannot be written, or ``plot_path`` on a run
            that takes no samples (neither ``netns`` nor ``duration_s``); checked before the run.
    """
    from rich.console import Console

    check_outputs(cfg, json_path, plot_path)
    console = console or Console()
    show = progress and sys.stdout.isatty() and console.is_terminal
    if show:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cols = (TextColumn("[bold]load[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("ok {task.fields[ok]} aborted {task.fields[ab]}"), TimeElapsedColumn())
        with Progress(*cols, console=console, transient=True) as p:
            task = p.add_task(f"{cfg.engine} {cfg.direction}", total=None if cfg.duration_s else cfg.requests,
                              ok=0, ab=0)
            rep = run_load(cfg, progress=_Bar(p, task))
    else:
        rep = run_load(cfg)
    render(rep, console)
    if rep.get("faults") or cfg.netns:
        console.print(f"faults injected: {len(rep['faults'])} ({', '.join(sorted(set(f['kind'] for f in rep['faults']))) or '-'}); "
                      f"issued {rep['issued']}, lost {rep['lost']}, reconnects {sum(rep['reconnects'].values())}")
    if json_path is not None:
        json_path.write_text(json.dumps(rep, indent=2, default=_default))
        console.print(f"wrote {json_path}")
    if plot_path is not None and rep.get("samples"):
        from dcp_jax.loadgen.soak import plot_samples

        c = rep["config"]
        plot_samples(rep["samples"], rep["faults"], 0.0, str(plot_path),
                     f"dcp-jax load{' --netns' if c['netns'] else ''}: {c['engine']} {c['direction']}, "
                     f"{rep['finished']} requests ({rep['succeeded']} ok, {rep['failed']} failed, {rep['aborted']} aborted), "
                     f"{len(rep['faults'])} faults")
        console.print(f"wrote {plot_path}")
    return 0 if rep["ok"] else 1


def _default(o: Any):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
