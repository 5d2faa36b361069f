"""Cost report: descriptors, engine calls and bytes per destination rank, from the real plans.

For one configuration (geometry, prompt length, decode prefix, chunking, page size, M, N, I and
the transfer mode) this module takes the page tables the main job draws (a seeded, shuffled
free list per rank, :func:`dcp_jax.kv_data.draw_page_table`) and its pack regions, builds every plan with :mod:`dcp_jax.plan`, and counts what a
sender would hand the engine:

- ``direct``: descriptors straight from the KV buffers, one per run of each plan window per
  layer entry; one engine call per (chunk, source rank, destination rank, window).
- ``packed``: the rows of each (chunk, source rank, destination rank) are gathered into the
  destination rank's pack region (:mod:`dcp_jax.packing`), so the source side is contiguous and
  only destination pages break runs; one engine call per slice that fits the region (and per
  ``max_batch_indices`` window), or the direct path with a logged warning when the region holds
  no row.

``plan_command`` is the single entry behind ``dcp-jax plan`` (the CLI lives in
``dcp_jax.cli``): it prints the table and can draw the descriptors-vs-prompt plot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.layout import check_layout_args
from dcp_jax.packing import choose_pack_strategy, pack_slices
from dcp_jax.plan import build_mxn_transfer_plans, send_rows_per_rank, split_windows
from dcp_jax.transfer_job import decode_owned_tokens, pack_region_rows

__all__ = [
    "CostConfig",
    "job_page_tables",
    "cost_report",
    "cost_summary",
    "render_cost_table",
    "plot_descriptors_vs_prompt",
    "plan_command",
    "PLOT_PROMPT_TOKENS",
]

Mode = Literal["direct", "packed"]
MODES: tuple[Mode, ...] = ("direct", "packed")

# Prompt lengths of the plot: 1k .. 256k tokens, powers of two.
PLOT_PROMPT_TOKENS: tuple[int, ...] = tuple(1024 << k for k in range(9))


@dataclasses.dataclass(frozen=True)
class CostConfig:
    """One transfer configuration of the cost report.

    Attributes:
        num_layers: layer entries (registered KV buffers).
        item_lens: bytes per row of each entry (``len == num_layers``).
        prompt_tokens: request length (tokens, prefix included).
        decode_prefix_len: tokens decode already holds (multiple of ``lcm(P*N, I*N)``); the send
            range is ``[decode_prefix_len, prompt_tokens)``.
        chunk_tokens: tokens per chunk of the send range (chunked prefill); None = one chunk.
        page_size: P, tokens per page on both sides.
        prefill_dcp_size: M.
        prefill_interleave_size: I_p.
        dcp_size: N.
        interleave_size: I.
        max_batch_indices: rows per engine batch (None: one batch per plan or slice).
        pack_max_tokens: tokens the pack buffer is sized for (``N * ceil(max/N) * sum(item_len)``
            bytes per prefill rank); None = the main job's default
            (:func:`dcp_jax.transfer_job.pack_region_rows`: the most rows one prefill rank sends
            to one decode rank, so nothing is sliced).
        seed: seed of the page allocators (the job's ``--seed``).
        pool_slack: each page pool is this many times the pages a rank needs (the job's
            ``pool_slack``).

    Raises:
        ValueError, TypeError: invalid values (named).
    """

    num_layers: int
    item_lens: tuple[int, ...]
    prompt_tokens: int
    decode_prefix_len: int = 0
    chunk_tokens: int | None = None
    page_size: int = 64
    prefill_dcp_size: int = 1
    prefill_interleave_size: int = 1
    dcp_size: int = 8
    interleave_size: int = 1
    max_batch_indices: int | None = None
    pack_max_tokens: int | None = None
    seed: int = 0
    pool_slack: float = 1.25

    def __post_init__(self) -> None:
        _int("num_layers", self.num_layers, minimum=1)
        lens = tuple(int(x) for x in self.item_lens)
        if len(lens) != self.num_layers:
            raise ValueError(f"item_lens needs one entry per layer: len(item_lens)={len(lens)}, num_layers={self.num_layers}")
        if min(lens) < 1:
            raise ValueError(f"item_lens must be >= 1 byte, got min {min(lens)}")
        object.__setattr__(self, "item_lens", lens)
        _int("prompt_tokens", self.prompt_tokens, minimum=0)
        _int("decode_prefix_len", self.decode_prefix_len, minimum=0)
        if self.decode_prefix_len > self.prompt_tokens:
            raise ValueError(
                f"decode_prefix_len must be <= prompt_tokens, got {self.decode_prefix_len=}, {self.prompt_tokens=}"
            )
        if self.chunk_tokens is not None:
            _int("chunk_tokens", self.chunk_tokens, minimum=1)
        if self.max_batch_indices is not None:
            _int("max_batch_indices", self.max_batch_indices, minimum=1)
        if self.pack_max_tokens is not None:
            _int("pack_max_tokens", self.pack_max_tokens, minimum=0)
        _int("page_size", self.page_size, minimum=1)
        _int("prefill_dcp_size", self.prefill_dcp_size, minimum=1)
        _int("prefill_interleave_size", self.prefill_interleave_size, minimum=1)
        check_layout_args(self.dcp_size, self.interleave_size)
        align = math.lcm(self.page_size * self.dcp_size, self.interleave_size * self.dcp_size)
        if self.decode_prefix_len % align:
            raise ValueError(f"decode_prefix_len={self.decode_prefix_len} must be a multiple of {align} "
                             f"(lcm(page_size*dcp_size, interleave_size*dcp_size))")
        _int("seed", self.seed, minimum=-(1 << 63))  # any int, as the job's --seed
        if isinstance(self.pool_slack, bool) or not isinstance(self.pool_slack, (int, float)) \
                or not self.pool_slack >= 1.0:
            raise ValueError(f"pool_slack={self.pool_slack!r} must be a number >= 1.0")

    @property
    def send_tokens(self) -> int:
        """Tokens moved: ``prompt_tokens - decode_prefix_len``."""
        return self.prompt_tokens - self.decode_prefix_len

    def chunks(self) -> list[tuple[int, int]]:
        """``(chunk_start, num_tokens)`` of each chunk of the send range, in order."""
        step = self.chunk_tokens or max(self.send_tokens, 1)
        return [
            (a, min(step, self.prompt_tokens - a)) for a in range(self.decode_prefix_len, self.prompt_tokens, step)
        ]


def job_page_tables(config: CostConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The page tables the main job (``dcp-jax transfer``) draws for this configuration and seed.

    Built by :func:`dcp_jax.transfer_job.request_page_tables` (which draws with
    :func:`dcp_jax.kv_data.draw_page_table`): every rank pops its pages from its own seeded,
    shuffled free list of a pool ``pool_slack`` times the pages it needs, exactly as the job's
    prefill and decode processes do. The tables do not depend on the geometry or the chunking.

    Args:
        config: the configuration (sizes, prefix, seed, ``pool_slack``).

    Returns:
        ``(src_tables, dst_tables)``: one int64 page table per prefill rank and per decode rank
        (empty tables when nothing is sent).
    """
    from dcp_jax.geometry import DEFAULT_GEOMETRY
    from dcp_jax.transfer_job import JobConfig, request_page_tables

    if config.send_tokens == 0:
        empty = np.zeros(0, np.int64)
        return [empty] * config.prefill_dcp_size, [empty] * config.dcp_size
    # The geometry and the chunking do not enter the tables; JobConfig only carries the sizes.
    job = JobConfig(
        model=DEFAULT_GEOMETRY, prompt_tokens=config.prompt_tokens, prefix_tokens=config.decode_prefix_len,
        page_size=config.page_size, dcp_size=config.dcp_size, prefill_dcp_size=config.prefill_dcp_size,
        interleave_size=config.interleave_size, prefill_interleave_size=config.prefill_interleave_size,
        seed=config.seed, pool_slack=config.pool_slack,
    )
    return request_page_tables(job)


def _send_rows(cfg: CostConfig, size: int, inter: int) -> list[int]:
    return send_rows_per_rank(
        cfg.prompt_tokens, dcp_size=size, interleave_size=inter, decode_prefix_len=cfg.decode_prefix_len
    )


def _windows_descs(plan, max_batch: int | None, num_layers: int, packed: bool) -> tuple[int, int]:
    """(descriptors, engine calls) of sending ``plan`` in ``max_batch`` windows."""
    wins = split_windows(plan, max_batch)
    runs = sum((w.packed_runs if packed else w.runs).shape[0] for w in wins)
    return runs * num_layers, len(wins)


def cost_report(config: CostConfig | None = None, /, *, modes: Iterable[str] = MODES, **kwargs) -> list[dict]:
    """Descriptors, engine calls and bytes per destination rank for each mode.

    Builds the real plans (:func:`dcp_jax.plan.build_mxn_transfer_plans`) for every chunk of the
    send range, on the main job's own page tables (:func:`job_page_tables`) and pack regions, and
    counts per destination rank: ``dcp-jax plan`` prints the counts ``dcp-jax transfer`` reports.

    Args:
        config: a :class:`CostConfig`; or pass its fields as keyword arguments.
        modes: any of ``"direct"``, ``"packed"``.

    Returns:
        One dict per (mode, destination rank), ordered by mode then rank, with keys ``mode``,
        ``interleave_size``, ``prefill_dcp_size``, ``dst_rank``, ``rows`` (tokens per layer),
        ``bytes``, ``descriptors``, ``engine_calls``, ``packs`` (gathers; 0 for direct) and
        ``per_row_fallbacks`` (batches that fell back to per-row descriptors).

    Raises:
        ValueError: unknown mode, or any invalid configuration value (named).
    """
    cfg = config if config is not None else CostConfig(**kwargs)
    if config is not None and kwargs:
        cfg = dataclasses.replace(config, **kwargs)
    modes = tuple(modes)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"modes must be among {MODES}, got {mode!r}")
    m, n = cfg.prefill_dcp_size, cfg.dcp_size
    lens = np.asarray(cfg.item_lens, np.int64)
    row_bytes = int(lens.sum())
    _send_rows(cfg, m, cfg.prefill_interleave_size)  # validates the prefix alignment, naming it
    _send_rows(cfg, n, cfg.interleave_size)
    src_tables, dst_tables = job_page_tables(cfg)
    # Each prefill rank's pack regions, sized as the job sizes them (pack_region_rows).
    region_bytes = []
    for k in range(m):
        tokens = decode_owned_tokens(cfg.decode_prefix_len, cfg.prompt_tokens, m, k, cfg.prefill_interleave_size)[0]
        rows, _ = pack_region_rows(tokens, dcp_size=n, interleave_size=cfg.interleave_size,
                                   prefix_tokens=cfg.decode_prefix_len, chunk_tokens=cfg.chunk_tokens,
                                   pack_tokens=cfg.pack_max_tokens)
        region_bytes.append(rows * row_bytes)

    zero = {"rows": 0, "bytes": 0, "descriptors": 0, "engine_calls": 0, "packs": 0, "per_row_fallbacks": 0}
    acc = {(mode, d): dict(zero) for mode in modes for d in range(n)}
    for chunk_start, num in cfg.chunks():
        plans = build_mxn_transfer_plans(
            src_tables, dst_tables, page_size=cfg.page_size, prefill_dcp_size=m,
            prefill_interleave_size=cfg.prefill_interleave_size, dcp_size=n, interleave_size=cfg.interleave_size,
            decode_prefix_len=cfg.decode_prefix_len, chunk_start=chunk_start, num_kv_tokens=num,
        )
        for (k, d), plan in plans.items():
            for mode in modes:
                row = acc[(mode, d)]
                row["rows"] += plan.num_rows
                row["bytes"] += plan.num_rows * row_bytes
                if mode == "direct":
                    descs, calls = _windows_descs(plan, cfg.max_batch_indices, cfg.num_layers, packed=False)
                else:
                    region = region_bytes[k]
                    strategy = choose_pack_strategy(plan.num_rows, region, lens)
                    if strategy == "per_row":
                        descs, calls = _windows_descs(plan, cfg.max_batch_indices, cfg.num_layers, packed=False)
                        row["per_row_fallbacks"] += calls
                    else:
                        descs = calls = 0
                        slices = pack_slices(plan.num_rows, region, lens)
                        row["packs"] += len(slices)
                        for a, b in slices:
                            k, c = _windows_descs(plan.window(a, b), cfg.max_batch_indices, cfg.num_layers, True)
                            descs += k
                            calls += c
                row["descriptors"] += descs
                row["engine_calls"] += calls
    return [
        {
            "mode": mode,
            "interleave_size": cfg.interleave_size,
            "prefill_dcp_size": m,
            "dst_rank": d,
            **acc[(mode, d)],
        }
        for mode in modes
        for d in range(n)
    ]


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
                chunk_tokens=chunk_tokens, seed=seed,
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
    max_batch_indices: int | None = None,
    pack_max_tokens: int | None = None,
    seed: int = 0,
    plot: str | None = None,
    num_layers: int | None = None,
    item_lens: Sequence[int] | None = None,
    console=None,
) -> list[dict]:
    """The ``dcp-jax plan`` command: print the cost table (and optionally draw the plot).

    Args:
        model: geometry name for :func:`dcp_jax.geometry.get_geometry` (e.g. ``"deepseek-v3"``);
            ``num_layers`` / ``item_lens`` override it when both are given.
        prompt_tokens: request length (tokens).
        page_size, dcp_size, interleave_size, prefill_dcp_size, prefill_interleave_size,
        decode_prefix_len, chunk_tokens, max_batch_indices, pack_max_tokens, seed: as
            :class:`CostConfig`.
        mode: ``"direct"``, ``"packed"`` or ``"both"``.
        plot: when given, also write :func:`plot_descriptors_vs_prompt` to this path.
        num_layers, item_lens: explicit geometry.
        console: a ``rich.console.Console`` (default: a new one on stdout).

    Returns:
        The rows of :func:`cost_report`.

    Raises:
        ValueError: unknown model or mode, invalid configuration.
    """
    if mode not in ("direct", "packed", "both"):
        raise ValueError(f"mode must be 'direct', 'packed' or 'both', got {mode=}")
    if num_layers is None or item_lens is None:
        from dcp_jax.geometry import get_geometry

        geom = get_geometry(model)
        num_layers, item_lens = geom.num_layers, tuple(geom.kv_item_lens)
    modes = MODES if mode == "both" else (mode,)
    rows = cost_report(
        num_layers=num_layers, item_lens=tuple(item_lens), prompt_tokens=prompt_tokens,
        decode_prefix_len=decode_prefix_len, chunk_tokens=chunk_tokens, page_size=page_size,
        prefill_dcp_size=prefill_dcp_size, prefill_interleave_size=prefill_interleave_size, dcp_size=dcp_size,
        interleave_size=interleave_size, max_batch_indices=max_batch_indices, pack_max_tokens=pack_max_tokens,
        seed=seed, modes=modes,
    )
    if console is None:
        from rich.console import Console

        console = Console()
    title = (
        f"{model}: {prompt_tokens:,} tokens (prefix {decode_prefix_len:,}), page {page_size}, "
        f"DCP{prefill_dcp_size} (I={prefill_interleave_size}) -> DCP{dcp_size} (I={interleave_size})"
        + (f", chunks of {chunk_tokens:,}" if chunk_tokens else "")
    )
    console.print(render_cost_table(rows, title=title))
    if plot:
        plot_descriptors_vs_prompt(
            plot, num_layers=num_layers, item_lens=item_lens, page_size=page_size, dcp_size=dcp_size,
            prefill_dcp_size=prefill_dcp_size, chunk_tokens=chunk_tokens, seed=seed,
            title=f"{model}: descriptors per decode rank, page {page_size}, DCP{prefill_dcp_size} -> DCP{dcp_size}",
        )
        console.print(f"plot written to {plot}")
    return rows
