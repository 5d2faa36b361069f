"""The heterogeneous plan: where every token row (and GQA head range) goes between two sides that
differ in page size, DCP size and interleave, TP size and cache layout.

Conventions (``docs/conventions.md`` sections 2, 3, 10, each side with its own values): token t
lives on DCP rank ``owner(t)`` of its side at local index ``j = local_index(t)``, which is row
``page_table[j // P] * P + j % P`` of that rank's page table, i.e. (page, slot) =
``(page_table[j // P], j % P)``. The TP ranks of one DCP rank share its page table (they hold
different heads of the same tokens, as in vLLM and sglang).

TP head split (GQA, ``H`` KV heads): with ``H % T == 0`` TP rank r holds heads
``[r*H/T, (r+1)*H/T)``; with ``T % H == 0`` (more ranks than KV heads) each head is replicated
on ``T/H`` consecutive ranks, rank r holding head ``r // (T/H)`` (vLLM's replication). A decode
TP rank receives exactly the heads it holds; each head is sent by one prefill TP rank (the
lowest holding it). MLA's latent is replicated on every TP rank: it is sent once per decode TP
rank, by the one prefill TP rank ``mla_source_tp_rank``.

Ownership comes only from :mod:`dcp_jax.layout`; per-layout byte offsets and descriptor counts
from :mod:`dcp_jax.hetero.layouts`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dcp_jax._validate import check_int
from dcp_jax.layout import check_layout_args, local_index_np, local_len_np, owner_np
from dcp_jax.send_range import _pages
from dcp_jax.hetero.layouts import CacheGeometry, dtype_itemsize, layout_kind, run_descriptors

__all__ = ["HeteroSide", "HeteroPlan", "HeteroPlanError", "check_pair", "tp_head_range", "head_pieces",
           "build_hetero_plan",
           "descriptor_counts"]

_FIELDS = ("token", "src_dcp", "src_tp", "src_page", "src_slot", "src_head",
           "dst_dcp", "dst_tp", "dst_page", "dst_slot", "dst_head", "num_heads")


class HeteroPlanError(ValueError):
    """The two sides cannot be paired; ``field`` names what differs (``"dtype"``, ``"head_dim"``...)."""

    def __init__(self, field: str, prefill, decode, detail: str = ""):
        self.field, self.prefill, self.decode = field, prefill, decode
        super().__init__(f"heterogeneous pair refused: {field} differs (prefill {prefill!r}, decode "
                         f"{decode!r})" + (f": {detail}" if detail else ""))


@dataclasses.dataclass(frozen=True)
class HeteroSide:
    """One side's cache declaration.

    Attributes:
        page_size: tokens per page P, >= 1.
        dcp_size, interleave_size: the side's DCP group and ownership block (spec section 2).
        tp_size: TP ranks of the side; GQA needs ``num_kv_heads % tp_size == 0`` or
            ``tp_size % num_kv_heads == 0``.
        layout: a name of :data:`dcp_jax.hetero.layouts.LAYOUTS`.
        num_kv_heads: KV heads of the model (MLA: 1, the latent).
        head_dim: elements per head (MLA: latent width, 576 for DeepSeek-V3).
        dtype: element type name; both sides must agree (no silent conversion).

    Raises:
        TypeError, ValueError: a field out of range or a TP split that does not divide (named).
    """

    page_size: int
    dcp_size: int = 1
    interleave_size: int = 1
    tp_size: int = 1
    layout: str = "sglang_mla"
    num_kv_heads: int = 1
    head_dim: int = 576
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        check_layout_args(self.dcp_size, self.interleave_size)
        for name in ("page_size", "tp_size", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name), minimum=1)
        dtype_itemsize(self.dtype)
        tp_head_range(self.num_kv_heads, self.tp_size, 0, self.kind)
        self.geometry(0, 1)  # the layout's own limits (tpu_mla: page_size a multiple of its packing)

    @classmethod
    def from_spec(cls, spec) -> "HeteroSide":
        """The side a connector `dcp_jax.transfer.KVCacheSpec` declares.

        The connector's ``layout="mla"`` (one latent row per token) is ``"sglang_mla"`` here, and a
        missing ``head_dim`` is the latent width ``item_lens[0] / itemsize`` (MLA only).

        Raises:
            ValueError: a GQA layout without ``head_dim``, or a field `HeteroSide` refuses (named).
        """
        layout = "sglang_mla" if spec.layout == "mla" else spec.layout
        head_dim = spec.head_dim
        if head_dim is None:
            if layout_kind(layout) != "mla":
                raise ValueError(f"spec.head_dim must be given for the {layout!r} layout")
            head_dim = int(spec.item_lens[0]) // dtype_itemsize(spec.dtype)
        return cls(spec.page_size, spec.dcp_size, spec.interleave_size, spec.tp_size, layout, spec.num_kv_heads,
                   head_dim, spec.dtype)

    @property
    def kind(self) -> str:
        return layout_kind(self.layout)

    def heads(self, tp_rank: int) -> tuple[int, int]:
        """``(first global head, count)`` held by ``tp_rank``."""
        return tp_head_range(self.num_kv_heads, self.tp_size, tp_rank, self.kind)

    def geometry(self, tp_rank: int, num_pages: int) -> CacheGeometry:
        """The `CacheGeometry` of one layer on a rank of this side with ``num_pages`` pages."""
        return CacheGeometry(self.layout, num_pages, self.page_size, self.heads(tp_rank)[1], self.head_dim, self.dtype)


def tp_head_range(num_kv_heads: int, tp_size: int, tp_rank: int, kind: str = "gqa") -> tuple[int, int]:
    """Global KV heads ``(head0, count)`` that TP rank ``tp_rank`` holds (module docstring rule).

    Raises:
        ValueError: ``tp_rank`` out of range; MLA with ``num_kv_heads != 1``; GQA heads and TP
            size where neither divides the other (named).
    """
    tp_rank = check_int("tp_rank", tp_rank, minimum=0)
    if tp_rank >= tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be < tp_size={tp_size}")
    if kind == "mla":
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 for MLA (one latent), got {num_kv_heads=}")
        return 0, 1
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return tp_rank * per, per
    if tp_size % num_kv_heads == 0:
        return tp_rank // (tp_size // num_kv_heads), 1
    raise ValueError(f"num_kv_heads={num_kv_heads} and tp_size={tp_size}: one must divide the other")


def check_pair(prefill: HeteroSide, decode: HeteroSide) -> None:
    """Raises `HeteroPlanError` naming the first of dtype, kind, heads and head_dim that differ."""
    for field in ("dtype", "kind", "num_kv_heads", "head_dim"):
        a, b = getattr(prefill, field), getattr(decode, field)
        if a != b:
            detail = "the bytes would be reinterpreted; convert before sending" if field == "dtype" else ""
            raise HeteroPlanError(field, a, b, detail)


def head_pieces(prefill: HeteroSide, decode: HeteroSide, *, mla_source_tp_rank: int = 0) -> np.ndarray:
    """Which prefill TP rank sends which heads to which decode TP rank.

    Returns:
        int64 ``[k, 5]`` rows ``(src_tp, dst_tp, src_head, dst_head, num_heads)``; heads local
        to each rank, ordered by ``(src_tp, dst_tp)``. MLA: ``(mla_source_tp_rank, d, 0, 0, 1)``
        for every decode TP rank d.

    Raises:
        HeteroPlanError: the sides differ in dtype, kind, heads or head_dim.
        ValueError: ``mla_source_tp_rank`` out of range.
    """
    check_pair(prefill, decode)
    td = decode.tp_size
    if prefill.kind == "mla":
        s = check_int("mla_source_tp_rank", mla_source_tp_rank, minimum=0)
        if s >= prefill.tp_size:
            raise ValueError(f"mla_source_tp_rank={s} must be < prefill tp_size={prefill.tp_size}")
        out = np.zeros((td, 5), np.int64)
        out[:, 0], out[:, 1], out[:, 4] = s, np.arange(td), 1
        return out
    # The senders' head blocks, found by arithmetic (O(rows + decode TP), not O(prefill TP x
    # decode TP): the TP sizes come from a peer's hello): block k of `width` heads is sent by
    # prefill rank k * step, the lowest holding it (H % T == 0: every rank, H/T heads each; else
    # T % H == 0: head k, replicated on T/H ranks). Each decode rank's heads meet <= 2 + dn/width blocks.
    h, tp = prefill.num_kv_heads, prefill.tp_size
    width, step = (h // tp, 1) if h % tp == 0 else (1, tp // h)
    rows = []
    for d in range(td):
        d0, dn = decode.heads(d)
        for k in range(d0 // width, (d0 + dn - 1) // width + 1):
            lo, hi = max(k * width, d0), min((k + 1) * width, d0 + dn)
            rows.append((k * step, d, lo - k * width, lo - d0, hi - lo))
    rows.sort()  # by (src_tp, dst_tp): one piece per pair (both head ranges are contiguous)
    return np.array(rows, np.int64).reshape(-1, 5)


def _tables(name: str, tables: Sequence, dcp_size: int, page_size: int) -> np.ndarray:
    """Per-DCP-rank page tables as one int64 ``[dcp_size, max_len]`` array padded with -1; each
    checked as the DCP plans check theirs (1-D integers, ids >= 0, no id twice, rows in int64)."""
    if len(tables) != dcp_size:
        raise ValueError(f"{name} must hold one page table per DCP rank ({dcp_size}), got {len(tables)}")
    arrs = [_pages(f"{name}[{r}]", t, page_size) for r, t in enumerate(tables)]
    out = np.full((dcp_size, max([a.size for a in arrs] + [1])), -1, np.int64)
    for r, a in enumerate(arrs):
        out[r, :a.size] = a
    return out


def _checked_tables(name: str, side: HeteroSide, tables, stop: int) -> np.ndarray:
    """The side's page tables as one array, each checked to cover its rank's tokens below
    ``stop`` (before any per-token array is made: a huge ``stop`` fails here, not in an
    allocation of ``stop - start`` rows)."""
    n, i, p = side.dcp_size, side.interleave_size, side.page_size
    table = _tables(name, tables, n, p)
    need = -(-local_len_np(stop, n, np.arange(n), i) // p)
    have = (table >= 0).sum(axis=1)
    for r in np.flatnonzero(have < need):
        raise ValueError(f"{name}[{r}] has {int(have[r])} pages, {int(need[r])} required for tokens up to "
                         f"stop={stop}")
    return table


def _locate(side: HeteroSide, table: np.ndarray, t: np.ndarray):
    n, i, p = side.dcp_size, side.interleave_size, side.page_size
    rank, j = owner_np(t, n, i), local_index_np(t, n, i)
    return rank, table[rank, j // p], j % p


@dataclasses.dataclass(frozen=True)
class HeteroPlan:
    """Every (token, head range) move, as parallel int64 ``[k]`` arrays (see `build_hetero_plan`).

    Fields ``token``, ``src_dcp``, ``src_tp``, ``src_page``, ``src_slot``, ``src_head`` (first
    local head on the prefill rank), the same for ``dst_*``, and ``num_heads``. Rows are sorted
    by stream ``(src_dcp, src_tp, dst_dcp, dst_tp)``, then head piece, then token: a stream's
    rows in order are its wire block.
    """

    prefill: HeteroSide
    decode: HeteroSide
    token: np.ndarray
    src_dcp: np.ndarray
    src_tp: np.ndarray
    src_page: np.ndarray
    src_slot: np.ndarray
    src_head: np.ndarray
    dst_dcp: np.ndarray
    dst_tp: np.ndarray
    dst_page: np.ndarray
    dst_slot: np.ndarray
    dst_head: np.ndarray
    num_heads: np.ndarray

    def __len__(self) -> int:
        return int(self.token.size)

    def groups(self) -> list[tuple[tuple[int, ...], slice]]:
        """Maximal row slices of one stream and head piece: ``((src_dcp, src_tp, dst_dcp, dst_tp,
        src_head, dst_head, num_heads), slice)``; each is one wire block per layer."""
        keys = np.stack([self.src_dcp, self.src_tp, self.dst_dcp, self.dst_tp, self.src_head,
                         self.dst_head, self.num_heads], axis=1)
        if not len(self):
            return []
        starts = np.concatenate([[0], np.flatnonzero((np.diff(keys, axis=0) != 0).any(axis=1)) + 1, [len(self)]])
        return [(tuple(int(x) for x in keys[a]), slice(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]

    def runs(self, *, packed: bool = False) -> np.ndarray:
        """Runs: maximal row stretches of one group where both sides stay in one page at
        consecutive slots, so runs split only at page boundaries (the smaller page's when the
        sizes nest) and where the two sides' ownership diverges. ``packed=True``: the source is
        the stream's wire block (contiguous), so only the decode side splits runs.

        Returns:
            int64 ``[k, 2]`` of ``(first plan row, length)``.
        """
        if not len(self):
            return np.zeros((0, 2), np.int64)
        same = np.ones(len(self) - 1, bool)
        for f in ("src_dcp", "src_tp", "dst_dcp", "dst_tp", "src_head", "dst_head", "num_heads", "dst_page",
                  *(() if packed else ("src_page",))):
            a = getattr(self, f)
            same &= a[1:] == a[:-1]
        same &= np.diff(self.dst_slot) == 1
        if not packed:
            same &= np.diff(self.src_slot) == 1
        starts = np.concatenate([[0], np.flatnonzero(~same) + 1])
        return np.stack([starts, np.diff(np.concatenate([starts, [len(self)]]))], axis=1)


def build_hetero_plan(prefill: HeteroSide, decode: HeteroSide, start: int, stop: int, src_page_tables: Sequence,
                      dst_page_tables: Sequence, *, mla_source_tp_rank: int = 0) -> HeteroPlan:
    """Plans the move of tokens ``[start, stop)`` from every prefill rank to every decode rank.

    Args:
        prefill, decode: the two sides (their dtype, kind, heads and head_dim must agree).
        start, stop: token positions, ``0 <= start <= stop`` (prefix included).
        src_page_tables: one page table per prefill DCP rank (page ids of its local rows from 0).
        dst_page_tables: one page table per decode DCP rank (likewise).
        mla_source_tp_rank: the prefill TP rank that sends the MLA latent.

    Returns:
        a `HeteroPlan` with ``(stop - start) * pieces-per-token`` rows.

    Raises:
        HeteroPlanError: the sides cannot be paired (dtype mismatch, ...).
        TypeError, ValueError: bad range; a page table too short, negative, not 1-D or repeating
            a page id (two tokens would land in one slot), named as the DCP plans name theirs.
    """
    start = check_int("start", start, minimum=0)
    stop = check_int("stop", stop, minimum=0)
    if stop < start:
        raise ValueError(f"stop must be >= start, got {start=}, {stop=}")
    pieces = head_pieces(prefill, decode, mla_source_tp_rank=mla_source_tp_rank)
    src_table = _checked_tables("src_page_tables", prefill, src_page_tables, stop)
    dst_table = _checked_tables("dst_page_tables", decode, dst_page_tables, stop)
    t = np.arange(start, stop, dtype=np.int64)
    src = _locate(prefill, src_table, t)
    dst = _locate(decode, dst_table, t)
    k, n = len(pieces), t.size
    ti = np.tile(np.arange(n), k)            # token index of each row
    pi = np.repeat(np.arange(k), n)          # piece index of each row
    cols = {"token": t[ti], "src_dcp": src[0][ti], "src_page": src[1][ti], "src_slot": src[2][ti],
            "dst_dcp": dst[0][ti], "dst_page": dst[1][ti], "dst_slot": dst[2][ti]}
    for c, f in enumerate(("src_tp", "dst_tp", "src_head", "dst_head", "num_heads")):
        cols[f] = pieces[pi, c]
    order = np.lexsort((cols["token"], pi, cols["dst_tp"], cols["dst_dcp"], cols["src_tp"], cols["src_dcp"]))
    return HeteroPlan(prefill, decode, **{f: np.ascontiguousarray(cols[f][order]) for f in _FIELDS})


def descriptor_counts(plan: HeteroPlan, num_layers: int, *, cross_layer: bool = False, by: str = "dst"
                      ) -> dict[tuple[int, int], int]:
    """Descriptors per rank to land the plan directly in the decode caches from packed wire
    blocks (the source side is contiguous; runs are ``plan.runs(packed=True)``).

    Per-layer caches: each run costs `dcp_jax.hetero.layouts.run_descriptors` per layer.
    ``cross_layer=True`` models all layers of one decode page contiguous (vLLM's cross-layer
    blocks, wire packed page-major to match): a run filling a whole decode page with every head
    that rank holds is one descriptor for all layers; any other run costs as per-layer.

    Args:
        plan: the plan; num_layers: layer entries (>= 1).
        by: ``"dst"`` keys by decode ``(dcp_rank, tp_rank)``, ``"src"`` by prefill ranks.

    Returns:
        ``{(dcp_rank, tp_rank): descriptors}`` for every rank of that side (0 where nothing goes).
    """
    num_layers = check_int("num_layers", num_layers, minimum=1)
    if by not in ("dst", "src"):
        raise ValueError(f"by must be 'dst' or 'src', got {by=}")
    side = plan.decode if by == "dst" else plan.prefill
    counts = {(d, t): 0 for d in range(side.dcp_size) for t in range(side.tp_size)}
    runs = plan.runs(packed=True)
    if not runs.size:
        return counts
    first, length = runs[:, 0], runs[:, 1]
    heads, dst_tp = plan.num_heads[first], plan.dst_tp[first]
    per_run = np.zeros(len(runs), np.int64)
    for tp in range(plan.decode.tp_size):   # the per-layer formula depends on the heads a rank holds
        sel = dst_tp == tp
        geom = plan.decode.geometry(tp, 1)
        per_run[sel] = run_descriptors(geom, length[sel], heads[sel]) * num_layers
        if cross_layer:
            whole = (length[sel] == geom.page_size) & (heads[sel] == geom.num_heads) & (plan.dst_slot[first][sel] == 0)
            per_run[sel] = np.where(whole, 1, per_run[sel])
    keys = (plan.dst_dcp, plan.dst_tp) if by == "dst" else (plan.src_dcp, plan.src_tp)
    for (d, t), c in zip(zip(keys[0][first].tolist(), keys[1][first].tolist()), per_run.tolist()):
        counts[(d, t)] += c
    return counts
