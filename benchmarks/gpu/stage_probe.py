"""Probe (GPU): ways to hand the fused fan-out its indices, host time per launch.

The fused path's launch staged its indices through `device.IndexRing` (pinned fill, one
`memcpyAsync` on a CuPy stream and a host wait for it, since the JAX kernel runs on another
stream) before a jitted dispatch. Compared here, on the main job's shape (61 layers of
1,152-byte rows, 8 destinations of 4,096 rows each, 32,768 index rows):

- ``ring``: the library's `copy_fanout` as it is (checks, staging, dispatch);
- ``device_idx``: indices already on the device, the jitted fan-out alone (the floor);
  ``device_idx_wrapped``: the same inside one more jit (what a slot variant adds);
- ``pinned`` / ``pinned_put_once``: indices in JAX ``pinned_host`` memory, moved to the device
  inside the call (the put per call, or once);
- ``uva_copy``: a pinned host buffer imported into JAX as a device array (its UVA address),
  copied on the device inside the call (`pallas_kernels.mapped_ring`);
  ``uva_direct``: the kernel reading that buffer itself.

Prints each variant's median host us per call back to back (device synchronised between calls),
after the thread slept 0.3 s, after it spun 0.3 s, launch-to-done us, and whether every
destination row is right; then one JSON line.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np


def _median_us(fn, reps: int = 30, sleep_s: float = 0.0, sync=None) -> float:
    ts = []
    for _ in range(reps):
        if sync is not None:
            sync()
        if sleep_s:
            time.sleep(sleep_s)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts[min(5, reps // 2):]) * 1e6)


@contextlib.contextmanager
def child_processes(code: str, n: int, env_of=None):
    """`n` Python processes running `code` (each prints one line once ready, then waits), for the
    probes that need other processes on the GPU; yields each one's ready line (the first JSON or
    number: an engine's own lines are skipped); kills them all on exit. ``env_of(i)``: child i's
    extra environment variables."""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=None if env_of is None else {**os.environ, **env_of(i)})
             for i in range(n)]

    def ready_line(p) -> str:  # an engine may print its own lines first (NIXL's banner)
        for _ in range(200):
            line = p.stdout.readline()
            if not line or line.lstrip().startswith(("{", "[")) or line.strip().isdigit():
                return line
        return line

    try:
        yield [ready_line(p) for p in procs]
    finally:
        for p in procs:
            p.kill()


def job_shape():
    """The main job's fused round at 32,768 tokens, DCP8, one process: a prefill cache of 61
    layers x 32,768 rows of 1,152 bytes (one buffer), 8 decode caches of 5,120 rows, 4,096 rows
    each. Returns (src_buf, dst_bufs, source, copiers, jobs: (copier, src rows, dst rows))."""
    import cupy as cp

    from pallas_kernels import PackSource, RowCopier

    L, R, W, D, n = 61, 32768, 1152, 8, 4096
    src_buf = cp.random.randint(0, 256, (L, R, W), dtype=cp.uint8)
    dst_bufs = [cp.zeros((L, 5120, W), cp.uint8) for _ in range(D)]
    source = PackSource([src_buf[l] for l in range(L)])
    copiers = [RowCopier(source, [b[l] for l in range(L)]) for b in dst_bufs]
    rng = np.random.default_rng(7)
    perm = rng.permutation(R)
    jobs = [(c, perm[k * n:(k + 1) * n], rng.permutation(5120)[:n]) for k, c in enumerate(copiers)]
    return src_buf, dst_bufs, source, copiers, jobs


def main() -> None:
    import cupy as cp
    import jax
    import jax.numpy as jnp

    from pallas_kernels import copy_fanout
    from pallas_kernels import fanout as fo

    src_buf, dst_bufs, source, copiers, jobs = job_shape()
    out = {}

    def ok() -> bool:
        cp.cuda.runtime.deviceSynchronize()
        good = all(bool((dst_bufs[k][:, cp.asarray(d_)] == src_buf[:, cp.asarray(s_)]).all())
                   for k, (_, s_, d_) in enumerate(jobs))
        for b in dst_bufs:
            b.fill(0)
        cp.cuda.runtime.deviceSynchronize()
        return good

    sync = cp.cuda.runtime.deviceSynchronize
    cfg, br = copiers[0].config, copiers[0].config.block_rows
    src = source.stacked_groups()[0]
    dests = [c.destinations() for c in copiers]
    rows = tuple(c.uniform_rows for c in copiers)
    sidx, didx, table = fo._layout([(k, s_, d_) for k, (_, s_, d_) in enumerate(jobs)], br)
    m, tl = int(sidx.shape[0]), int(table.shape[0])
    packed = np.concatenate([sidx, didx, table]).astype(np.int32)
    dev = jax.devices()[0]
    static = dict(first_layer=0, dst_rows=rows, config=cfg, backend="triton")

    def keep(outs):
        for d, o in zip(dests, outs):
            d.keep([o])

    def handles():
        return tuple(d.handles[0] for d in dests)

    def wrapped(move):  # one jit: move the packed indices, then the fan-out kernel
        @functools.partial(jax.jit, donate_argnames=("dsts",))
        def launch(src, idx, dsts):
            idx = move(idx)
            return fo._fanout_jit.__wrapped__(src, idx[:m], dsts, idx[m:2 * m], idx[2 * m:2 * m + tl], **static)
        return launch

    calls = {"ring": lambda: copy_fanout(jobs, checked=True)}
    # Indices already on the device (staged once): the dispatch and the kernel alone.
    d_s, d_d, d_t = (jnp.asarray(a) for a in (sidx, didx, table))
    calls["device_idx"] = lambda: keep(fo._fanout_jit(src, d_s, handles(), d_d, d_t, **static))
    d_packed = jnp.asarray(packed)
    ident = wrapped(lambda x: x)
    calls["device_idx_wrapped"] = lambda: keep(ident(src, d_packed, handles()))
    try:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        mv = wrapped(lambda x: jax.device_put(x, on_dev))
        p_packed = jax.device_put(packed, pinned)
        calls["pinned_put_once"] = lambda: keep(mv(src, p_packed, handles()))
        calls["pinned"] = lambda: keep(mv(src, jax.device_put(packed, pinned), handles()))
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        out["pinned"] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
    try:
        mem = cp.cuda.alloc_pinned_memory(packed.nbytes)
        host = np.frombuffer(mem, np.int32, packed.size)
        view = cp.ndarray(packed.shape, cp.int32, cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(int(host.ctypes.data), packed.nbytes, mem), 0))
        uva = jax.dlpack.from_dlpack(view)
        u_s, u_d, u_t = (jax.dlpack.from_dlpack(view[a:b]) for a, b in ((0, m), (m, 2 * m), (2 * m, 2 * m + tl)))
        cw = wrapped(lambda x: jnp.where(x >= 0, x, 0))

        def uva_copy():
            host[:] = packed
            keep(cw(src, uva, handles()))

        def uva_direct():
            host[:] = packed
            keep(fo._fanout_jit(src, u_s, handles(), u_d, u_t, **static))
        calls["uva_copy"], calls["uva_direct"] = uva_copy, uva_direct
    except Exception as exc:  # noqa: BLE001
        out["uva"] = dict(error=f"{type(exc).__name__}: {exc}"[:400])

    def spin(s=0.3):
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    for name, call in calls.items():
        try:
            call()
            r = dict(hot_us=_median_us(call, sync=sync), slept_us=_median_us(call, 7, 0.3, sync),
                     spun_us=_median_us(call, 7, 0.0, lambda: (sync(), spin())), ok=ok())

            def whole(call=call):
                call()
                for d in dests:
                    d.handles[0].block_until_ready()
            r["launch_to_done_us"] = _median_us(whole, 15, 0.0, sync)
            out[name] = r
        except Exception as exc:  # noqa: BLE001
            out[name] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
        print(name, out[name], flush=True)
    print("STAGE_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
