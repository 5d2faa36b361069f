"""The ``xla`` pack backend: `jnp.take` per layer + one `dynamic_update_slice`, any platform.

Runs wherever JAX runs (CPU, TPU, CUDA, ROCm): no kernel, so no alignment rule (any byte
offset). The offset is traced; the row count is a shape, so each distinct n compiles once
(callers that want fewer compiles bucket their requests). numpy inputs are imported, gathered
by XLA on the CPU and the region copied back into the numpy pack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.registry import PackBackend, register_backend


@jax.jit
def _pack_xla(layers, idx, pack, offset):
    region = jnp.concatenate([jnp.take(a, idx, axis=0).reshape(-1) for a in layers])
    return jax.lax.dynamic_update_slice(pack, region, (offset,))


class XlaBackend(PackBackend):
    name = "xla"
    kinds = ("numpy", "jax")

    def _pack(self, layers, idx, pack, offset, kind, page_size):
        n = int(idx.size)
        if n == 0:
            return pack
        out = _pack_xla([jnp.asarray(a) for a in layers], jnp.asarray(idx.astype(np.int32)),
                        jnp.asarray(pack), np.int32(offset))
        if kind == "numpy":
            total = n * sum(int(a.shape[1]) for a in layers)
            pack[offset:offset + total] = np.asarray(out[offset:offset + total])
            return pack
        return out


register_backend(XlaBackend())
