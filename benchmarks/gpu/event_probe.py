"""Probe (GPU): can a CuPy stream wait on a JAX kernel without the host waiting (DLPack's
``stream`` argument), so that an interprocess CUDA event recorded there marks the kernel's end?

Prints JSON: the host time of the dispatch, of `__dlpack__(stream=...)` and of the event record
while a ~2 ms kernel runs; whether the event was still pending right after (it must be); the
time the event completed vs `block_until_ready`; a donated second call after the export. (Another
process waiting on the event was tested by tests/gpu/test_ipc_event_gpu.py, removed with the IPC
event gate in 58f9909: the fused path waits on a flag page now, `bridge.host_flag`.)
"""
from __future__ import annotations

import json
import time


def main() -> None:
    import cupy as cp
    import jax
    import jax.numpy as jnp

    out = {}
    x = jnp.ones((512, 1024, 1024), jnp.float32)  # 2 GiB
    f = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)
    g = jax.jit(lambda a: a * 2 + 1)
    y = g(x).block_until_ready()
    t = time.perf_counter()
    g(x).block_until_ready()
    out["kernel_ms"] = (time.perf_counter() - t) * 1e3
    s = cp.cuda.Stream(non_blocking=True)
    ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
    out["handle_bytes"] = len(cp.cuda.runtime.ipcGetEventHandle(ev.ptr))
    rows = []
    for i in range(5):
        t0 = time.perf_counter()
        y = f(y)
        t1 = time.perf_counter()
        cap = y.__dlpack__(stream=s.ptr)
        del cap
        t2 = time.perf_counter()
        ev.record(s)
        t3 = time.perf_counter()
        pending = cp.cuda.runtime.eventQuery(ev.ptr) != 0
        ev.synchronize()
        t4 = time.perf_counter()
        y.block_until_ready()
        t5 = time.perf_counter()
        rows.append(dict(dispatch_us=(t1 - t0) * 1e6, dlpack_stream_us=(t2 - t1) * 1e6, record_us=(t3 - t2) * 1e6,
                         pending_after_record=pending, event_done_ms=(t4 - t0) * 1e3, bur_ms=(t5 - t0) * 1e3))
    out["same_process"] = rows
    out["values_ok"] = bool(jnp.all(y[:2, :2, :2] == y[0, 0, 0]))
    print("EVENT_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
