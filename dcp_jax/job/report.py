"""The main job's report: one request's run from the processes' results, the median of repeats, strategies.

:func:`dcp_jax.job.run.run_mode` builds each mode's run from these (what the counts and seconds
mean: :mod:`dcp_jax.job.run`; the fields: :func:`dcp_jax.job.run.run_job`).
"""

from __future__ import annotations

import math

from dcp_jax.job import kv
from dcp_jax.job.config import JobConfig

__all__: list[str] = []


def _failed_run(mode: str, engine: str | None, n: int, failure: str) -> dict:
    """The result of a mode that could not run: nothing sent, nothing verified."""
    nan = float("nan")
    ranks = [dict(dcp_rank=r, descriptors=0, bytes=0, batches=0, engine_calls=0, strategy="",
                  sources=[], verified=False, errors=[failure]) for r in range(n)]
    return dict(mode=mode, engine=engine, paths=[], request_seconds=nan, descriptors=0, bytes=0,
                engine_calls=0, batches=0, plan_seconds=nan, pack_seconds=nan, transfer_seconds=nan, total_seconds=nan,
                gbps=0.0, verified=False, failures=[failure], ranks=ranks)


def _median_run(reports: list[dict]) -> dict:
    """The run of one mode from its timed requests' reports: the last one when it failed, else
    the one of median ``request_seconds`` (the lower of the two middle ones for an even count),
    so every field of the run is one request's; with more than one request, ``repeats`` lists
    each one's seconds, GB/s of the whole request, verification and timeline, in order."""
    last = reports[-1]
    if len(reports) == 1:
        return last
    ok = not last["failures"] and last["verified"]
    if ok:
        order = sorted(range(len(reports)), key=lambda k: _finite_or_inf(reports[k]["request_seconds"]))
        run = dict(reports[order[(len(order) - 1) // 2]])
    else:
        run = dict(last)
    run["repeats"] = [dict(request_seconds=r["request_seconds"], transfer_seconds=r["transfer_seconds"],
                           first_byte_at=r.get("first_byte_at"),
                           total_seconds=r["total_seconds"],
                           whole_gbps=r["bytes"] / 1e9 / r["request_seconds"] if r["request_seconds"] > 0 else math.nan,
                           verified=r["verified"], launches=r.get("launches", 0), timeline_ms=r.get("timeline_ms", {}),
                           kernel_traces=r.get("kernel_traces", 0), trace_log=r.get("trace_log", [])) for r in reports]
    run["verified"] = ok and all(r["verified"] for r in reports)
    return run


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _report(cfg: JobConfig, mode: str, engine: str | None, n: int, stats: dict, results: dict,
            failures: list[str]) -> dict:
    good = {k: s for k, s in stats.items() if s}
    row_bytes = cfg.geometry.row_bytes
    rank_rows = []
    for r in range(n):
        res = results.get(r) or dict(dcp_rank=r, verified=False, errors=["no result"])
        sent = dict(descriptors=0, bytes=0, batches=0, engine_calls=0, strategy="", sources=[])
        strategies: set[str] = set()
        for k, s in sorted(good.items()):
            c = s["ranks"].get(r)
            if not c:
                continue
            for key in ("descriptors", "bytes", "batches", "engine_calls"):
                sent[key] += c[key]
            if c["rows"]:  # only prefill ranks that sent this rank rows say how it was sent
                strat = _strategy(cfg, mode, c, s["unit_rows"][r], kv.pack_bytes(cfg, k) // row_bytes)
                strategies.add(strat)
                sent["sources"].append(dict(prefill_rank=k, rows=c["rows"], descriptors=c["descriptors"],
                                            batches=c["batches"], strategy=strat))
        sent["strategy"] = ",".join(sorted(strategies))
        sent["path"] = ",".join(sorted({s["ranks"][r]["path"] for s in good.values()
                                        if r in s["ranks"] and s["ranks"][r].get("path")}))
        rank_rows.append({**sent, **res})
    total_bytes = sum(x["bytes"] for x in rank_rows)
    nan = float("nan")

    def slowest(key: str) -> float:
        vals = [s[key] for s in good.values() if s[key] is not None]
        return max(vals) if vals else nan

    total_s = slowest("total_seconds")
    # Whole request on one clock (time.monotonic(), shared by the host's processes): the first
    # byte packed or sent by any prefill rank to the last decode rank's SUCCESS.
    firsts = [s["first_byte_at"] for s in good.values() if s.get("first_byte_at") is not None]
    dones = [x["done_at"] for x in rank_rows if x.get("done_at") is not None]
    request_s = max(dones) - min(firsts) if firsts and len(dones) == n else nan
    timeline = _timeline_summary([s.get("timeline") or [] for s in good.values()],
                                 [x.pop("timeline", None) or [] for x in rank_rows], min(firsts) if firsts else None)
    return dict(
        mode=mode, engine=engine, paths=sorted({x["path"] for x in rank_rows if x["path"]}),
        request_seconds=request_s, copy_seconds=slowest("copy_seconds"),
        # how the decode ranks heard their region windows landed (KVSender(region_notify=...))
        region_notify=cfg.sender_region_notify if cfg.direction == "push" and any(
            "region" in x["path"].split(",") for x in rank_rows) else None,
        # `time.monotonic()` of the first byte (the host's clock: GPU traces align to it)
        first_byte_at=min(firsts) if firsts else None,
        # each side's path to the engine: "direct" (its KV registered) or "staged" (pinned host)
        staging=dict(prefill=",".join(sorted({s.get("staging", "direct") for s in good.values()})),
                     decode=",".join(sorted({x.get("staging", "direct") for x in rank_rows if "status" in x}))),
        pack_backend=",".join(sorted({s.get("pack_backend") or cfg.pack_backend for s in good.values()}))
        or cfg.pack_backend, stage_seconds=slowest("stage_seconds"),
        # kernels traced (so compiled) by the senders inside this request: its time includes them
        kernel_traces=sum(s.get("kernel_traces", 0) for s in good.values()),
        # pack calls / fused launches of the busiest prefill sender (`request_stats`: the rounds)
        launches=max((s.get("launches", 0) for s in good.values()), default=0),
        trace_log=[t for s in good.values() for t in s.get("trace_log") or []],
        unstage_seconds=max((x.get("unstage_seconds") or 0.0 for x in rank_rows), default=0.0),
        unpack_seconds=max((x.get("unpack_seconds") or 0.0 for x in rank_rows), default=0.0),
        descriptors=sum(x["descriptors"] for x in rank_rows), bytes=total_bytes,
        engine_calls=sum(x["engine_calls"] for x in rank_rows), batches=sum(x["batches"] for x in rank_rows),
        plan_seconds=slowest("plan_seconds"), pack_seconds=slowest("pack_seconds"),
        transfer_seconds=slowest("transfer_seconds"), total_seconds=total_s,
        gbps=total_bytes / total_s / 1e9 if good and math.isfinite(total_s) and total_s > 0 else 0.0,
        verified=not failures and len(good) == len(stats) == cfg.prefill_dcp_size
        and all(s["ok"] for s in good.values()) and all(x.get("verified") for x in rank_rows),
        failures=failures, ranks=rank_rows, timeline_ms=timeline,
    )


def _timeline_summary(senders: list[list], receivers: list[list], t0: float | None) -> dict:
    """The connectors' request timelines (`dcp_jax.transfer.requests.Timeline`) folded into
    ``{"prefill:EVENT" or "decode:EVENT": [first_ms, last_ms, count]}``, milliseconds after the
    first byte packed or sent (``t0``, `time.monotonic()`); {} without a start."""
    if t0 is None:
        return {}
    out: dict[str, list] = {}
    for side, lists in (("prefill", senders), ("decode", receivers)):
        for events in lists:
            for name, _rank, t in events:
                ms = round((t - t0) * 1e3, 3)
                e = out.setdefault(f"{side}:{name}", [ms, ms, 0])
                e[0], e[1], e[2] = min(e[0], ms), max(e[1], ms), e[2] + 1
    return dict(sorted(out.items(), key=lambda kv: kv[1][0]))


def _strategy(cfg: JobConfig, mode: str, counts: dict, unit_rows: list[int], region_rows: int) -> str:
    """How one prefill rank sent one decode rank, in the job's words.

    ``sliced``: the sender made more batches than ``max_batch_indices`` alone asks for (a unit
    larger than the pack buffer went in pieces); ``per_row``: packing was asked for, descriptors
    came from the KV (the buffer held no row).
    """
    names = {x for x in counts["strategy"].split(",") if x and x != "empty"}
    if mode != "direct" and "direct" in names:
        names = (names - {"direct"}) | {"per_row"}
    if "packed" in names:
        w = cfg.max_batch_indices
        plain = sum(-(-rows // w) if w else 1 for rows in unit_rows if rows)
        if counts["batches"] > plain or any(rows > region_rows for rows in unit_rows):
            names = (names - {"packed"}) | {"sliced"}
    return ",".join(sorted(names))
