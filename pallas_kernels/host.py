"""Host (numpy) forms of the row copies: the threaded gather into a pack, the scatter out of
one, and the row copy between layer sets.

Work is split into (layer entry, row range) units dealt to one process-wide thread pool:
`np.take` and numpy's fancy assignment release the GIL, and every unit writes its own
disjoint bytes (destination indices are unique: `pallas_kernels.unpack` checks them).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

HOST_MAX_THREADS = 8  # past this the gather is bound by memory bandwidth, not cores
HOST_THREADS_MIN_BYTES = 8 << 20  # smaller regions: thread hand-off costs more than it saves
HOST_MAX_THREADS_ARG = 64  # the most `threads=` may ask for (one shared pool of at most this)
_HOST_POOL: dict[str, Any] = {}  # {"pid", "workers", "pool"}: this process's one pool
_HOST_POOL_LOCK = threading.Lock()


def host_pool(workers: int) -> ThreadPoolExecutor:
    """This process's worker pool, at least `workers` threads (one pool, grown when asked for
    more; made again after a fork, since a child inherits no threads)."""
    with _HOST_POOL_LOCK:
        pool = _HOST_POOL.get("pool")
        if pool is None or _HOST_POOL["pid"] != os.getpid() or _HOST_POOL["workers"] < workers:
            if pool is not None and _HOST_POOL["pid"] == os.getpid():
                pool.shutdown(wait=False)  # its threads exit once idle
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pack_rows")
            _HOST_POOL.update(pid=os.getpid(), workers=workers, pool=pool)
        return pool


def pack_host(layers, idx, pack, offset, item_lens, threads):
    """numpy gather into the pack: (layer, row range) units, dealt to `threads` workers."""
    n = int(idx.shape[0])
    threads, units = _region_units(layers, item_lens, n, threads, offset)

    def take(batch):
        for a, r0, r1, w, start in batch:
            # mode="clip" (indices are checked by the caller) skips np.take's buffered "raise" path.
            np.take(a, idx[r0:r1], axis=0,
                    out=pack[start:start + (r1 - r0) * w].reshape(r1 - r0, w), mode="clip")

    _run_units(units, take, threads)



def host_threads(threads, total: int) -> int:
    """Workers for `total` bytes: `threads`, or (None) one per core, at most HOST_MAX_THREADS,
    for at least HOST_THREADS_MIN_BYTES; else one."""
    if threads is None:
        return min(HOST_MAX_THREADS, os.cpu_count() or 1) if total >= HOST_THREADS_MIN_BYTES else 1
    return threads


def check_threads(threads) -> None:
    """ValueError unless `threads` is None or an int in [1, HOST_MAX_THREADS_ARG]."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, (int, np.integer))
                                or not 1 <= threads <= HOST_MAX_THREADS_ARG):
        raise ValueError(f"{threads=} must be None or an int in [1, {HOST_MAX_THREADS_ARG}]")


def _run_units(units, work, threads: int) -> None:
    """Run `work(batch)` over `units` dealt to `threads` workers (one batch inline if 1).

    Exactly `threads` tasks, so no more run at once whatever the pool's size; list() waits for
    all of them and re-raises the first worker's exception here."""
    threads = min(threads, len(units))
    if threads <= 1:
        work(units)
        return
    try:
        done = host_pool(threads).map(work, [units[k::threads] for k in range(threads)])
    except RuntimeError:
        # "cannot schedule new futures after interpreter shutdown": Python stops its executors
        # before atexit hooks run, and a connector closed there may still pack or unpack.
        # `map` submits every task first, so none (or, racing shutdown, some) ran: run all here.
        work(units)
        return
    list(done)


def _row_bounds(n: int, threads: int, num_layers: int) -> list[int]:
    """Row range bounds: about two units per worker, each a row range of one layer entry."""
    chunks = max(1, min(n, -(-2 * threads // num_layers))) if threads > 1 else 1
    return [n * k // chunks for k in range(chunks + 1)]


def unpack_host(pack, layers, idx, offset, item_lens, threads) -> None:
    """numpy scatter: (layer, row range) units, each writing its own destination rows."""
    n = int(idx.shape[0])
    threads, units = _region_units(layers, item_lens, n, threads, offset)

    def put(batch):
        for a, r0, r1, w, start in batch:
            a[idx[r0:r1]] = pack[start:start + (r1 - r0) * w].reshape(r1 - r0, w)

    _run_units(units, put, threads)


def copy_host(srcs, sidx, dsts, didx, item_lens, threads) -> None:
    n = int(sidx.shape[0])
    threads = host_threads(threads, n * sum(item_lens))
    bounds = _row_bounds(n, threads, len(srcs))
    units = [(s, d, r0, r1) for s, d in zip(srcs, dsts)
             for r0, r1 in zip(bounds[:-1], bounds[1:]) if r1 > r0]

    def copy(batch):
        for s, d, r0, r1 in batch:
            d[didx[r0:r1]] = np.take(s, sidx[r0:r1], axis=0, mode="clip")

    _run_units(units, copy, threads)


__all__ = ["HOST_MAX_THREADS", "HOST_MAX_THREADS_ARG", "HOST_THREADS_MIN_BYTES", "check_threads",
           "copy_host", "host_pool", "pack_host", "unpack_host"]


def _region_units(layers, item_lens, n: int, threads, offset: int):
    """Split a layer-major region of n rows per layer into per-thread work units
    ``(layer, r0, r1, item_len, region byte start)``; shared by the host pack and unpack."""
    threads = host_threads(threads, n * sum(item_lens))
    bounds = _row_bounds(n, threads, len(layers))
    units, pos = [], offset
    for a, w in zip(layers, item_lens):
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            if r1 > r0:
                units.append((a, r0, r1, w, pos + r0 * w))
        pos += n * w
    return threads, units
