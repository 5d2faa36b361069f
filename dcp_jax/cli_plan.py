"""``dcp-jax plan``: the cost report from the real plans (`dcp_jax.cost.plan_command`); a
heterogeneous pair's table comes from `dcp_jax.cli_hetero.hetero_plan`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from dcp_jax.cli_options import _check_out_path, _fail, _job_config, _json_default, check_plot_path, uses_hetero_job
from dcp_jax.geometry import DEFAULT_GEOMETRY, geometry_names

__all__ = ["plan"]


def plan(
    model: str = typer.Option(DEFAULT_GEOMETRY, help=f"Model KV geometry: {', '.join(geometry_names())}."),
    prompt_tokens: int = typer.Option(32768, help="Request length in tokens (prefix included)."),
    page_size: int = typer.Option(64, help="Tokens per KV page."),
    dcp_size: int = typer.Option(8, help="Decode DCP ranks N."),
    interleave_size: int = typer.Option(1, help="Decode-side interleave I (tokens)."),
    prefill_dcp_size: int = typer.Option(1, help="Prefill DCP ranks M."),
    prefill_interleave_size: int = typer.Option(1, help="Prefill-side interleave (tokens); needs "
                                                        "--prefill-dcp-size > 1."),
    prefix_tokens: int = typer.Option(0, help="Tokens decode already holds (not sent)."),
    chunk_tokens: Optional[int] = typer.Option(None, help="Chunked prefill: chunk length (tokens)."),
    mode: str = typer.Option("both", help="direct, packed or both."),
    path: Optional[list[str]] = typer.Option(None, metavar="PATHS", help="Paths to plan, one comma list of "
                                                  "direct, packed, region (one descriptor per window into "
                                                  "the decode rank's receive region) and fused (none: a "
                                                  "kernel writes through CUDA IPC), as transfer --path "
                                                  "(auto is chosen per peer: name the paths). Wins over --mode."),
    max_batch_indices: Optional[int] = typer.Option(None, help="Rows per engine batch window."),
    pack_tokens: Optional[int] = typer.Option(None, help="Pack buffer sized for this many tokens."),
    seed: int = typer.Option(0, help="Seeds the allocator-drawn page tables."),
    plot: Optional[Path] = typer.Option(None, help="Also draw descriptors per rank vs prompt length "
                                                   "(1k-256k tokens, log scale) to this image."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the per-rank rows as JSON to this path."),
    prefill_page_size: Optional[int] = typer.Option(None, help="Tokens per KV page on the prefill side "
                                                               "(default: --page-size)."),
    prefill_tp_size: int = typer.Option(1, help="Heterogeneous pair: prefill TP ranks."),
    tp_size: int = typer.Option(1, help="Heterogeneous pair: decode TP ranks."),
    prefill_layout: Optional[str] = typer.Option(None, help="Heterogeneous pair: prefill cache layout "
                                                            "(sglang_mla, tpu_mla, nhd, hnd, tpu_gqa)."),
    decode_layout: Optional[str] = typer.Option(None, help="Heterogeneous pair: decode cache layout."),
) -> None:
    """Cost report from the real plans: descriptors, engine calls and bytes per destination rank.

    The same plan options (not the run's: --engine, --device, --requests, --round-rows,
    --no-progress, ...), validation, page tables (the job's seeded allocators) and pack regions as
    ``transfer``, so for one configuration and --seed it prints the counts ``transfer`` reports
    (--prefill-page-size included: the connector's plan between the two page sizes).

    With a TP or layout option (--prefill-tp-size, --tp-size, --prefill-layout, --decode-layout)
    it switches, as ``transfer`` does, to the heterogeneous plan: descriptors per decode (DCP, TP)
    rank with per-layer caches beside the cross-layer page layout's, counted for the plan's
    wire blocks (a contiguous source), and the descriptors ``transfer --path direct`` posts
    (it reads through the prefill layout too: up to ~50x more with TP and an interleave; the
    same page tables for one --seed). Its region path posts one per (prefill rank, decode rank)
    pair that moves heads (per chunk).
    """
    from dcp_jax.cli_options import _one_list, parse_paths
    from dcp_jax.cost import PATH_MODES, plan_command

    path = _one_list(path, "--path")  # repeatable only so that a second --path is refused

    # The same switch as ``transfer``'s: a differing page size alone stays on the main job's plan.
    if uses_hetero_job(model, prefill_tp_size=prefill_tp_size, tp_size=tp_size, prefill_layout=prefill_layout,
                       decode_layout=decode_layout):
        from dcp_jax.cli_hetero import hetero_plan

        # Options the heterogeneous plan does not take: refused, not silently ignored.
        unused = [name for name, v, default in (
            ("--prefix-tokens", prefix_tokens, 0), ("--chunk-tokens", chunk_tokens, None), ("--mode", mode, "both"),
            ("--max-batch-indices", max_batch_indices, None), ("--pack-tokens", pack_tokens, None),
            ("--plot", plot, None), ("--path", path, None)) if v != default]
        if unused:
            _fail(f"{', '.join(unused)}: not taken by the heterogeneous plan (TP, page-size or layout options); "
                  "leave them out")

        hetero_plan(model, prompt_tokens, dict(page_size=page_size if prefill_page_size is None else prefill_page_size, dcp_size=prefill_dcp_size,
                                               interleave_size=prefill_interleave_size, tp_size=prefill_tp_size,
                                               layout=prefill_layout),
                    dict(page_size=page_size, dcp_size=dcp_size, interleave_size=interleave_size, tp_size=tp_size,
                         layout=decode_layout), seed, json_path)
        return  # the homogeneous table would plan another pair (no TP, one page size and layout)
    _job_config(
        mode, model=model, prompt_tokens=prompt_tokens, page_size=page_size, dcp_size=dcp_size,
        prefill_dcp_size=prefill_dcp_size, interleave_size=interleave_size,
        prefill_interleave_size=prefill_interleave_size, chunk_tokens=chunk_tokens, prefix_tokens=prefix_tokens,
        max_batch_indices=max_batch_indices, pack_tokens=pack_tokens, seed=seed, prefill_page_size=prefill_page_size,
    )
    try:
        paths = None if path is None else parse_paths(path, PATH_MODES)
    except ValueError as exc:
        _fail(f"{exc} ('auto' is chosen per peer at the handshake: name the paths)" if path and "auto" in
              path.split(",") else str(exc))
    try:
        check_plot_path(plot, "--plot")
    except ValueError as exc:
        _fail(str(exc))
    _check_out_path(json_path, "--json")
    try:
        rows = plan_command(
            model, prompt_tokens, page_size=page_size, dcp_size=dcp_size, interleave_size=interleave_size,
            prefill_dcp_size=prefill_dcp_size, prefill_interleave_size=prefill_interleave_size,
            decode_prefix_len=prefix_tokens, chunk_tokens=chunk_tokens, mode=mode, paths=paths,
            max_batch_indices=max_batch_indices, pack_max_tokens=pack_tokens, seed=seed,
            prefill_page_size=prefill_page_size, plot=str(plot) if plot else None, console=Console(),
        )
    except (ValueError, TypeError) as exc:
        _fail(str(exc))
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2, default=_json_default))
