"""The job's staged path (``--staging``): KV the engine cannot (or is told not to) register.

Issue 14, item 3: when device memory cannot be registered (TPU today; JAX device arrays under
the ``jax-transfer`` engine; any device with ``--staging host``), the KV stays in device memory,
unregistered, and only pinned host memory meets the engine:

- prefill (`PrefillStager`): before each chunk is sent, the pages holding its rows are gathered
  on the device by a pack backend of the registry (`pallas_kernels.pack_region`, ``--pack-backend``),
  one call per layer, and copied into a registered pinned-host staging cache laid out like the
  KV (page k of the staging cache = the k-th page of the request's page table), which the
  connector sends from with the identity page table;
- decode (`DecodeStager`): the connector receives into a registered pinned-host pool; after
  SUCCESS the request's pages are copied host -> device KV (one scatter per layer), and the rank
  verifies the device KV.

Each side decides for itself (`side_path`) from what its engine can register of its memory:
"direct" (the engine registers the KV) or "staged"; the report names both. On the CPU the
"device" is the JAX CPU device (`memory_kind="device"`), the staging memory JAX's
``pinned_host`` (platform.md: its buffers are 64-byte aligned and numpy-addressable); on a GPU
the device KV is CuPy (or a JAX GPU array for backends that take only JAX) and the staging
memory CUDA pinned host memory.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

from dcp_jax.job import kv
from dcp_jax.job.config import STAGINGS, JobConfig, engine_registers  # noqa: F401 - re-exported

__all__ = ["STAGINGS", "engine_registers", "side_path", "pinned_host_buffer", "PrefillStager", "DecodeStager"]

def side_path(cfg: JobConfig) -> str:
    """"staged" or "direct" for one side of ``cfg`` (both sides run with the same memory here;
    the rule is `JobConfig.staged`)."""
    return "staged" if cfg.staged else "direct"


def pinned_host_buffer(nbytes: int, device: str) -> tuple[np.ndarray, Any]:
    """A writable uint8 [nbytes] numpy view of pinned host memory and its owner (keep it alive).

    CPU: a JAX ``pinned_host`` buffer (the memory kind TPU staging uses), viewed by address: JAX
    exports it read-only, but this buffer is never read by JAX as a value, only by the engine
    and the stagers. GPU: ``cupy.cuda.alloc_pinned_memory``.
    """
    nbytes = max(int(nbytes), 1)
    if device == "gpu":
        import cupy as cp

        mem = cp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, np.uint8, nbytes), mem
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0], memory_kind="pinned_host")
    owner = jax.device_put(np.zeros(nbytes, np.uint8), sharding)
    owner.block_until_ready()
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(owner.unsafe_buffer_pointer()))
    return view, owner


def _device_kind(cfg: JobConfig) -> str:
    """Array kind of the device KV: what the chosen backend takes on this device."""
    from pallas_kernels.registry import get_backend

    name = cfg.pack_backend
    if name == "auto":
        return "cupy" if cfg.device == "gpu" else "jax"
    kinds = get_backend(name).kinds
    if cfg.device == "gpu":
        return "cupy" if "cupy" in kinds else "jax"
    return "jax" if "jax" in kinds else "numpy"


def _to_device(a, kind: str):
    """A device copy of host (numpy) or CuPy array ``a`` of the given kind."""
    if kind == "numpy":
        return np.array(a, copy=True)
    if kind == "cupy":
        import cupy as cp

        return cp.array(a, copy=True)
    import jax

    if not isinstance(a, np.ndarray):  # CuPy -> a JAX GPU array (a copy: the KV stays the caller's)
        import cupy as cp

        return jax.dlpack.from_dlpack(cp.array(a, copy=True))
    return jax.device_put(a, jax.devices()[0])


def _to_host(a, out: np.ndarray) -> None:
    """Copies device array ``a`` into host view ``out`` (same number of bytes)."""
    if isinstance(a, np.ndarray):
        if a.ctypes.data != out.ctypes.data:  # the host backend packed in place already
            out.reshape(-1)[:] = a.reshape(-1)
        return
    if type(a).__module__.split(".")[0] == "cupy":
        a.reshape(-1).get(out=out.reshape(-1))
        return
    out.reshape(-1)[:] = np.asarray(a).reshape(-1)


class PrefillStager:
    """A prefill rank's device KV and its registered pinned-host staging cache.

    Args:
        cfg: the job configuration (``pack_backend``, ``device``).
        layers: the rank's filled KV, host uint8 [pool_pages, page_size, item_len_l] per layer;
            copied to the device once here.
        table: the rank's page table (int64 [K]); the staging cache has K pages, page k holding
            ``table[k]``.
        local: the local row of each token this rank sends (int64), to find a chunk's pages.
        tokens: those tokens (absolute positions, int64), in the same order.
    """

    def __init__(self, cfg: JobConfig, layers: list[np.ndarray], table: np.ndarray, local: np.ndarray,
                 tokens: np.ndarray):
        self.cfg, self.page_size = cfg, cfg.src_page_size
        self.kind = _device_kind(cfg)
        self.table = np.asarray(table, np.int64)
        self.local, self.tokens = np.asarray(local, np.int64), np.asarray(tokens, np.int64)
        self.item_lens = [int(v.shape[2]) for v in layers]
        self.device_rows = [_to_device(v.reshape(-1, v.shape[2]), self.kind) for v in layers]
        k = len(self.table)
        self.host, self._owner = pinned_host_buffer(kv.kv_bytes(k, self.page_size, self.item_lens), cfg.device)
        self.host_layers = kv.layer_views(self.host, k, self.page_size, self.item_lens)
        self.staged_table = np.arange(k, dtype=np.int64)
        self.seconds = 0.0

    def stage(self, start: int, stop: int) -> None:
        """Gathers the pages of chunk [start, stop) on the device and copies them into the staging
        cache (adds the time to `seconds`)."""
        from pallas_kernels import pack_region

        t0 = time.perf_counter()
        sel = self.local[(self.tokens >= start) & (self.tokens < stop)]
        if len(sel):
            p = self.page_size
            k0, k1 = int(sel.min()) // p, int(sel.max()) // p + 1
            rows = (self.table[k0:k1, None] * p + np.arange(p)).reshape(-1)
            for l, src in enumerate(self.device_rows):
                dst = self.host_layers[l][k0:k1]
                pack = dst.reshape(-1) if self.kind == "numpy" else _empty(self.kind, dst.size)
                out = pack_region([src], rows, pack, backend=self.cfg.pack_backend)
                _to_host(out, dst)
        self.seconds += time.perf_counter() - t0


def _empty(kind: str, n: int):
    if kind == "cupy":
        import cupy as cp

        return cp.empty(n, cp.uint8)
    import jax.numpy as jnp

    return jnp.zeros(n, jnp.uint8)


class DecodeStager:
    """A decode rank's registered pinned-host pool and its device KV.

    Args:
        cfg: the job configuration.
        pool_pages: pages of each layer.
    """

    def __init__(self, cfg: JobConfig, pool_pages: int):
        self.cfg, self.pool_pages = cfg, pool_pages
        self.item_lens = [int(i) for i in cfg.geometry.kv_item_lens]
        self.kind = "cupy" if cfg.device == "gpu" else "jax"
        self.host, self._owner = pinned_host_buffer(kv.kv_bytes(pool_pages, cfg.page_size, self.item_lens),
                                                    cfg.device)
        self.host_layers = kv.layer_views(self.host, pool_pages, cfg.page_size, self.item_lens)
        self.device_layers = [_to_device(v, self.kind) for v in self.host_layers]
        self.seconds = 0.0

    def fill(self, byte: int) -> None:
        """Both the staging pool and the device KV hold ``byte`` everywhere."""
        self.host[:] = byte
        self.device_layers = [_to_device(v, self.kind) for v in self.host_layers]

    def unstage(self, table: np.ndarray) -> None:
        """Copies the request's pages (``table``) host -> device KV (adds the time to `seconds`)."""
        t0 = time.perf_counter()
        pages = np.asarray(table, np.int64)
        for l, host in enumerate(self.host_layers):
            dev = self.device_layers[l]
            if self.kind == "cupy":
                import cupy as cp

                dev[cp.asarray(pages)] = cp.asarray(host[pages])
                cp.cuda.runtime.deviceSynchronize()
            else:
                self.device_layers[l] = dev.at[pages].set(host[pages])
                self.device_layers[l].block_until_ready()
        self.seconds += time.perf_counter() - t0

    def device_bytes(self) -> np.ndarray:
        """The device KV copied back to one layer-major host buffer (what the rank verifies)."""
        out = np.empty(self.host.size, np.uint8)
        off = 0
        for dev in self.device_layers:
            n = int(np.prod(dev.shape))
            _to_host(dev, out[off:off + n])
            off += n
        return out
