"""One copy kernel for many destinations: the fused path's whole sender round in one launch.

The fused connector path copies a prefill rank's rows straight into the IPC-mapped KV cache of
every decode rank it serves, one `RowCopier.copy` per decode rank per round (8 on an 8-rank
group). Each call pays an index staging and a jitted dispatch (~0.2-0.3 ms of host time on an
H200 against a 0.16 ms kernel), so the host, not the copy, set the round's length.
`copy_fanout` copies every rank's rows with ONE kernel launch.

How one kernel serves D destinations, and `fanout_kernel` (the kernel on JAX arrays), are in
`pallas_kernels.fanout_kernel`; every name stays importable from this module.

Applies when the source's layers lie back to back, one shape each, as stacked
u-word[L_j, R, W] views (`PackSource.stacked_groups`: one view, or consecutive layer groups of
< 2**31 words each, one launch per group: the kernel's layer offsets stay int32),
and every destination is one flat buffer of L layers of one shape u-word[R_k, W]
(`unpack_device.flat_layers`); otherwise `copy_fanout` copies destination by
destination. What compiles: one kernel per (index bucket, source shape, destination row counts,
config); window counts and row counts are traced.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from pallas_kernels import mapped_ring, triton_launch
from pallas_kernels.triton_plans import FanoutPlan
# The kernel (re-exported: tests and tools use these names). `_enqueue_fanout` and `_launch` read
# `_blocks` and `_fanout_groups` here, so a wrapper set on this module's name is the one called.
from pallas_kernels.fanout_kernel import (  # noqa: F401
    _STATIC,
    _blocks,
    _fanout_body,
    _fanout_call,
    _fanout_groups,
    _fanout_jit,
    _fanout_slot_jit,
    _layout,
    fanout_kernel,
)
# Names fanout.py imported before the kernel moved out: kept importable from here.
from pallas_kernels.config import GatherConfig  # noqa: F401
from pallas_kernels.mapped_ring import split_slot, to_device  # noqa: F401
from pallas_kernels.row_copy import U32, IndexedRows, RegionRows, copy_block, count_kernel_trace  # noqa: F401
from pallas_kernels.row_copy import preload_lowering
from pallas_kernels.windows import window_blocks  # noqa: F401

__all__ = ["copy_fanout", "fanout_kernel", "warm_copy_fanout"]


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
        self.plans = {}  # weak refs to Destinations -> triton_plans.FanoutPlan (direct launches)


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

    On the host the copiers run one after another; a destination made read-only since its
    copier was made is refused before any job writes (ValueError naming ``jobs[k]``).
    """
    from pallas_kernels._buffer_args import check_bool, check_still_writeable
    from pallas_kernels.copier import RowCopier

    if not isinstance(jobs, (list, tuple)):
        raise TypeError(f"jobs must be a list of (RowCopier, src_indices, dst_indices), got "
                        f"{type(jobs).__name__}")
    check_bool(checked, "checked")
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
        for k, (c, _, _) in enumerate(jobs):  # every host destination before any write
            if c.backend in ("numpy", "interpret") and len(pairs[k][1]):
                check_still_writeable(c.dst_layers, f"jobs[{k}] dst_layers")
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
            if triton_launch.enabled(backend) and _launch_direct(ring, src, dests, copiers, m, table_len, fill, on_phase):
                return
            triton_launch.after_direct(dests)
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


def _launch_direct(ring, srcs, dests, copiers, m, table_len, fill, on_phase) -> bool:
    """The fan-out through `triton_launch` (the same kernel, without JAX's dispatch; locks held),
    its `triton_plans.FanoutPlan` made once per copier set (kept on the source's ring). Each
    destination's ``direct`` then names the stream it went on (a flag bump follows there).
    False, with direct launches turned off for the process, if it cannot launch: the caller
    launches through JAX (a copy already enqueued is only repeated: same rows, same bytes)."""
    # Weak references hash as their Destinations (by identity; no id(): an audit event): a plan
    # keeps no copier's memory alive. A source keeps its last few plans (a sender: one set).
    key = tuple(weakref.ref(d) for d in dests)

    def launch():
        plan = ring.plans.get(key)
        if plan is None:
            while len(ring.plans) >= 4:
                ring.plans.pop(next(iter(ring.plans)))
            plan = ring.plans[key] = FanoutPlan(
                srcs, [d.ptrs[0] for d in dests], [d.handles[0].shape[0] for d in dests],
                [c.uniform_rows for c in copiers], copiers[0].config)
        return plan.launch(m, table_len, fill, on_phase)

    return triton_launch.launch_into("fanout", dests, launch) is not None


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
    triton_launch.synchronize()
    return out
