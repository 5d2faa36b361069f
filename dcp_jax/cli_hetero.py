"""``dcp-jax transfer`` and ``dcp-jax plan`` for a heterogeneous pair (TP head splits, cache
layouts): the runs, their tables and the plan's descriptor counts. Split from `dcp_jax.cli`, whose
commands call these when a TP or layout option is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dcp_jax.cli_options import _check_out_path, _fail, _json_default, _rank_failed, parse_paths
from dcp_jax.job.config import MAX_PROMPT_TOKENS, check_prefill_interleave

__all__ = ["hetero_plan", "hetero_transfer"]


def _check_tokens(prompt_tokens: int) -> None:
    """The job's bound (`dcp_jax.job.config.MAX_PROMPT_TOKENS`), before a plan is sized by it."""
    if not 1 <= prompt_tokens <= MAX_PROMPT_TOKENS:
        _fail(f"--prompt-tokens={prompt_tokens:,} must be in [1, {MAX_PROMPT_TOKENS:,}]: plans and buffers "
              "are sized by it")


def _check_seed(seed: int) -> None:
    """A seed >= 0, as `JobConfig` and `LoadConfig` ask of the other commands."""
    if seed < 0:
        _fail(f"--seed={seed} must be an int >= 0")


def _check_sides(prefill: dict, decode: dict) -> None:
    """Each side's sizes are ints >= 1, refused naming the option (the plan's own errors name
    the field, not which side's option), and a prefill interleave needs prefill DCP > 1
    (`check_prefill_interleave`)."""
    # The decode side first: a prefill page size left out is --page-size's, named as such.
    for side, prefix in ((decode, "--"), (prefill, "--prefill-")):
        for key in ("page_size", "dcp_size", "interleave_size", "tp_size"):
            v = side[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(f"{prefix}{key.replace('_', '-')}={v!r} must be an int >= 1")
    try:
        check_prefill_interleave(prefill["dcp_size"], prefill["interleave_size"])
    except ValueError as exc:
        _fail(str(exc))


def hetero_transfer(model, prompt_tokens, prefill, decode, engine, seed, timeout_s, json_path, path=None) -> None:
    """``transfer`` for a TP / layout pair: one table per path, JSON, exit 1 if wrong. NIXL and
    Mooncake go through the connector, one process per rank (`dcp_jax.hetero.connector_job`), on
    the paths of ``--path`` (direct, region; default both); jax-transfer, whose batches are pulls,
    through the plan's direct engine path in one process (`dcp_jax.hetero.job`)."""
    from dcp_jax.hetero.connector_job import run_connector_job
    from dcp_jax.hetero.job import run_hetero_job

    _check_tokens(prompt_tokens)
    _check_seed(seed)
    _check_sides(prefill, decode)
    if engine not in ("nixl", "mooncake", "jax-transfer"):
        _fail(f"--engine={engine!r} must be nixl, mooncake or jax-transfer for a heterogeneous run")
    try:
        paths = parse_paths("direct,region" if path is None else path, ("direct", "region"))
    except ValueError as exc:
        _fail(f"{exc} (a TP or layout run)")
    _check_out_path(json_path, "--json")
    from dcp_jax.hetero.connector_job import check_job_size
    from dcp_jax.hetero.cost import hetero_sides
    from dcp_jax.transfer._worker import check_seconds

    try:  # everything the rank processes would refuse, before any starts
        check_seconds("--timeout-s", timeout_s)
        p, d, layers = hetero_sides(model, prefill, decode)
        check_job_size(p, d, layers, prompt_tokens)
    except (ValueError, TypeError) as exc:
        _fail(str(exc))
    results = []
    for mode in (["direct"] if engine == "jax-transfer" else paths):
        try:
            if engine == "jax-transfer":
                res = run_hetero_job(model, prompt_tokens, prefill, decode, engine=engine, seed=seed, timeout_s=timeout_s)
            else:
                res = run_connector_job(model, prompt_tokens, prefill, decode, engine=engine, mode=mode, seed=seed,
                                        timeout_s=timeout_s)
        except (ValueError, TypeError) as exc:
            _fail(str(exc))
        except (RuntimeError, TimeoutError) as exc:  # a rank failed or hung: its own error, exit 1
            _rank_failed(exc)
        results.append(res)
        hetero_table(res, model, prompt_tokens, engine)
    if json_path is not None:
        json_path.write_text(json.dumps(dict(runs=results, verified=all(r["verified"] for r in results)), indent=2,
                                        default=_json_default))
    if not all(r["verified"] for r in results):
        Console().print("[red bold]NOT VERIFIED[/]")
        raise typer.Exit(1)
    Console().print("[green bold]verified[/]: every decode (DCP, TP) rank byte-exact" +
                    (" on every path" if len(results) > 1 else ""))


def hetero_table(res: dict, model: str, prompt_tokens: int, engine: str) -> None:
    """Prints one heterogeneous run's table (per decode (DCP, TP) rank) and its failures."""
    console = Console()
    side = lambda x: (f"page {x['page_size']}, DCP{x['dcp_size']} I={x['interleave_size']}, "  # noqa: E731
                      f"TP{x['tp_size']}, {x['layout']}")
    t = Table(title=f"heterogeneous {model}, {prompt_tokens:,} tokens: prefill {side(res['prefill'])} -> decode "
                    f"{side(res['decode'])}; engine {engine}, path {res.get('mode', 'direct')}", show_footer=True)
    for name, footer in (("dcp rank", "all"), ("tp rank", ""), ("descriptors", f"{res['descriptors']:,}"),
                         ("bytes", f"{res['bytes']:,}"), ("verified", "yes" if res["verified"] else "NO")):
        t.add_column(name, footer=footer, justify="right")
    for r in res["ranks"]:
        t.add_row(str(r["dcp_rank"]), str(r["tp_rank"]), f"{r['descriptors']:,}",
                  f"{r['bytes']:,}" if "bytes" in r else "", "yes" if r["verified"] else "NO")
    if "processes" in res:
        t.caption = (f"connector (KVSender per prefill rank, KVReceiver per decode rank), {res['processes']} processes; "
                     f"{res['seconds']:.3f} s from send to the last decode rank's completion, {res['gbps']:.2f} GB/s"
                     + (f"; pack {res['pack_seconds']:.2f} s, unpack {res['unpack_seconds']:.2f} s (summed over ranks)"
                        if res.get("mode") == "region" else ""))
    else:
        t.caption = (f"{res['streams']} streams, {res['seconds']:.3f} s with engine start and registration "
                     f"(one process, loopback)")
    console.print(t)
    for r in res["ranks"]:
        if not r["verified"] and r.get("reason"):
            console.print(f"[red]decode rank ({r['dcp_rank']}, {r['tp_rank']}):[/] {r['reason']}")


def hetero_plan(model: str, prompt_tokens: int, prefill: dict, decode: dict, seed: int,
                 json_path: Optional[Path]) -> None:
    """The heterogeneous pair's table (`dcp_jax.hetero.cost.hetero_counts`): the plan's wire
    blocks per-layer and cross-layer, and what ``transfer --path direct`` posts (the same page
    tables as ``transfer`` for one --seed)."""
    from dcp_jax.hetero.cost import hetero_counts

    _check_tokens(prompt_tokens)
    _check_seed(seed)
    _check_sides(prefill, decode)
    _check_out_path(json_path, "--json")
    try:
        rows = hetero_counts(model, prompt_tokens, prefill, decode, seed=seed)
    except (ValueError, TypeError) as exc:
        _fail(str(exc))
    t = Table(title=f"heterogeneous plan: {model}, {prompt_tokens:,} tokens; prefill page {prefill['page_size']} "
                    f"DCP{prefill['dcp_size']} TP{prefill['tp_size']} {prefill['layout'] or 'default layout'} -> "
                    f"decode page {decode['page_size']} DCP{decode['dcp_size']} TP{decode['tp_size']} "
                    f"{decode['layout'] or 'default layout'}; descriptors per decode rank", show_footer=True)
    cols = [("dcp rank", "all"), ("tp rank", ""), ("rows (tokens x heads)", f"{sum(r['rows'] for r in rows):,}"),
            ("plan: per-layer", f"{sum(r['descriptors'] for r in rows):,}"),
            ("plan: cross-layer", f"{sum(r['cross_layer'] for r in rows):,}"),
            ("direct path posts", f"{sum(r['direct'] for r in rows):,}")]
    for name, footer in cols:
        t.add_column(name, footer=footer, justify="right")
    for r in rows:
        t.add_row(str(r["dcp_rank"]), str(r["tp_rank"]), f"{r['rows']:,}", f"{r['descriptors']:,}",
                  f"{r['cross_layer']:,}", f"{r['direct']:,}")
    Console().print(t)
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2))
