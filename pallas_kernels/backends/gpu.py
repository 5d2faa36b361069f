"""GPU pack backends: ``gpu-triton`` and ``gpu-mosaic`` (plus their CPU ``-interpret`` forms).

They delegate to the kernels of `pallas_kernels.gather` / `pallas_kernels.mosaic_gather`:
CuPy buffers through `pack_rows(..., backend="triton" | "mosaic")` (in place, DLPack), JAX GPU
arrays through `gather_rows` on word views. ``gpu-triton`` serves NVIDIA and ROCm (Pallas'
Triton lowering targets both; deprecated from JAX 0.11, "best effort"); ``gpu-mosaic`` needs
Hopper or newer, rows of a multiple of 128 bytes and 16-byte offsets (`mosaic_gather`).

``gpu-triton-interpret`` runs the Triton kernel body under `interpret=True`
(`pack_rows(backend="interpret")`); ``gpu-mosaic-interpret`` runs the Mosaic GPU kernel under
`plgpu.InterpretGPUParams` (slow: about 1 s per 32-row block per layer on 2 cores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import GatherConfig, bucket_rows, gather_rows, pack_rows, word_dtype
from pallas_kernels.backends.tpu import _as_bytes, _as_words
from pallas_kernels.pack import _offset_align
from pallas_kernels.registry import WordBackend, register_backend

MOSAIC_ROW_QUANTUM = 128  # bytes: a bulk copy moves a multiple of the warpgroup size
MOSAIC_OFFSET_ALIGN = 16
MOSAIC_MIN_CAPABILITY = 9.0  # Hopper


def _jax_gpu() -> list:
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def _word_split(pack, word):
    ws = np.dtype(word).itemsize
    full = pack.shape[0] // ws * ws
    return _as_words(pack[:full], word), pack[full:]


class _GpuBackend(WordBackend):
    kernel = ""  # pack_rows / gather_rows backend name

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.name = f"gpu-{self.kernel}" + ("-interpret" if interpret else "")
        self.kinds = ("numpy", "jax") if interpret else ("cupy", "jax")

    def unavailable(self):
        if self.interpret:
            return None
        if not _jax_gpu():
            return f"no GPU for JAX (use gpu-{self.kernel}-interpret on a CPU)"
        return None


class GpuTritonBackend(_GpuBackend):
    kernel = "triton"

    def _pack(self, layers, idx, pack, offset, kind, page_size):
        if kind in ("numpy", "cupy"):
            pack_rows(layers, idx, pack, offset=offset,
                      backend="interpret" if self.interpret else "triton")
            return pack
        if self.interpret:  # JAX CPU arrays: through host copies, the kernel in interpret mode
            host = np.array(pack)
            pack_rows([np.asarray(a) for a in layers], idx, host, offset=offset,
                      backend="interpret")
            return jnp.asarray(host)
        return _gather_jax(layers, idx, pack, offset, "triton")


class GpuMosaicBackend(_GpuBackend):
    kernel = "mosaic"

    def unavailable(self):
        why = super().unavailable()
        if why is None and not self.interpret:
            caps = [float(getattr(d, "compute_capability", 0) or 0) for d in _jax_gpu()]
            if not any(c >= MOSAIC_MIN_CAPABILITY for c in caps):
                return f"Mosaic GPU needs compute capability >= {MOSAIC_MIN_CAPABILITY}"
        return why

    def unsupported(self, item_lens, offset):
        bad = [w for w in item_lens if w % MOSAIC_ROW_QUANTUM]
        if bad:
            return (f"rows of {bad} B are not multiples of {MOSAIC_ROW_QUANTUM} B "
                    "(Mosaic GPU bulk copies)")
        if offset % MOSAIC_OFFSET_ALIGN:
            return f"offset={offset} must be a multiple of {MOSAIC_OFFSET_ALIGN} B"
        return None

    def _pack(self, layers, idx, pack, offset, kind, page_size):
        if kind == "cupy":
            pack_rows(layers, idx, pack, offset=offset, backend="mosaic")
            return pack
        if not self.interpret:
            return _gather_jax(layers, idx, pack, offset, "mosaic")
        n = int(idx.size)
        if n == 0:
            return pack
        word = word_dtype(tuple(int(a.shape[1]) for a in layers))
        cfg = GatherConfig(block_rows=32)  # the smallest block the Mosaic kernel takes
        idx_pad = np.zeros(bucket_rows(n, cfg.block_rows), np.int32)
        idx_pad[:n] = idx
        out = _mosaic_interpret([jnp.asarray(a) for a in layers], jnp.asarray(idx_pad),
                                jnp.asarray(pack), n, offset, word=word, config=cfg)
        if kind == "numpy":
            total = n * sum(int(a.shape[1]) for a in layers)
            pack[offset:offset + total] = np.asarray(out[offset:offset + total])
            return pack
        return out


@functools.partial(jax.jit, static_argnames=("n", "offset", "word", "config"))
def _mosaic_interpret(layers, idx, pack, n, offset, *, word, config):
    from pallas_kernels.mosaic_gather import gather_rows_mosaic

    ws = np.dtype(word).itemsize
    words, tail = _word_split(pack, word)
    srcs = [_as_words(a, word) for a in layers]
    out = gather_rows_mosaic(srcs, idx, words, jnp.int32(n), offset=offset // ws,
                             widths=tuple(int(s.shape[1]) for s in srcs), config=config,
                             interpret=True)
    return jnp.concatenate([_as_bytes(out), tail])


def _gather_jax(layers, idx, pack, offset, kernel):
    """JAX GPU arrays through `gather_rows` (word views made by XLA, then the kernel)."""
    n = int(idx.size)
    if n == 0:
        return pack
    word = word_dtype(tuple(int(a.shape[1]) for a in layers))
    cfg = GatherConfig.default()
    idx_pad = np.zeros(bucket_rows(n, cfg.block_rows), np.int32)
    idx_pad[:n] = idx
    words, tail = _word_split(pack, word)
    out = gather_rows([_as_words(a, word) for a in layers], jnp.asarray(idx_pad), words, n,
                      offset=offset // word.itemsize, config=cfg, backend=kernel,
                      offset_align=_offset_align(offset, word))
    return jnp.concatenate([_as_bytes(out), tail])


register_backend(GpuTritonBackend(False))
register_backend(GpuTritonBackend(True))
register_backend(GpuMosaicBackend(False))
register_backend(GpuMosaicBackend(True))
