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

Applies when the source's layers lie back to back, one shape each, as stacked
u-word[L_j, R, W] views (`PackSource.stacked_groups`: one view, or consecutive layer groups of
< 2**31 words each, one launch per group: the kernel's layer offsets stay int32),
and every destination is one flat buffer of L layers of one shape u-word[R_k, W]
(`unpack_device.flat_layers`); otherwise `copy_fanout` copies destination by
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

from pallas_kernels import mapped_ring
from pallas_kernels.config import GatherConfig
from pallas_kernels.mapped_ring import split_slot, to_device
from pallas_kernels.row_copy import U32, IndexedRows, RegionRows, copy_block, count_kernel_trace, \
    preload_lowering
from pallas_kernels.windows import window_blocks

__all__ = ["copy_fanout", "fanout_kernel", "warm_copy_fanout"]


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


def copy_fanout(jobs, *, checked: bool = False, on_phase=None) -> int:
    """`copier.copy(src_indices, dst_indices)` for every job (copier, src_indices,
    dst_indices), in ONE kernel launch when the copiers share one `PackSource` whose layers are
    one stacked view and every destination is one flat buffer of uniform layers (the fused
    path: a prefill rank's cache into each decode rank's IPC-mapped cache); else copier by
    copier. Device copies are only enqueued (`synchronize` the destinations).

    Args:
        jobs: sequence of (RowCopier, src_indices int[n], dst_indices int[n]), each copier at
            most once. A job with no rows (n = 0) copies nothing but, when its copier can share
            the launch, is part of it: listing the same copiers every round (rows or not) keeps
            one compiled kernel (`warm_copy_fanout` compiles it ahead).
        checked: as `RowCopier.copy`.
        on_phase: optional ``on_phase(name)`` callback, called on this thread as the one-launch
            path passes ``"checked"`` (every job's indices checked) and ``"staged"`` (the
            indices are on the device; the jitted dispatch follows): how a caller's timeline
            splits the launch's host time. Not called on the copier-by-copier path.

    Returns:
        Rows copied, summed over the jobs.

    Raises:
        ValueError, TypeError: as `RowCopier.copy` for any job's indices, named `jobs[k]`
            (checked before anything is copied); a job that is not a (RowCopier, src, dst)
            triple; a copier listed twice; two copiers whose destinations share memory; a
            `checked` that is not a bool.
        RuntimeError: a closed copier (`jobs[k]`).

    On the host the copiers run one after another: should one fail while copying (e.g. its
    destination became read-only after construction), the jobs before it stay written.
    """
    from pallas_kernels.copier import RowCopier

    if not isinstance(jobs, (list, tuple)):
        raise TypeError(f"jobs must be a list of (RowCopier, src_indices, dst_indices), got "
                        f"{type(jobs).__name__}")
    if not isinstance(checked, (bool, np.bool_)):
        raise TypeError(f"checked must be a bool, got {type(checked).__name__}")
    for k, job in enumerate(jobs):
        if not isinstance(job, (list, tuple)) or len(job) != 3 or not isinstance(job[0], RowCopier):
            raise TypeError(f"jobs[{k}] must be a (RowCopier, src_indices, dst_indices) triple, got "
                            f"{job!r:.80}")
    if len({c for c, _, _ in jobs}) != len(jobs):  # copiers hash by identity (no id(): an audit event)
        raise ValueError("each copier may appear once in jobs")
    pairs = []
    for k, (c, s, d) in enumerate(jobs):
        try:
            pairs.append((c, *c.check_pair(s, d, checked)))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise type(exc)(f"jobs[{k}]: {exc}") from None
    _check_distinct_destinations([c for c, _, _ in jobs])
    live = [p for p in pairs if len(p[1])]
    total = sum(len(s) for _, s, _ in live)
    if not live:
        return 0
    first = live[0][0]
    # Jobs without rows still take part in the launch (they get no row block): the kernel
    # compiled for D destinations serves every round of the same copiers, whichever have rows.
    ok = {c: c.fans_out_with(first) for c, _, _ in pairs}  # once per copier
    fan = [p for p in pairs if ok[p[0]]]
    if len(fan) == 1 or not all(ok[c] for c, _, _ in live):
        for c, s, d in live:
            c.copy(s, d, checked=True)
        return total
    if on_phase is not None:
        on_phase("checked")
    _enqueue_fanout(first.source, fan, on_phase)
    return total


_DISTINCT_LAST: list = [()]  # weak references to the last copier list found distinct


def _check_distinct_destinations(copiers, name: str = "jobs") -> None:
    """No two copiers of one call may write the same memory (one launch would alias it twice;
    one by one, the last would win). Copiers whose spans overlap are compared layer by layer.
    A copier's destinations never change, so the list of the last call that passed (a sender
    lists the same copiers every round) is not compared again."""
    from pallas_kernels._buffer_args import _check_disjoint, overlapping_spans

    refs = _DISTINCT_LAST[0]
    if len(refs) == len(copiers) and all(r() is c for r, c in zip(refs, copiers)):
        return
    spans = [(*c.dst_span, k) for k, c in enumerate(copiers) if c.dst_span[1] > c.dst_span[0]]
    for i, j in overlapping_spans(spans):
        try:
            _check_disjoint(list(copiers[i].dst_layers), "dst", copiers[j].dst_layers, "dst")
        except ValueError:
            i, j = sorted((i, j))
            raise ValueError(f"{name}[{i}] and {name}[{j}] write the same memory: each copier "
                             "of one call needs its own destination") from None
    _DISTINCT_LAST[0] = tuple(weakref.ref(c) for c in copiers)


def _enqueue_fanout(source, live, on_phase=None) -> None:
    starts, table, m = _blocks([len(s) for _, s, _ in live], range(len(live)),
                               live[0][0].config.block_rows)

    def fill(segs, meta):  # each window's rows straight into the pinned slot
        sv, dv = segs
        for (_, s, d), a in zip(live, starts):
            sv[a:a + len(s)] = s
            dv[a:a + len(d)] = d
        meta[:] = table  # rows between windows keep old values: masked, clamped, never stored

    _launch(source, [c for c, _, _ in live], m, len(table), fill, on_phase)


def _launch(source, copiers, m, table_len, fill, on_phase=None) -> None:
    """One fan-out launch over `copiers` (in destination order) with index bucket `m`; `fill`
    writes the pinned index slot (`mapped_ring.stage_indices`: a mapped slot the call reads, or
    `device.IndexRing`'s upload); ``on_phase("staged")`` once the kernel can read it."""
    config, backend = copiers[0].config, copiers[0].backend
    ring = _RINGS.get(source)
    if ring is None:
        ring = _RINGS[source] = _Ring()
    dests = [c.destinations() for c in copiers]
    src = source.stacked_groups()
    with ring.lock:
        locks = [d.lock for d in dests]
        for lk in locks:
            lk.acquire()
        try:
            static = dict(dst_rows=tuple(c.uniform_rows for c in copiers), config=config, backend=backend)
            sv, staged = mapped_ring.stage_indices(ring, m, 2, table_len, fill, backend)
            if staged is None:  # a mapped slot: the host filled it, the call reads it
                dv = tv = None
                static.update(m=m, table_len=table_len)
            else:
                (sv, dv), tv = staged
            if on_phase is not None:
                on_phase("staged")
            preload_lowering(backend)
            outs = _fanout_groups(src, sv, tuple(d.handles[0] for d in dests), dv, tv, **static)
            for d, o in zip(dests, outs):
                d.keep([o])
        except Exception:
            for c in copiers:
                c.drop_destinations()  # the donated handles may be gone: made afresh next call
            raise
        finally:
            for lk in locks:
                lk.release()


def warm_copy_fanout(copiers, max_rows: int) -> list[int]:
    """Compiles the fan-out kernel `copy_fanout` launches for these copiers together, for every
    index bucket up to `bucket_rows(max_rows)`, writing nothing (every row block of the warm
    launches is marked empty). A serving loop calls it once its decode ranks are mapped and
    before the first request: a round that first reaches a bucket otherwise compiles it then.
    `copy_fanout` keeps copiers without rows in its launch, so one set of copiers needs these
    kernels only, whichever of them have rows in a round.

    Args:
        copiers: the `RowCopier`s one `copy_fanout` call will list (each once, in that order).
        max_rows: the most index rows one call will have (>= 1): the sum over its jobs of each
            job's rows rounded up to `config.block_rows`; more than a call can have (each
            copier's destination rows, block-rounded) is clamped to that.

    Returns:
        The index buckets compiled or found compiled (ascending); [] when the copiers do not
        share one launch (fewer than two, or not `fans_out_with` one another: `copy_fanout`
        copies those one by one).

    Raises:
        TypeError: a copier that is not a `RowCopier`; ValueError: `max_rows` not an int >= 1,
        a copier listed twice or two copiers writing the same memory; RuntimeError: a closed
        copier.
    """
    from pallas_kernels.copier import RowCopier
    from pallas_kernels.config import buckets_up_to

    if not isinstance(copiers, (list, tuple)):
        raise TypeError(f"copiers must be a list of RowCopier, got {type(copiers).__name__}")
    for k, c in enumerate(copiers):
        if not isinstance(c, RowCopier):
            raise TypeError(f"copiers[{k}] must be a RowCopier, got {type(c).__name__}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be an int >= 1")
    if len(set(copiers)) != len(copiers):
        raise ValueError("each copier may appear once in copiers")
    for k, c in enumerate(copiers):
        if c.source is None:
            raise RuntimeError(f"copiers[{k}] is closed")
    _check_distinct_destinations(list(copiers), "copiers")
    if len(copiers) < 2 or not all(c.fans_out_with(copiers[0]) for c in copiers):
        return []
    br = copiers[0].config.block_rows
    # One job per copier, of at most its destination's rows (unique), each rounded to a block.
    max_rows = min(int(max_rows), sum(c.dst_rows + br for c in copiers))
    out = buckets_up_to(max_rows, br)
    for m in out:
        table = np.zeros(4 * (m // br), np.int32)  # ok = 0 in every block: no store

        def fill(segs, meta, table=table):
            meta[:] = table
        _launch(copiers[0].source, list(copiers), m, len(table), fill)
    _DeviceSync.block_until_ready()
    return out
