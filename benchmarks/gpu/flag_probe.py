"""Probe (GPU): a completion flag in shared pinned host memory, bumped by a jitted kernel that takes
the copy's output as an argument, so that another process sees "the copy has ended" with a plain
memory read (no CUDA call, no message).

Why: the CUDA IPC event recorded after a DLPack stream wait fired early at 9.21 GB (the DLPack
export of an output whose definition event was not recorded yet does not order anything). A jit
whose argument is the copy's output is ordered by XLA itself, whatever its dispatch thread does.

Prints FLAG_PROBE {json}: how the view was made (device type CuPy reports for registered host
memory, whether JAX's view is zero-copy), whether the donated bump writes in place, and for
copies of 2.3 and 9.2 GB: when a spinning reader process saw each bump vs the copy's device time
and the host's block_until_ready.
"""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time

READER = r"""
import json, mmap, os, sys, time, numpy as np
fd = os.open(sys.argv[1], os.O_RDONLY); mm = mmap.mmap(fd, 4096, prot=mmap.PROT_READ); os.close(fd)
v = np.frombuffer(mm, np.uint32, 1)
want, seen, last = int(sys.argv[2]), [], int(v[0])
print("READY", flush=True)
end = time.monotonic() + 60
while len(seen) < want and time.monotonic() < end:
    x = int(v[0])
    if x != last:
        seen.append((x, time.monotonic())); last = x
print("SEEN", json.dumps(seen), flush=True)
"""


def main() -> None:
    import cupy as cp
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bridge.host_flag import SharedFlag

    out = {}
    flag = SharedFlag.create(device=True)
    out["view"] = flag.describe()
    n_bumps = 12
    reader = subprocess.Popen([sys.executable, "-c", READER, flag.path, str(n_bumps)],
                              stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "READY"
    dep = jnp.ones((1024,), jnp.float32)
    t = time.perf_counter()
    seq = flag.bump_after(dep)
    out["first_bump_ms"] = (time.perf_counter() - t) * 1e3
    flag.synchronize()
    out["in_place"] = int(flag.value()) == seq == 1
    rows = []
    bump = 1
    for gb in (2.3, 9.2):
        n = int(gb * 1e9 / 2 / 4)  # read + write = gb bytes
        x = jnp.ones((n,), jnp.float32)
        f = jax.jit(lambda a: a + 1, donate_argnums=0)
        x = f(x).block_until_ready()
        t = time.perf_counter()
        x = f(x).block_until_ready()
        kernel_ms = (time.perf_counter() - t) * 1e3
        for _ in range(5 if gb < 5 else 6):
            t0 = time.monotonic()
            x = f(x)
            t1 = time.monotonic()
            bump = flag.bump_after(x)
            t2 = time.monotonic()
            x.block_until_ready()
            t3 = time.monotonic()
            rows.append(dict(gb=gb, seq=bump, kernel_ms=kernel_ms, t0=t0, dispatch_ms=(t1 - t0) * 1e3,
                             bump_dispatch_ms=(t2 - t1) * 1e3, bur_ms=(t3 - t0) * 1e3))
        del x
    seen = reader.communicate(timeout=90)[0]
    seen = json.loads(seen.split("SEEN", 1)[1])
    at = {int(v): t for v, t in seen}
    for r in rows:
        r["flag_ms"] = (at[r["seq"]] - r["t0"]) * 1e3 if r["seq"] in at else None
        r["early"] = r["flag_ms"] is not None and r["flag_ms"] < r["kernel_ms"] * 0.9
        del r["t0"]
    out["rows"] = rows
    out["any_early"] = any(r["early"] for r in rows)
    out["final_value"] = int(flag.value())
    flag.close()
    out["closed_file_gone"] = not os.path.exists(flag.path)
    print("FLAG_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
