"""What a load run measured and whether it passed: the ``--json`` document and its table.

Definitions (also written into the JSON under ``definitions``):

* outcome of a request: ``succeeded`` when the sender and every decode rank said SUCCESS,
  ``aborted`` when all of them said ABORTED, ``failed`` otherwise (any FAILED, or sides that
  disagree).
* latency of a request: the longest, over decode ranks, of ``receiver.request_latency`` (from
  that rank's ``expect`` to its SUCCESS): how long a decode scheduler waits for the KV of a
  request it announced. p50/p99 over the measured phase's succeeded requests.
* requests_per_s: requests of the measured phase (after warm-up), any outcome, over its wall
  time (first order out to last request finished, pages freed and bytes checked); gb_per_s: the
  KV bytes of its succeeded requests (tokens x row bytes, each token once) over the same time.
* misattributed_messages: completions credited to the wrong request: (request, rank) pairs that
  reported SUCCESS while their rows were not byte-exact, plus sides reporting SUCCESS for a
  request that was aborted before its last chunk was ever sent (only a misattributed message
  can complete it), plus the receivers' ``stats["inconsistent_messages"]``.
* sentinel_violations: pages that should hold only the sentinel but do not: free pages handed
  out again, the rows past a request's last row, every free page at the end, and pages of an
  aborted request holding bytes of neither it nor the sentinel (sender and receivers).
* kernel_compiles_after_warmup: the sender's ``stats["kernel_compiles"]`` at the end minus after
  the warm-up phase.
* rss_growth_bytes: the sum over every process (orchestrator, sender, receivers) of the RSS
  growth from the end of the warm-up to the end of the run (before ``close``), negatives as 0.
* registered_bytes_*: ``bridge.registered_bytes()`` summed over the worker processes before the
  connector was created, while it lived, and after its ``close()``.
"""
from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import numpy as np

__all__ = ["summarize", "render", "DEFINITIONS"]

DEFINITIONS = {k: v for k, v in (line.split(": ", 1) for line in (
    "outcome: succeeded = every side SUCCESS; aborted = every side ABORTED; failed = the rest",
    "latency: max over decode ranks of receiver.request_latency (expect -> SUCCESS); measured phase, succeeded",
    "requests_per_s: measured-phase requests (any outcome) / its wall time incl. verification and page reuse",
    "gb_per_s: measured-phase succeeded KV bytes (tokens x row bytes) / the same wall time, 1e9 B/GB",
    "misattributed_messages: SUCCESS with wrong bytes per (request, rank) + SUCCESS sides of aborted "
    "requests whose last chunk was never sent + receivers' stats['inconsistent_messages']",
    "sentinel_violations: pages that lost the sentinel: reused free pages, last-page tails, all free pages "
    "at the end, aborted requests' pages holding foreign bytes",
    "kernel_compiles_after_warmup: sender stats['kernel_compiles'] at the end minus after the warm-up phase",
    "rss_growth_bytes: sum over all processes of max(0, RSS at the end before close - RSS after warm-up)",
    "warmup_covers_run: --warmup >= --requests: every request ran as the warm-up (measured as such); "
    "kernel_compiles_after_warmup and rss_growth_bytes are then null and not checked",
    "registered_bytes_after_close: bridge.registered_bytes() summed over worker processes after close()",
    "lost: requests issued that never finished on every side (must be 0, faults or not)",
    "faults: the injected faults (kind, start, outage_s; --netns --faults), FAILED requests then allowed",
    "unsuccessful_drain_max_ms: longest wait, over aborted/failed requests and sides, from the terminal status "
    "to is_drained() (pages are reused only after it)",
    "sides.*.own_process_group: the process leads its own process group (worker.own_process_group): a "
    "SIGSTOP fault cannot make its group orphaned with a stopped member (kernel SIGHUP + SIGCONT to all)",
))}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None


def _machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return dict(host=platform.node(), cpu=cpu, cores=os.cpu_count(), python=platform.python_version(),
                platform=platform.platform(), load_average_1_5_15=list(os.getloadavg()))


def summarize(o, *, rss0: int, t_start: float, t_ready: float, t_end: float) -> dict[str, Any]:
    """The report of a finished (or failed) run of orchestrator ``o``."""
    cfg, g = o.cfg, o.cfg.geometry
    fin, snaps = o.finals, o.snapshots
    recv_names = [f"receiver{r}" for r in range(cfg.dcp_size)]
    faulty = bool(cfg.faults)  # injected faults: FAILED requests are expected, counted, allowed
    issued = getattr(o, "next", cfg.requests)
    tl = o.tally
    counts, wrong, by_side = tl.counts, tl.wrong, tl.by_side
    bad_success, misattrib, src_bad = tl.bad_success, tl.misattrib, tl.src_bad
    main_lat, main_xfer, main_n, main_bytes = tl.main_lat, tl.main_xfer, tl.main_n, tl.main_bytes
    expected_bytes = tl.expected_bytes
    inconsistent = sum(fin[n]["stats"].get("inconsistent_messages", 0) for n in recv_names if n in fin)
    misattrib += inconsistent
    sides = {n: fin.get(n) for n in ["sender", *recv_names]}
    present = [f for f in sides.values() if f is not None]
    sentinel = sum(f["pool"]["sentinel_violations"] for f in present)
    bytes_verified = sum(fin[n]["pool"]["bytes_verified"] for n in recv_names if n in fin)
    kc_warm = snaps.get("sender", {}).get("kernel_compiles")
    kc_end = fin.get("sender", {}).get("stats", {}).get("kernel_compiles")
    # --warmup >= --requests: the warm-up is the whole run and nothing runs after it, so there is
    # no "after the warm-up" to count compiles or RSS growth in (None, the checks not run).
    covers = cfg.requests <= cfg.warmup_requests
    kc_after = None if covers or kc_warm is None or kc_end is None else kc_end - kc_warm
    rss = {"orchestrator": dict(rss_start=rss0, rss_warm=getattr(o, "rss_orch_warm", None),
                                rss_end=getattr(o, "rss_orch_end", None))}
    for n, f in sides.items():
        if f is not None:
            rss[n] = dict(f["mem"], rss_warm=snaps.get(n, {}).get("rss"))
    # With the warm-up covering the run there is no phase after it to have grown in: None each.
    growth = {n: (m["rss_end"] - m["rss_warm"]) if not covers and m.get("rss_warm") is not None
              and m.get("rss_end") is not None else None for n, m in rss.items()}
    rss_growth = None if covers else sum(max(0, v) for v in growth.values() if v is not None)
    reg_before = sum(f["mem"]["registered_before"] for f in present)
    reg_with = sum(f["mem"]["registered_with"] for f in present)
    reg_after = sum(f["mem"]["registered_after_close"] for f in present)
    dropped = sum(f["stats"].get("dropped_messages", 0) for f in present)
    rejected = sum(f["stats"].get("rejected_messages", 0) for f in present)
    worker_errors = sum(f["stats"].get("worker_errors", 0) for f in present)
    pages_leaked = sum(f["pages_leaked"] for f in present)
    # Pack regions (sender) and receive-region ranges (receivers) still held once every request
    # finished and drained: each is given back then, so any left is a leak.
    held = {n: sum((f["stats"].get(k) or {}).get("regions_in_use", 0) for k in ("arena", "region"))
            for n, f in sides.items() if f is not None}
    t0, t1 = o.phase_times.get("main", o.phase_times.get("warmup", [t_ready, t_end]))
    if cfg.requests <= cfg.warmup_requests:
        t0, t1 = o.phase_times.get("warmup", [t0, t1])
    wall = max(t1 - t0, 1e-9)

    failures = list(o.errors)
    finished = tl.finished

    def check(cond: bool, what: str) -> None:
        if not cond:
            failures.append(what)

    check(finished == issued, f"{issued - finished} of {issued} issued requests never finished (lost)")
    # A run that measured nothing proves nothing (e.g. --duration-s shorter than one request).
    check(main_n > 0, f"no request was measured ({issued} issued, {cfg.warmup_requests} of them warm-up; "
                      f"--duration-s={cfg.duration_s:g} ended the measured phase before its first request)"
          if cfg.duration_s else f"no request was measured ({issued} issued)")
    check(issued == cfg.requests or cfg.duration_s > 0, f"only {issued} of {cfg.requests} requests were issued")
    check(not tl.wrong_count, f"{tl.wrong_count} requests ended wrong, e.g. {wrong[:3]}")
    planned_issued = o.planned_issued
    check(counts["aborted"] == planned_issued or (faulty and counts["aborted"] <= planned_issued), f"{counts['aborted']} requests ABORTED on every side, "
                                               f"{planned_issued} of the {issued} issued were aborted on purpose")
    check(misattrib == 0, f"misattributed_messages={misattrib}")
    check(sentinel == 0, f"sentinel_violations={sentinel}: " + "; ".join(
        f"{n}: {f['pool']['first_problem']}" for n, f in sides.items() if f is not None and f["pool"]["first_problem"]))
    check(src_bad == 0, f"{src_bad} source rows of the sender's KV changed under it")
    check(bytes_verified == expected_bytes, f"bytes_verified={bytes_verified}, the succeeded requests hold "
                                            f"{expected_bytes}")
    check(covers or kc_after == 0, f"kernel_compiles_after_warmup={kc_after} (after warm-up {kc_warm}, end {kc_end})")
    limit = int(cfg.max_rss_growth_mb * (1 << 20))
    check(covers or rss_growth < limit, f"rss_growth_bytes={rss_growth} >= {limit}")
    check(len(present) == 1 + cfg.dcp_size and reg_after == reg_before,
          f"registered_bytes_after_close={reg_after}, before the connector {reg_before}")
    check(worker_errors == 0, f"{worker_errors} exceptions in the connectors' worker threads")
    check(pages_leaked == 0, f"{pages_leaked} pages never came back to the free lists")
    check(not any(held.values()), "regions still held at the end: " + ", ".join(
        f"{n} {v}" for n, v in held.items() if v))

    return dict(
        ok=not failures, failures=failures,
        requests=cfg.requests, issued=issued, finished=finished, lost=issued - finished, **counts,
        planned_aborts=planned_issued,
        aborted_by=by_side, bytes_verified=bytes_verified, misattributed_messages=misattrib,
        inconsistent_messages=inconsistent, sentinel_violations=sentinel, succeeded_wrong_bytes=bad_success,
        source_rows_corrupted=src_bad, regions_held_at_end=held, dropped_messages=dropped, rejected_messages=rejected,
        warmup_covers_run=covers,
        kernel_compiles_after_warmup=kc_after, kernel_compiles_warmup=kc_warm, kernel_compiles_end=kc_end,
        rss_growth_bytes=rss_growth, rss_growth_by_process=growth, rss=rss,
        registered_bytes_before=reg_before, registered_bytes_live=reg_with,
        registered_bytes_after_close=reg_after,
        requests_per_s=main_n / wall, gb_per_s=main_bytes / wall / 1e9, measured_requests=main_n,
        measured_seconds=wall, p50_ms=_pct(main_lat, 50), p99_ms=_pct(main_lat, 99),
        max_ms=max(main_lat) * 1e3 if main_lat else None,
        sender_transfer_p50_ms=_pct(main_xfer, 50), sender_transfer_p99_ms=_pct(main_xfer, 99),
        unsuccessful_drain_max_ms=None if tl.drain_max_s is None else tl.drain_max_s * 1e3,
        startup_seconds=t_ready - t_start, total_seconds=t_end - t_start,
        close_seconds={n: f["close_s"] for n, f in sides.items() if f is not None},
        warmup_seconds=(lambda w: w[1] - w[0] if w else None)(o.phase_times.get("warmup")),
        cpu_seconds={n: f["mem"].get("cpu_s") for n, f in sides.items() if f is not None},
        loadgen_check_seconds={n: f["pool"]["seconds"] for n, f in sides.items() if f is not None},
        config=dict(cfg.to_dict(), row_bytes=g.row_bytes, item_lens=list(g.kv_item_lens)),
        sides={n: None if f is None else dict(stats=f["stats"], pool=f["pool"], unfinished=f["unfinished"],
                                              end_violations=f["end_violations"],
                                              own_process_group=f["mem"].get("own_process_group"))
               for n, f in sides.items()},
        definitions=DEFINITIONS, machine=_machine(),
        faults=[dict(f, start=f["start"] - t_start, end=f.get("end", f["start"] + f["outage_s"]) - t_start)
                for f in getattr(getattr(o, "faults", None), "log", None) or []],
        samples=getattr(getattr(o, "sampler", None), "samples", None),
        reconnects={n: f.get("reconnects", 0) for n, f in sides.items() if f is not None},
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1 else f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def render(rep: dict[str, Any], console) -> None:
    """The report as one rich table (and the failures, if any)."""
    from rich.table import Table

    c = rep["config"]
    t = Table(title=f"dcp-jax load: {c['engine']} {c['direction']}, {c['requests']} requests, concurrency "
                    f"{c['concurrency']}, abort {c['abort_fraction']:g}, dcp {c['dcp_size']}, {c['model']}, "
                    f"<= {c['max_tokens']} tokens")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("figure")
    t.add_column("value", justify="right")
    mb = 1 << 20
    rows = [
        ("succeeded", rep["succeeded"]), ("requests/s", rep["requests_per_s"]),
        ("aborted (planned)", f"{rep['aborted']} ({rep['planned_aborts']})"), ("GB/s", rep["gb_per_s"]),
        ("failed", rep["failed"]), ("latency p50 ms", rep["p50_ms"]),
        ("bytes verified", rep["bytes_verified"]), ("latency p99 ms", rep["p99_ms"]),
        ("misattributed messages", rep["misattributed_messages"]),
        ("sender transfer p50/p99 ms", f"{_fmt(rep['sender_transfer_p50_ms'])} / {_fmt(rep['sender_transfer_p99_ms'])}"),
        ("sentinel violations", rep["sentinel_violations"]), ("dropped stale messages", rep["dropped_messages"]),
        ("kernel compiles after warm-up", rep["kernel_compiles_after_warmup"]),
        ("kernel compiles (warm-up / end)", f"{_fmt(rep['kernel_compiles_warmup'])} / {_fmt(rep['kernel_compiles_end'])}"),
        ("RSS growth MiB (all processes)", None if rep["rss_growth_bytes"] is None else rep["rss_growth_bytes"] / mb),
        ("registered MiB before / live / after close",
         f"{rep['registered_bytes_before'] / mb:.1f} / {rep['registered_bytes_live'] / mb:.1f} / "
         f"{rep['registered_bytes_after_close'] / mb:.1f}"),
    ]
    for k in range(0, len(rows), 2):
        (a, av), (b, bv) = rows[k], rows[k + 1] if k + 1 < len(rows) else ("", "")
        t.add_row(a, _fmt(av), b, _fmt(bv))
    console.print(t)
    if rep["warmup_covers_run"]:
        console.print(f"--warmup {rep['config']['warmup']} >= --requests {rep['requests']}: every request ran as "
                      "the warm-up; no compile or RSS check after it (lower --warmup to have one)")
    else:
        per = ", ".join(f"{n} {(v or 0) / mb:+.1f}" for n, v in rep["rss_growth_by_process"].items())
        console.print(f"RSS growth by process (MiB, warm-up -> end): {per}")
    if rep["ok"]:
        console.print("[green]all checks passed[/green]")
    else:
        for f in rep["failures"]:
            console.print(f"FAILED: {f}", style="red", markup=False, highlight=False)
