"""One copy kernel for many destinations: the fused path's whole sender round in one launch.

The fused connector path copies a prefill rank's rows straight into the IPC-mapped KV cache of
every decode rank it serves, one `RowCopier.copy` per decode rank per round (8 on an 8-rank
group). Each call pays an index staging and a jitted dispatch (~0.2-0.3 ms of host time on an
H200 against a 0.16 ms kernel), so the host, not the copy, set the round's length.
`copy_fanout` copies every rank's rows with ONE kernel launch.

How one kernel serves D destinations (as `pallas_kernels.windows` does for pack regions): the
windows' source and destination indices lie end to end, each window starting at a multiple of
`block_rows`, so every row block (one program) lies in one window. A per-block table
i32[num_blocks * 4] gives the block its (destination k, window rows, first row of the block,
ok). The program (row block i, layer g) copies rows of layer g of the stacked source
(`BlockSpec` `(None, R, W)`) into destination k's flat buffer at word `g * R_k * W + row * W`
(uint32 addresses). Blocks past the last window have ok = 0 and write nothing.

Applies when the source is one stacked u-word[L, R, W] view (layers of one shape, back to back:
`device.stacked_words`) and every destination is one flat buffer of L layers of one shape
u-word[R_k, W] (`unpack_device.flat_layers`); otherwise `copy_fanout` copies destination by
destination. What compiles: one kernel per (index bucket, source shape, destination row counts,
config); window counts and row counts are traced.
"""

from __future__ import annotations

import functools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import device
from pallas_kernels.row_copy import U32, IndexedRows, RegionRows, copy_block, count_kernel_trace, \
    preload_lowering
from pallas_kernels.windows import window_blocks

__all__ = ["copy_fanout", "fanout_kernel"]


def _fanout_body(table_ref, sidx_ref, didx_ref, src_ref, *refs, dst_rows, width, block_rows,
                 num_src_rows, evict, load_evict, load_cache, interleave, interpret):
    D = len(dst_rows)
    outs = refs[D:]
    g = pl.program_id(1)
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
            base = g.astype(U32) * U32(R * width)
            copy_block([(src, RegionRows(outs[kk], base, didx, width, mask=valid, evict=evict),
                         width)], interleave=interleave)


@functools.partial(jax.jit, static_argnames=("dst_rows", "config", "backend"),
                   donate_argnames=("dsts",))
def _fanout_jit(src, sidx, dsts, didx, table, *, dst_rows, config, backend):
    """src u-word[L, R, W]; sidx/didx i32[m]; dsts: D flat word arrays (L * R_k * W each),
    donated; table i32[4 * m // block_rows]. Returns the D destinations, written in place."""
    from jax.experimental.pallas import triton as pltriton

    count_kernel_trace()
    L, R, W = (int(d) for d in src.shape)
    br = config.block_rows
    m = int(sidx.shape[0])
    interpret = backend == "interpret"
    body = functools.partial(
        _fanout_body, dst_rows=tuple(dst_rows), width=W, block_rows=br, num_src_rows=R,
        evict=config.eviction_policy, load_evict=config.load_eviction_policy,
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


def fanout_kernel(src, windows, dsts, *, config, backend="interpret"):
    """The kernel on JAX arrays (tests, tools): `dsts[k][layer l, row didx] = src[l, sidx]` for
    each window (k, sidx, didx).

    Args:
        src: u-word[L, R, W] (stacked layers).
        windows: sequence of (k, sidx int[n], didx int[n]): destination index, rows.
        dsts: list of D flat word arrays of L * R_k * W words (L layers [R_k, W] back to back),
            donated.
        config: `GatherConfig` (static); backend: "interpret" (CPU) or "triton".

    Returns:
        The tuple of D destinations.
    """
    W = int(src.shape[2])
    dst_rows = tuple(int(d.shape[0]) // (int(src.shape[0]) * W) for d in dsts)
    sidx, didx, table = _layout(windows, config.block_rows)
    return _fanout_jit(src, jnp.asarray(sidx), tuple(dsts), jnp.asarray(didx), jnp.asarray(table),
                       dst_rows=dst_rows, config=config, backend=backend)


def _layout(windows, br):
    """(sidx i32[m], didx i32[m], table i32[4 * m // br]) of windows (k, sidx, didx) laid end to
    end at multiples of `br` (`windows.window_blocks`, with the destination in column 0)."""
    counts = [len(s) for _, s, _ in windows]
    starts, table, m = window_blocks(counts, [0] * len(counts), br)
    table = table.reshape(-1, 4)
    nb = [-(-c // br) for c in counts]
    table[:sum(nb), 0] = np.repeat([k for k, _, _ in windows], nb)
    sidx, didx = np.zeros(m, np.int32), np.zeros(m, np.int32)
    for (_, s, d), a in zip(windows, starts):
        sidx[a:a + len(s)] = s
        didx[a:a + len(d)] = d
    # window_blocks' columns are (offset units, rows, first row, ok): here (k, rows, first, ok).
    return sidx, didx, table.reshape(-1)


class _DeviceSync:
    """What `device.IndexRing` waits on before it rewrites a slot: every kernel enqueued so far
    (the fan-out's outputs go on to other calls, which donate them, so no output is kept)."""

    @staticmethod
    def block_until_ready() -> None:
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


class _Ring:
    """The index slots of one source's fan-out calls, in the shape `device.IndexRing` takes its
    destinations (rings, handles, call counters); a wait there syncs the device (once per 16
    calls at most)."""

    def __init__(self):
        self.rings = {}
        self.handles = [_DeviceSync()]
        self.calls = self.done = 0
        self.lock = threading.Lock()


_RINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def copy_fanout(jobs, *, checked: bool = False) -> int:
    """`copier.copy(src_indices, dst_indices)` for every job (copier, src_indices,
    dst_indices), in ONE kernel launch when the copiers share one `PackSource` whose layers are
    one stacked view and every destination is one flat buffer of uniform layers (the fused
    path: a prefill rank's cache into each decode rank's IPC-mapped cache); else copier by
    copier. Device copies are only enqueued (`synchronize` the destinations).

    Args:
        jobs: sequence of (RowCopier, src_indices int[n], dst_indices int[n]), each copier at
            most once.
        checked: as `RowCopier.copy`.

    Returns:
        Rows copied, summed over the jobs.

    Raises:
        ValueError, TypeError: as `RowCopier.copy` for any job's indices (nothing is enqueued);
            a copier listed twice.
    """
    jobs = list(jobs)
    if len({id(c) for c, _, _ in jobs}) != len(jobs):
        raise ValueError("each copier may appear once in jobs")
    live = []
    for c, s, d in jobs:
        sidx, didx = c.check_pair(s, d, checked)
        if len(sidx):
            live.append((c, sidx, didx))
    total = sum(len(s) for _, s, _ in live)
    if not live:
        return 0
    first = live[0][0]
    if len(live) == 1 or not all(c.fans_out_with(first) for c, _, _ in live):
        for c, s, d in live:
            c.copy(s, d, checked=True)
        return total
    _enqueue_fanout(first.source, live)
    return total


def _enqueue_fanout(source, live) -> None:
    config, backend = live[0][0].config, live[0][0].backend
    br = config.block_rows
    ring = _RINGS.get(source)
    if ring is None:
        ring = _RINGS[source] = _Ring()
    sidx, didx, table = _layout([(k, s, d) for k, (_, s, d) in enumerate(live)], br)
    dests = [c.destinations() for c, _, _ in live]
    src = source.device_views()
    with ring.lock:
        locks = [d.lock for d in dests]
        for lk in locks:
            lk.acquire()
        try:
            (sv, dv), tv = device.index_ring(ring, len(sidx), 2, len(table)).stage(
                [sidx, didx], table, ring)
            preload_lowering(backend)
            outs = _fanout_jit(src, sv, tuple(d.handles[0] for d in dests), dv, tv,
                               dst_rows=tuple(c.uniform_rows for c, _, _ in live), config=config,
                               backend=backend)
            for d, o in zip(dests, outs):
                d.keep([o])
        except Exception:
            for c, _, _ in live:
                c.drop_destinations()  # the donated handles may be gone: made afresh next call
            raise
        finally:
            for lk in locks:
                lk.release()

