"""Many pack regions in one call: `pack_windows` gathers every window of a sender's round (one
region per decode rank, each at its own offset of the pack) with ONE kernel launch.

A round of the connector packs W windows (8 decode ranks: 8 regions). `pack_rows` per window
costs one jitted dispatch, one index staging and one set of checks each (about 0.6 ms of host
time per call on an H200, so ~5 ms per round); `pack_windows` pays them once.

How one kernel serves W regions (`window_blocks`): the windows' row indices are laid end to
end in one index vector, each window starting at a multiple of `block_rows`, so every row block
(one kernel program) lies in exactly one window. A per-block table i32[num_blocks, 4] gives the
block its window's (offset units, row count, first row of the block, ok); the kernel body is
`pallas_kernels.triton_gather.gather_kernel` with `windowed=True`, so the layer-major layout and the
address arithmetic (uint32 words) are the ones of `gather_rows`. Blocks past the last window
have ok = 0 and write nothing. What compiles: one kernel per (index bucket
`bucket_rows(sum of block-rounded window rows)`, shapes, config, backend, offset_align); the
number of windows, their offsets and row counts are traced values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._args import offset_arg, static_validate
from pallas_kernels.config import GatherConfig, bucket_rows, select_backend
from pallas_kernels.gather import _STATIC_ARGNAMES, gather_rows_reference
from pallas_kernels.row_copy import preload_lowering
from pallas_kernels.triton_gather import gather_call

__all__ = ["gather_windows", "gather_windows_reference", "window_blocks", "windows_bucket"]


#: The table's columns hold each window's row count as int32 and its offset units as uint32 bits.
_MAX_COUNT = 2**31 - 1
_MAX_UNITS = 2**32 - 1


def _int_list(values, name: str, hi: int) -> list[int]:
    """``values`` (a sequence or 1-D array of ints) as Python ints in [0, hi].

    Plain Python over the handful of windows of a round (no numpy call per entry): this runs
    before every windowed kernel launch.

    Raises:
        TypeError: not a sequence or 1-D array, or an entry that is not an int (bool and float
            refused: a silent truncation would move or shorten a window).
        ValueError: an entry outside [0, hi] (it would wrap in the table's 32-bit column).
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not (values.dtype.kind in "iu" or values.size == 0):
            raise TypeError(f"{name} must be a 1-D integer array, got {values.dtype}[{values.shape}]")
        out = values.tolist()
    else:
        try:
            out = list(values)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None
        for i, v in enumerate(out):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}[{i}]={v!r} must be an int, not {type(v).__name__}")
        out = [int(v) for v in out]
    if out and (min(out) < 0 or max(out) > hi):
        i = next(i for i, v in enumerate(out) if not 0 <= v <= hi)
        raise ValueError(f"{name}[{i}]={out[i]} must be in [0, {hi}] (the table's 32-bit column)")
    return out


def window_blocks(counts, units, block_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The index layout and per-block table of windows for one windowed kernel call.

    Args:
        counts: int[W] rows of each window, in [0, 2**31 - 1] (an int32 column).
        units: int[W] each window's offset in units of the kernel's `offset_align` words, in
            [0, 2**32 - 1] (uint32 values; `offset_arg` gives them).
        block_rows: the kernel's rows per program (a power of 2 >= 1, `config.block_rows`).

    Returns:
        (starts, blocks, m): starts i64[W], where window w's indices begin in the index
        vector (multiples of `block_rows`); blocks i32[m // block_rows * 4], per row block
        (offset units as uint32 bits, window rows, first window row of the block, ok);
        m = `bucket_rows(sum of ceil(counts / block_rows) * block_rows)`, the index length.
        A layout is computed once per (counts, units, block_rows) and kept; each call gets
        its own copy of the arrays.

    Raises:
        TypeError: counts, units or block_rows not ints (bool and float refused), or counts /
            units not a sequence or 1-D array.
        ValueError: a count or unit outside its range above, counts and units of different
            lengths, block_rows not a power of 2 >= 1.
    """
    # A round has a handful of windows: Python ints and ONE repeat of a small per-window table
    # (a kernel launch's host time on a slow host was mostly numpy calls here).
    block_rows = _block_rows(block_rows)
    counts = _int_list(counts, "counts", _MAX_COUNT)
    units = _int_list(units, "units", _MAX_UNITS)
    if len(counts) != len(units):
        raise ValueError(f"counts ({len(counts)}) and units ({len(units)}) must have one entry "
                         "per window")
    key = (block_rows, tuple(counts), tuple(units))
    hit = _LAYOUTS.get(key)
    if hit is None:
        hit = _window_layout(counts, units, block_rows)
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[key] = hit
    starts, table, m = hit
    return starts.copy(), table.copy(), m  # the caller's own arrays (a few KB): the cache stays as computed


#: Layouts already computed, by (block_rows, counts, units): a serving loop's rounds repeat a few
#: shapes (one per chunk size and rank set), and the numpy work below was ~0.13 ms of a fused
#: launch's host time on the H200 host after an idle spell. Kept read-only; callers get copies.
_LAYOUTS: dict = {}
_MAX_LAYOUTS = 256


def windows_bucket(counts, block_rows: int) -> int:
    """m of `window_blocks`: the index length of a windowed launch of windows of `counts` rows
    (each rounded up to whole row blocks; then `bucket_rows`), without the layout.

    Raises:
        TypeError, ValueError: as `window_blocks` for `counts` and `block_rows`.
    """
    return _bucket(_int_list(counts, "counts", _MAX_COUNT), _block_rows(block_rows))


def _block_rows(block_rows) -> int:
    if isinstance(block_rows, bool) or not isinstance(block_rows, (int, np.integer)):
        raise TypeError(f"block_rows={block_rows!r} must be an int, not {type(block_rows).__name__}")
    block_rows = int(block_rows)
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of 2 >= 1")
    return block_rows


def _bucket(counts: list, block_rows: int) -> int:
    return bucket_rows(sum(-(-c // block_rows) for c in counts) * block_rows, block_rows)


def _window_layout(counts: list, units: list, block_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """`window_blocks` of checked Python ints (the arrays made read-only: they are kept)."""
    nb = [-(-c // block_rows) for c in counts]
    first, used = [], 0
    for b in nb:
        first.append(used)
        used += b
    starts = np.array(first, np.int64) * block_rows
    m = _bucket(counts, block_rows)
    table = np.zeros((m // block_rows, 4), np.int32)
    if used:
        # per window: (offset units as uint32 bits, rows, -first block, ok); the third column
        # becomes each block's first window row once the block number is added.
        per = np.array([(u, c, -f, 1) for u, c, f in zip(units, counts, first)], np.int64)
        rep = np.repeat(per, nb, axis=0)
        rep[:, 2] += np.arange(used)
        rep[:, 2] *= block_rows
        table[:used] = rep.astype(np.uint32).view(np.int32)
    table = table.reshape(-1)
    starts.flags.writeable = table.flags.writeable = False
    return starts, table, m


def gather_windows(src, indices, pack, blocks, *, config: GatherConfig = GatherConfig(),
                   backend: str = "auto", offset_align: int = 1) -> jax.Array:
    """`gather_rows` of several regions of one pack in one kernel launch, in place.

    Window w (rows `indices[starts[w]:starts[w] + counts[w]]`, at word offset
    `units[w] * offset_align`) is written exactly as `gather_rows` writes one region; no
    other word of the pack changes. Build `indices` and `blocks` with `window_blocks`.

    Args:
        src: u32/u16/u8[L, R, W] (stacked) or a list of u*[R_l, W_l] word arrays.
        indices: int[m] (m a multiple of `config.block_rows`): each window's source rows from
            its `starts` entry on; other entries are ignored (any value; clamped to [0, R-1]).
        pack: 1-D array of the src dtype, donated; the result aliases its memory.
        blocks: i32[4 * m // block_rows], the per-block table of `window_blocks` (traced).
            Windows are clamped, as in `gather_rows`, so no store passes the addressable words.
            Overlapping windows are not checked here (`pack_windows` refuses them).
        config: `GatherConfig` (static).
        backend: "auto", "triton" or "interpret" (static; "mosaic" has no windowed form).
        offset_align: power of 2 in [1, 16] dividing every window's word offset (static).

    Returns:
        The pack, written in place when it was donated.

    Raises:
        ValueError: bad shapes (as `gather_rows`), `indices` not a multiple of
            `config.block_rows` long, `blocks` of the wrong length, backend "mosaic".
        TypeError: as `gather_rows` (dtypes).
    """
    backend = select_backend(backend)
    if backend == "mosaic":
        raise ValueError("backend='mosaic' has no windowed form; use 'triton' or 'interpret' "
                         "(or pack_rows per window)")
    m, br = int(indices.shape[0]), config.block_rows
    if m % br:
        raise ValueError(f"indices has {m} entries, not a multiple of block_rows={br}")
    if tuple(blocks.shape) != (4 * (m // br),):
        raise ValueError(f"blocks must be i32[{4 * (m // br)}] (4 per row block), got shape "
                         f"{tuple(blocks.shape)}")
    preload_lowering(backend)
    return _gather_windows_jit(src, indices, pack, blocks, config=config, backend=backend,
                               offset_align=int(offset_align))


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES + ("m", "table_len"), donate_argnames=("pack",))
def _gather_windows_slot_jit(src, slot, pack, *, m, table_len, config, backend, offset_align):
    """`_gather_windows_jit` with its indices and block table in one mapped slot
    (`mapped_ring`), copied to device memory first, in this call."""
    from pallas_kernels.mapped_ring import split_slot, to_device

    (indices,), blocks = split_slot(to_device(slot), m, 1, table_len)
    return _gather_windows_jit(src, indices, pack, blocks, config=config, backend=backend,
                               offset_align=offset_align)


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES, donate_argnames=("pack",))
def _gather_windows_jit(src, indices, pack, blocks, *, config, backend, offset_align):
    """`gather_windows` after its checks: the windowed Triton-form kernel."""
    stacked, shapes = static_validate(src, indices, pack)
    if int(indices.shape[0]) == 0:
        return pack
    idx = indices if indices.dtype == jnp.int32 else indices.astype(jnp.int32)
    return gather_call(src, idx, pack, blocks.astype(jnp.int32), shapes=tuple(shapes),
                       stacked=stacked, config=config, interpret=backend == "interpret",
                       offset_align=offset_align, windowed=True)


def gather_windows_reference(src, windows, pack) -> jax.Array:
    """The oracle: `gather_rows_reference` once per window, in order.

    Args:
        src: as `gather_rows_reference`.
        windows: sequence of (indices int[n_w], word offset int) pairs.
        pack: 1-D word array (not modified).

    Returns:
        A copy of `pack` with every window's region written.
    """
    out = jnp.asarray(pack)
    for idx, off in windows:
        out = gather_rows_reference(src, jnp.asarray(np.asarray(idx, np.int32)), out,
                                    offset=int(off))
    return out


def _check_offsets(word_offsets, offset_align, backend, itemsize):
    """Each window's offset as the kernel's uint32 units (`offset_arg`'s checks)."""
    return [int(np.int32(offset_arg(o, offset_align, backend, itemsize)[0]).view(np.uint32))
            for o in word_offsets]
