"""Probe (GPU): the host cost of three things the fused round and `pack_rows` pay per call.

1. ``id()`` before and after ``import jax`` (CPython 3.12 raises an audit event per ``id()``; the
   audit hook JAX's import brings, filelock's, runs for each): 61 ids, us.
2. `pack_rows` back to back, ``sync=False``, with a `PackSource` and with the layer list: host us
   per call (median, p90) and how many calls took JAX's Python dispatch path (0: the C++ one).
3. A trivial jitted ``x + 1`` (and the same with its argument donated): us per call.

The code of the 2026-12-04 device session (`benchmarks/results/gpu_fused_h200_2026-12-04_session3.json`,
"id_cost" and "dispatch_probe_6965b2e"); there it ran inline in the device command. The command
buffer comparison of that session ran `host_profile.py` twice with
``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` and twice without.

    source scripts/gpu_env.sh && python3 benchmarks/gpu/dispatch_probe.py
"""
import os
import sys
import timeit

objs = [object() for _ in range(61)]


def _ids_us() -> float:
    return round(timeit.timeit(lambda: tuple(map(id, objs)), number=20000) / 20000 * 1e6, 2)


before = _ids_us()
import jax  # noqa: E402 - measured before and after on purpose

after = _ids_us()
try:
    import filelock
    fl = filelock.__version__
except ImportError:
    fl = "absent"
print("filelock", fl, "61 ids us: before jax", before, "after", after)

import time  # noqa: E402

import cupy as cp  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import pjit  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from pallas_kernels import PackSource, pack_rows, synchronize  # noqa: E402

cnt = {"py": 0}
_orig = pjit._run_python_pjit


def _counted(*a, **k):
    cnt["py"] += 1
    return _orig(*a, **k)


pjit._run_python_pjit = _counted
L, R, W = 61, 8192, 1152
buf = cp.zeros(L * R * W, cp.uint8)
layers = [buf[l * R * W:(l + 1) * R * W].reshape(R, W) for l in range(L)]
src = PackSource(layers)
pack = cp.zeros(4096 * W * L + 4096, cp.uint8)
idx = np.random.default_rng(0).permutation(R)[:4096].astype(np.int64)
for kind, lay in (("source", src), ("list", layers)):
    for _ in range(5):
        pack_rows(lay, idx, pack, sync=False)
    synchronize(pack)
    c0, ts = cnt["py"], []
    for _ in range(200):
        t = time.perf_counter()
        pack_rows(lay, idx, pack, sync=False)
        ts.append(time.perf_counter() - t)
    synchronize(pack)
    print(kind, "python-path calls in 200:", cnt["py"] - c0, "host us/call median",
          round(np.median(ts) * 1e6, 1), "p90", round(np.percentile(ts, 90) * 1e6, 1))
f = jax.jit(lambda x: x + 1)
g = jax.jit(lambda x: x + 1, donate_argnums=0)
x = jnp.zeros(1024, jnp.float32)
for name, fn in (("x+1", f), ("x+1 donated", g)):
    y = x
    for _ in range(10):
        y = fn(y)
    y.block_until_ready()
    c0, ts = cnt["py"], []
    for _ in range(500):
        t = time.perf_counter()
        y = fn(y)
        ts.append(time.perf_counter() - t)
    y.block_until_ready()
    print(name, "python-path", cnt["py"] - c0, "us/call median", round(np.median(ts) * 1e6, 1))
