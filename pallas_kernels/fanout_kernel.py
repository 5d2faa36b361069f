"""The fan-out kernel: rows of one stacked source into D flat destinations in one launch, and
`fanout_kernel`, its entry on JAX arrays (tests, tools). `pallas_kernels.fanout.copy_fanout`
launches it for a round of `RowCopier`s.

How one kernel serves D destinations (as `pallas_kernels.windows` does for pack regions): the
windows' source and destination indices lie end to end, each window starting at a multiple of
`block_rows`, so every row block (one program) lies in one window. A per-block table
i32[num_blocks * 4] gives the block its (destination k, window rows, first row of the block,
ok). The program (row block i, layer g) copies rows of layer g of the stacked source
(`BlockSpec` `(None, R, W)`) into destination k's flat buffer at word `g * R_k * W + row * W`
(uint32 addresses). Blocks past the last window have ok = 0 and write nothing.

Moved out of `pallas_kernels.fanout`, which re-exports every name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.config import GatherConfig
from pallas_kernels.mapped_ring import split_slot, to_device
from pallas_kernels.row_copy import U32, IndexedRows, RegionRows, copy_block, count_kernel_trace
from pallas_kernels.windows import window_blocks

__all__ = ["fanout_kernel"]


def _fanout_body(table_ref, sidx_ref, didx_ref, src_ref, *refs, first_layer, dst_rows, width,
                 block_rows, num_src_rows, evict, load_evict, load_cache, interleave, interpret):
    D = len(dst_rows)
    outs = refs[D:]
    g = pl.program_id(1)  # layer g of this source: layer first_layer + g of the destinations
    k, n, first, ok = table_ref[0], table_ref[1], table_ref[2], table_ref[3]
    rows = first + jnp.arange(block_rows, dtype=jnp.int32)
    valid = jnp.logical_and(rows < n, ok != 0)
    sidx = jnp.where(valid, jnp.clip(sidx_ref[...], 0, num_src_rows - 1), 0)
    src = IndexedRows(src_ref, sidx, evict=load_evict, cache=load_cache)  # layer g: [R, W]
    for kk in range(D):
        @pl.when(k == kk)
        def _(kk=kk):
            R = dst_rows[kk]
            # Masked rows store nothing; in the interpreter (which writes the old bytes back) they
            # point one row past the layer, never at a live row of this program.
            didx = jnp.where(valid, jnp.clip(didx_ref[...], 0, R - 1), R if interpret else 0)
            base = (g + first_layer).astype(U32) * U32(R * width)
            copy_block([(src, RegionRows(outs[kk], base, didx, width, mask=valid, evict=evict),
                         width)], interleave=interleave)


def _fanout_call(src, sidx, dsts, didx, table, *, first_layer, dst_rows, config, backend):
    """src u-word[L_j, R, W]: layers [first_layer, first_layer + L_j) of the stack; sidx/didx
    i32[m]; dsts: D flat word arrays (L * R_k * W each, L the whole stack's layers), donated;
    table i32[4 * m // block_rows]. Returns the D destinations, written in place."""
    from jax.experimental.pallas import triton as pltriton

    count_kernel_trace(f"copy_fanout src={tuple(src.shape)}@{first_layer} idx={tuple(sidx.shape)} "
                       f"dst_rows={tuple(dst_rows)}")
    L, R, W = (int(d) for d in src.shape)
    br = config.block_rows
    m = int(sidx.shape[0])
    interpret = backend == "interpret"
    body = functools.partial(
        _fanout_body, first_layer=first_layer, dst_rows=tuple(dst_rows), width=W, block_rows=br,
        num_src_rows=R, evict=config.eviction_policy, load_evict=config.load_eviction_policy,
        load_cache=config.load_cache_modifier, interleave=config.interleave, interpret=interpret)
    dst_specs = [pl.BlockSpec((int(d.shape[0]),), lambda i, l: (0,)) for d in dsts]
    call = pl.pallas_call(
        body,
        grid=(m // br, L),
        in_specs=[pl.BlockSpec((4,), lambda i, l: (i,)), pl.BlockSpec((br,), lambda i, l: (i,)),
                  pl.BlockSpec((br,), lambda i, l: (i,)),
                  pl.BlockSpec((None, R, W), lambda i, l: (l, 0, 0)), *dst_specs],
        out_specs=dst_specs,
        out_shape=[jax.ShapeDtypeStruct(d.shape, d.dtype) for d in dsts],
        input_output_aliases={4 + k: k for k in range(len(dsts))},
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"kv_copy_fanout_{br=}_D={len(dsts)}_{L=}",
    )
    return tuple(call(table, sidx, didx, src, *dsts))


_STATIC = ("first_layer", "dst_rows", "config", "backend")
_fanout_jit = jax.jit(_fanout_call, static_argnames=_STATIC, donate_argnames=("dsts",))


@functools.partial(jax.jit, static_argnames=_STATIC + ("m", "table_len"), donate_argnames=("dsts",))
def _fanout_slot_jit(src, slot, dsts, *, m, table_len, **static):
    """`_fanout_jit` with its indices in one `mapped_ring` slot (sidx, didx, then the table):
    copied to device memory first, in this call (`mapped_ring.to_device`)."""
    (sidx, didx), table = split_slot(to_device(slot), m, 2, table_len)
    return _fanout_call(src, sidx, dsts, didx, table, **static)


def _fanout_groups(srcs, sidx, dsts, didx, table, **static):
    """`_fanout_jit` once per layer group of the stack (in order; each launch takes the
    previous one's outputs): one launch for a stack under 2**31 words. With ``sidx`` a mapped
    slot (`mapped_ring`) and ``didx`` / ``table`` None, `_fanout_slot_jit` (``static`` then
    also holds its ``m`` and ``table_len``)."""
    first = 0
    for src in srcs:
        if didx is None:
            dsts = _fanout_slot_jit(src, sidx, tuple(dsts), first_layer=first, **static)
        else:
            dsts = _fanout_jit(src, sidx, tuple(dsts), didx, table, first_layer=first, **static)
        first += int(src.shape[0])
    return tuple(dsts)


def fanout_kernel(src, windows, dsts, *, config, backend="interpret"):
    """The kernel on JAX arrays (tests, tools): `dsts[k][layer l, row didx] = src[l, sidx]` for
    each window (k, sidx, didx).

    Args:
        src: u-word[L, R, W] (stacked layers), or a list (or tuple) of layer groups u-word[L_j, R, W] of
            one R, W and dtype, in layer order (L = sum of L_j: how a stack past 2**31 words
            is passed, `device.stacked_groups`).
        windows: sequence of (k, sidx int[n], didx int[n]): destination index, rows.
        dsts: list of D flat word arrays of L * R_k * W words (L layers [R_k, W] back to back),
            donated.
        config: `GatherConfig` (static); backend: "interpret" (CPU) or "triton".

    Returns:
        The tuple of D destinations.

    Raises:
        ValueError: `src` not 3-D (or groups of different rows, widths or dtypes, a group
            without layers, rows of no words), a destination not a flat array of whole layers
            of `src`'s dtype, a `backend` other than the two above, a window that is not a (k, sidx, didx) triple, whose destination or rows are
            out of range, whose index lists differ in length or are not integers, or that
            writes a destination row twice (within it or with an earlier window).
        TypeError: `config` not a `GatherConfig`.
    """
    srcs = tuple(src) if isinstance(src, (list, tuple)) else (src,)
    if not srcs or any(getattr(a, "ndim", 0) != 3 for a in srcs):
        raise ValueError("src must be a stacked [L, R, W] word array or a list of them, got shapes "
                         f"{[getattr(a, 'shape', None) for a in srcs]}")
    if any(a.shape[1:] != srcs[0].shape[1:] or a.dtype != srcs[0].dtype for a in srcs):
        raise ValueError(f"src's layer groups must share rows, width and dtype, got "
                         f"{[(tuple(a.shape), str(a.dtype)) for a in srcs]}")
    if any(int(a.shape[0]) < 1 for a in srcs) or int(srcs[0].shape[2]) < 1:
        raise ValueError(f"src's layer groups need >= 1 layer each and rows >= 1 word wide, got shapes "
                         f"{[tuple(a.shape) for a in srcs]}")
    if not isinstance(config, GatherConfig):
        raise TypeError(f"config must be a GatherConfig, got {type(config).__name__}")
    if backend not in ("interpret", "triton"):
        raise ValueError(f"backend={backend!r} must be 'interpret' (CPU) or 'triton' (GPU)")
    src = srcs[0]
    L, R, W = sum(int(a.shape[0]) for a in srcs), int(src.shape[1]), int(src.shape[2])
    for k, d in enumerate(dsts):
        if d.ndim != 1 or int(d.shape[0]) % (L * W) or d.dtype != src.dtype:
            raise ValueError(f"dsts[{k}] must be a flat {src.dtype} array of L * R_k * W words "
                             f"(L={L}, W={W}), got {d.dtype}{list(d.shape)}")
    dst_rows = tuple(int(d.shape[0]) // (L * W) for d in dsts)
    if not isinstance(windows, (list, tuple)):
        raise ValueError(f"windows must be a list of (k, sidx, didx), got {type(windows).__name__}")
    if not windows:
        return tuple(dsts)
    checked, written = [], [set() for _ in dsts]
    for w, win in enumerate(windows):
        if not isinstance(win, (list, tuple)) or len(win) != 3:
            raise ValueError(f"windows[{w}] must be a (k, sidx, didx) triple, got {win!r:.60}")
        k, s_, d_ = win
        s_, d_ = np.asarray(s_), np.asarray(d_)
        if isinstance(k, (bool, np.bool_)) or not (isinstance(k, (int, np.integer)) and 0 <= k < len(dsts)):
            raise ValueError(f"windows[{w}] destination {k!r} must be an int in [0, {len(dsts)})")
        if s_.ndim != 1 or s_.shape != d_.shape or not (np.issubdtype(s_.dtype, np.integer) or
                                                        s_.size == 0) or \
                not (np.issubdtype(d_.dtype, np.integer) or d_.size == 0):
            raise ValueError(f"windows[{w}] needs 1-D integer source and destination rows of one length")
        if s_.size and (s_.min() < 0 or s_.max() >= R or d_.min() < 0 or d_.max() >= dst_rows[k]):
            raise ValueError(f"windows[{w}] rows out of range (source < {R}, destination < {dst_rows[k]})")
        rows = set(d_.tolist())
        if len(rows) != d_.size or rows & written[k]:
            raise ValueError(f"windows[{w}] writes a row of destination {k} twice (which write "
                             "would win is unspecified on a device)")
        written[k] |= rows
        checked.append((int(k), s_.astype(np.int64), d_.astype(np.int64)))
    sidx, didx, table = _layout(checked, config.block_rows)
    return _fanout_groups(srcs, jnp.asarray(sidx), tuple(dsts), jnp.asarray(didx), jnp.asarray(table),
                       dst_rows=dst_rows, config=config, backend=backend)


def _blocks(counts, dests, br):
    """(starts, table i32[4 * m // br], m) of windows of these row counts for these destination
    indices, laid end to end at multiples of `br` (`windows.window_blocks`, the destination in
    column 0)."""
    return window_blocks(counts, dests, br)  # column 0 (offset units there) carries k here


def _layout(windows, br):
    """(sidx i32[m], didx i32[m], table i32[4 * m // br]) of windows (k, sidx, didx): `_blocks`."""
    starts, table, m = _blocks([len(s) for _, s, _ in windows], [k for k, _, _ in windows], br)
    sidx, didx = np.zeros(m, np.int32), np.zeros(m, np.int32)
    for (_, s, d), a in zip(windows, starts):
        sidx[a:a + len(s)] = s
        didx[a:a + len(d)] = d
    # window_blocks' columns are (offset units, rows, first row, ok): here (k, rows, first, ok).
    return sidx, didx, table.reshape(-1)
