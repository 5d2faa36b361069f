"""Cost report: descriptors, engine calls and bytes per destination rank, from the send model.

For one configuration (geometry, prompt length, decode prefix, chunking, page size, M, N, I and
the transfer mode) this module plans every prefill rank's sends with the connector's own model,
:class:`dcp_jax.transfer.schedule.TransferSchedule`, and reports its counts per destination
rank. There is no second counting model here: rows, bytes, descriptors, batches, notifications,
engine calls, packs and fallbacks are the schedule's.

- ``direct``: descriptors straight from the KV buffers, one per run of each window per layer
  entry; one batch per (chunk, source rank, destination rank, ``max_batch_indices`` window).
- ``packed``: each window is gathered into a pack region first, so only destination pages break
  runs; a region that cannot hold all rows gives one window per region-full (sliced sending),
  one that holds none the direct path with a logged warning.
- ``region``: gathered likewise, then ONE descriptor per window into the decode rank's receive
  region (the job's holds the rank's largest chunk share, so only the pack region cuts windows).
- ``fused``: no descriptor and no engine call (one kernel writes the ranks' pages through CUDA
  IPC; the control plane carries completion).

Page tables follow the connector's convention (spec section 10: every table covers its rank's
local rows from token 0). Pass them (``src_page_tables`` / ``dst_page_tables``), or let
:func:`page_tables` draw them as the main job does (:func:`dcp_jax.kv_data.draw_page_table`).
:class:`CostConfig`, :func:`page_tables`, :func:`job_page_tables` and :func:`region_rows` live in
:mod:`dcp_jax.cost_config`; every name stays importable from this module.
``plan_command`` is the single entry behind ``dcp-jax plan`` (the command lives in ``dcp_jax.cli_plan``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from dcp_jax.cost_config import (  # noqa: F401  (re-exported)
    MODES,
    PATH_MODES,
    CostConfig,
    Mode,
    _rows,
    job_page_tables,
    page_tables,
    region_rows,
)
from dcp_jax.plan import send_rows_per_rank
from dcp_jax.transfer.schedule import ScheduleCounts, TransferSchedule

__all__ = [
    "CostConfig",
    "job_page_tables",
    "page_tables",
    "region_rows",
    "cost_schedules",
    "cost_report",
    "cost_summary",
    "render_cost_table",
    "plot_descriptors_vs_prompt",
    "plan_command",
    "PLOT_PROMPT_TOKENS",
]

# Prompt lengths of the plot: 1k .. 256k tokens, powers of two.
PLOT_PROMPT_TOKENS: tuple[int, ...] = tuple(1024 << k for k in range(9))


def _tables(name: str, tables, expected: int, size_name: str) -> list[np.ndarray]:
    if tables is None:
        return None
    tables = list(tables)
    if len(tables) != expected:
        raise ValueError(f"{name} must hold one page table per rank ({size_name}={expected}), got {len(tables)}")
    return [np.asarray(t) for t in tables]


def _config(config: CostConfig | None, kwargs: dict) -> CostConfig:
    if config is None:
        return CostConfig(**kwargs)
    return dataclasses.replace(config, **kwargs) if kwargs else config


def cost_schedules(config: CostConfig | None = None, /, *, modes: Iterable[str] = MODES, src_page_tables=None,
                   dst_page_tables=None, engine_window: int | None = None, **kwargs
                   ) -> dict[str, list[TransferSchedule]]:
    """The :class:`TransferSchedule` of every prefill rank, per mode (what :func:`cost_report` counts).

    Args:
        config: a :class:`CostConfig`; or pass its fields as keyword arguments.
        modes: any of `PATH_MODES` (``"direct"``, ``"packed"``, ``"region"``, ``"fused"``);
            default `MODES` (direct and packed).
        src_page_tables: ``prefill_dcp_size`` page tables (i64[pages] each, section 10: local
            rows from token 0); default :func:`page_tables`. Given together with
            ``dst_page_tables`` or not at all.
        dst_page_tables: ``dcp_size`` page tables (section 10: local rows from token 0).
        engine_window: Mooncake's descriptors per submission; None counts NIXL's engine calls.

    Returns:
        ``{mode: [schedule of prefill rank 0, 1, ...]}``.

    Raises:
        ValueError: unknown mode, wrong number of tables, tables too short (named), or any
            invalid configuration value (named).
    """
    cfg = _config(config, kwargs)
    modes = tuple(modes)
    for mode in modes:
        if mode not in PATH_MODES:
            raise ValueError(f"modes must be among {PATH_MODES}, got {mode!r}")
    src_t = _tables("src_page_tables", src_page_tables, cfg.prefill_dcp_size, "prefill_dcp_size")
    dst_t = _tables("dst_page_tables", dst_page_tables, cfg.dcp_size, "dcp_size")
    if (src_t is None) != (dst_t is None):
        raise ValueError("pass src_page_tables and dst_page_tables together (or neither)")
    if src_t is None:
        src_t, dst_t = page_tables(cfg)
    srcs, dsts = cfg.layouts()
    chunks = [(a, a + k) for a, k in cfg.chunks()]
    return {mode: [TransferSchedule.build(
        src_spec_layout=src, dst_layouts=dsts, src_page_table=src_t[k], dst_page_tables=dst_t, chunks=chunks,
        num_layers=cfg.num_layers, item_lens=cfg.item_lens, mode=mode, max_batch_indices=cfg.max_batch_indices,
        max_region_rows=None if mode == "direct" else region_rows(cfg, k), engine_window=engine_window)
        for k, src in enumerate(srcs)] for mode in modes}


def cost_report(config: CostConfig | None = None, /, *, modes: Iterable[str] = MODES, src_page_tables=None,
                dst_page_tables=None, engine_window: int | None = None, **kwargs) -> list[dict]:
    """Descriptors, batches, engine calls and bytes per destination rank for each mode.

    Sums, per destination rank, the counts of every prefill rank's :class:`TransferSchedule`
    (:func:`cost_schedules`) over the chunks of the send range: ``dcp-jax plan`` prints the counts
    ``dcp-jax transfer`` reports.

    Args:
        config: a :class:`CostConfig`; or pass its fields as keyword arguments.
        modes: as :func:`cost_schedules`.
        src_page_tables, dst_page_tables, engine_window: as :func:`cost_schedules`.

    Returns:
        One dict per (mode, destination rank), ordered by mode then rank, with keys ``mode``,
        ``interleave_size``, ``prefill_dcp_size``, ``dst_rank``, ``rows`` (tokens per layer),
        ``bytes``, ``descriptors``, ``batches`` (engine batches of descriptors),
        ``engine_calls`` (NIXL: = batches; Mooncake: see
        :meth:`dcp_jax.transfer.schedule.RankChunk.engine_calls`), ``notifications`` (one per
        batch and one per empty (chunk, source rank) unit), ``packs`` (gathers; 0 for direct)
        and ``per_row_fallbacks`` (batches sent direct because the pack region holds no row).

    Raises:
        ValueError: as :func:`cost_schedules`.
    """
    cfg = _config(config, kwargs)
    _send_rows(cfg, cfg.prefill_dcp_size, cfg.prefill_interleave_size)  # validates the prefix, naming it
    _send_rows(cfg, cfg.dcp_size, cfg.interleave_size)
    schedules = cost_schedules(cfg, modes=modes, src_page_tables=src_page_tables, dst_page_tables=dst_page_tables,
                               engine_window=engine_window)
    out = []
    for mode, scheds in schedules.items():
        for d in range(cfg.dcp_size):
            c = sum((s.per_rank[d] for s in scheds if d in s.per_rank), ScheduleCounts())
            out.append(dict(mode=mode, interleave_size=cfg.interleave_size, prefill_dcp_size=cfg.prefill_dcp_size,
                            dst_rank=d, rows=c.rows, bytes=c.bytes, descriptors=c.descriptors, batches=c.batches,
                            engine_calls=c.engine_calls, notifications=c.notifications, packs=c.packs,
                            per_row_fallbacks=c.fallbacks))
    return out


def _send_rows(cfg: CostConfig, size: int, inter: int) -> list[int]:
    return send_rows_per_rank(
        cfg.prompt_tokens, dcp_size=size, interleave_size=inter, decode_prefix_len=cfg.decode_prefix_len
    )


def cost_summary(rows: Sequence[dict]) -> dict[str, dict[str, int]]:
    """Per mode: totals over ranks and the busiest rank's descriptors.

    Returns:
        ``{mode: {"descriptors", "engine_calls", "bytes", "rows", "max_descriptors_per_rank"}}``.
    """
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        s = out.setdefault(
            row["mode"],
            {"descriptors": 0, "engine_calls": 0, "bytes": 0, "rows": 0, "max_descriptors_per_rank": 0},
        )
        for key in ("descriptors", "engine_calls", "bytes", "rows"):
            s[key] += int(row[key])
        s["max_descriptors_per_rank"] = max(s["max_descriptors_per_rank"], int(row["descriptors"]))
    return out


def render_cost_table(rows: Sequence[dict], title: str | None = None):
    """A rich Table of a cost report: one line per (mode, destination rank) and a total per mode.

    Returns:
        ``rich.table.Table``.
    """
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (
        ("mode", "left"), ("I", "right"), ("dst rank", "right"), ("rows", "right"), ("MB", "right"),
        ("descriptors", "right"), ("engine calls", "right"), ("packs", "right"),
    ):
        table.add_column(col, justify=justify)
    summary = cost_summary(rows)
    last_mode = None
    for row in rows:
        if last_mode is not None and row["mode"] != last_mode:
            _add_total(table, last_mode, summary[last_mode], rows)
        last_mode = row["mode"]
        table.add_row(
            row["mode"], str(row["interleave_size"]), str(row["dst_rank"]), f"{row['rows']:,}",
            f"{row['bytes'] / 1e6:,.1f}", f"{row['descriptors']:,}", f"{row['engine_calls']:,}", f"{row['packs']:,}",
        )
    if last_mode is not None:
        _add_total(table, last_mode, summary[last_mode], rows)
    return table


def _add_total(table, mode: str, s: dict, rows: Sequence[dict]) -> None:
    packs = sum(r["packs"] for r in rows if r["mode"] == mode)
    table.add_row(
        f"[bold]{mode}[/bold]", "", "[bold]all[/bold]", f"{s['rows']:,}", f"{s['bytes'] / 1e6:,.1f}",
        f"[bold]{s['descriptors']:,}[/bold]", f"{s['engine_calls']:,}", f"{packs:,}", end_section=True,
    )


def plot_descriptors_vs_prompt(
    path: str,
    *,
    num_layers: int,
    item_lens: Sequence[int],
    page_size: int = 64,
    dcp_size: int = 8,
    prefill_dcp_size: int = 1,
    prompt_tokens: Sequence[int] = PLOT_PROMPT_TOKENS,
    chunk_tokens: int | None = None,
    title: str | None = None,
    seed: int = 0,
    prefill_page_size: int | None = None,
) -> dict[str, list[int]]:
    """Draws descriptors per destination rank (busiest rank) against prompt length, log-log.

    Four series, each from :func:`cost_report`: direct with token round-robin (I = 1), packed
    (I = 1), block round-robin direct (I = page size) and block round-robin + packed.

    Args:
        path: output image path (PNG by extension).
        num_layers, item_lens: the geometry.
        page_size, dcp_size, prefill_dcp_size: P, N, M.
        prompt_tokens: x values (tokens); default 1k .. 256k.
        chunk_tokens: chunked prefill (None: one chunk).
        title: plot title.
        seed: page-table seed.
        prefill_page_size: the prefill side's page size (None: ``page_size``).

    Returns:
        ``{series label: [descriptors per rank for each prompt length]}``.

    Raises:
        ValueError: the image cannot be written (missing folder, no permission, unknown format).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series_cfg = [
        ("direct, token round-robin (I=1)", 1, "direct"),
        ("packed, token round-robin (I=1)", 1, "packed"),
        (f"direct, block round-robin (I={page_size})", page_size, "direct"),
        (f"packed, block round-robin (I={page_size})", page_size, "packed"),
    ]
    series: dict[str, list[int]] = {label: [] for label, _, _ in series_cfg}
    for tokens in prompt_tokens:
        for inter in sorted({i for _, i, _ in series_cfg}):
            rows = cost_report(
                num_layers=num_layers, item_lens=tuple(item_lens), prompt_tokens=int(tokens), page_size=page_size,
                dcp_size=dcp_size, prefill_dcp_size=prefill_dcp_size, interleave_size=inter,
                chunk_tokens=chunk_tokens, seed=seed, prefill_page_size=prefill_page_size,
            )
            summary = cost_summary(rows)
            for label, i, mode in series_cfg:
                if i == inter:
                    series[label].append(summary[mode]["max_descriptors_per_rank"])
    fig, ax = plt.subplots(figsize=(7.5, 5))
    # Decreasing marker sizes and line widths keep coinciding series (packed and block
    # round-robin both reach one descriptor per destination page per layer) visible.
    for k, ((label, _, mode), marker) in enumerate(zip(series_cfg, "osD^")):
        ax.plot(
            prompt_tokens, series[label], marker=marker, markersize=10 - 2 * k, linewidth=3.0 - 0.6 * k,
            linestyle="-" if mode == "direct" else "--", label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("descriptors per decode rank")
    ax.set_xticks(list(prompt_tokens))
    ax.set_xticklabels([f"{t // 1024}k" for t in prompt_tokens])
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or f"{num_layers} layers, page {page_size}, DCP{prefill_dcp_size} -> DCP{dcp_size}")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise ValueError(f"plot={str(path)!r}: cannot write the image ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return series


def plan_command(
    model: str,
    prompt_tokens: int,
    *,
    page_size: int = 64,
    dcp_size: int = 8,
    interleave_size: int = 1,
    prefill_dcp_size: int = 1,
    prefill_interleave_size: int = 1,
    decode_prefix_len: int = 0,
    chunk_tokens: int | None = None,
    mode: str = "both",
    paths: Sequence[str] | None = None,
    max_batch_indices: int | None = None,
    pack_max_tokens: int | None = None,
    seed: int = 0,
    plot: str | None = None,
    num_layers: int | None = None,
    item_lens: Sequence[int] | None = None,
    console=None,
    engine_window: int | None = None,
    prefill_page_size: int | None = None,
) -> list[dict]:
    """The ``dcp-jax plan`` command: print the cost table (and optionally draw the plot).

    Args:
        model: geometry name for :func:`dcp_jax.geometry.get_geometry` (e.g. ``"deepseek-v3"``);
            ``num_layers`` / ``item_lens`` override it when both are given.
        prompt_tokens: request length (tokens).
        page_size, dcp_size, interleave_size, prefill_dcp_size, prefill_interleave_size,
        decode_prefix_len, chunk_tokens, max_batch_indices, pack_max_tokens, seed: as
            :class:`CostConfig`.
        prefill_page_size: the prefill side's page size (None: ``page_size``), as
            :class:`CostConfig` and the job's ``--prefill-page-size``.
        mode: ``"direct"``, ``"packed"`` or ``"both"``.
        paths: the modes to plan, any of `PATH_MODES` (as ``dcp-jax transfer --path``); wins
            over ``mode``.
        plot: when given, also write :func:`plot_descriptors_vs_prompt` to this path.
        num_layers, item_lens: explicit geometry.
        console: a ``rich.console.Console`` (default: a new one on stdout).
        engine_window: count Mooncake's engine calls with this window (None: NIXL's).

    Returns:
        The rows of :func:`cost_report`.

    Raises:
        ValueError: unknown model or mode, invalid configuration.
    """
    if mode not in ("direct", "packed", "both"):
        raise ValueError(f"mode must be 'direct', 'packed' or 'both', got {mode=}")
    if paths is not None:
        paths = tuple(paths)
        bad = [p for p in paths if p not in PATH_MODES]
        if bad or not paths:
            raise ValueError(f"paths={list(paths)!r} must name one or more of {', '.join(PATH_MODES)} "
                             "('auto' is chosen per peer at the handshake: name the paths)")
    if num_layers is None or item_lens is None:
        from dcp_jax.geometry import get_geometry

        geom = get_geometry(model)
        num_layers, item_lens = geom.num_layers, tuple(geom.kv_item_lens)
    modes = paths if paths is not None else MODES if mode == "both" else (mode,)
    rows = cost_report(
        num_layers=num_layers, item_lens=tuple(item_lens), prompt_tokens=prompt_tokens,
        decode_prefix_len=decode_prefix_len, chunk_tokens=chunk_tokens, page_size=page_size,
        prefill_dcp_size=prefill_dcp_size, prefill_interleave_size=prefill_interleave_size, dcp_size=dcp_size,
        interleave_size=interleave_size, max_batch_indices=max_batch_indices, pack_max_tokens=pack_max_tokens,
        seed=seed, modes=modes, engine_window=engine_window, prefill_page_size=prefill_page_size,
    )
    if console is None:
        from rich.console import Console

        console = Console()
    title = (
        f"{model}: {prompt_tokens:,} tokens (prefix {decode_prefix_len:,}), page {page_size}"
        + (f" (prefill {prefill_page_size})" if prefill_page_size not in (None, page_size) else "") + ", "
        f"DCP{prefill_dcp_size} (I={prefill_interleave_size}) -> DCP{dcp_size} (I={interleave_size})"
        + (f", chunks of {chunk_tokens:,}" if chunk_tokens else "")
    )
    console.print(render_cost_table(rows, title=title))
    if plot:
        plot_descriptors_vs_prompt(
            plot, num_layers=num_layers, item_lens=item_lens, page_size=page_size, dcp_size=dcp_size,
            prefill_dcp_size=prefill_dcp_size, chunk_tokens=chunk_tokens, seed=seed,
            prefill_page_size=prefill_page_size,
            title=f"{model}: descriptors per decode rank, page {page_size}, DCP{prefill_dcp_size} -> DCP{dcp_size}",
        )
        console.print(f"plot written to {plot}")
    return rows
