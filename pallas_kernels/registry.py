"""One pack API over every accelerator: `pack_region` picks a backend from a registry.

`pack_region(layers, indices, pack, offset=...)` writes one rank's layer-major region of a
pack buffer (spec section 6, the same contract as `pallas_kernels.pack_rows`): entry l goes to
bytes `[offset + off_l, offset + off_l + n * item_len_l)`, `off_l = sum_{k<l} n * item_len_k`,
row j of it being `layers[l][indices[j]]`; no other byte of `pack` changes.

Backends (registered by `pallas_kernels.backends`), by name:

| name | runs on | arrays it takes |
|---|---|---|
| ``tpu`` | a TPU (Pallas Mosaic TPU: per-row DMA from HBM, or whole-page BlockSpecs) | JAX |
| ``tpu-interpret`` | CPU (the same kernel under `interpret=True`) | numpy, JAX |
| ``gpu-mosaic`` | NVIDIA Hopper and newer (`pack_rows(backend="mosaic")`) | CuPy, JAX |
| ``gpu-mosaic-interpret`` | CPU (Mosaic GPU interpret mode; slow) | numpy, JAX |
| ``gpu-triton`` | NVIDIA, ROCm (`pack_rows(backend="triton")`) | CuPy, JAX |
| ``gpu-triton-interpret`` | CPU (`pack_rows(backend="interpret")`) | numpy, JAX |
| ``xla`` | any JAX platform: CPU, TPU, CUDA, ROCm (`jnp.take`, `dynamic_update_slice`) | numpy, JAX |
| ``host`` | the host (`pack_rows(backend="numpy")`, threaded `np.take`) | numpy |

``backend="auto"`` picks by the platform of `pack` (`array_platform`) and by capability (row
lengths, offset alignment), in the order of `AUTO_ORDER`; a backend that cannot take the
geometry is skipped. A named backend is used or refused with a ValueError that says why.

Results: numpy and CuPy packs are written in place and returned; a JAX pack is immutable, so
the call returns a new `jax.Array` (the argument is not donated). `reference_region` is the
one reference gather every backend is checked against (byte loops, no `np.take`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from pallas_kernels._buffer_args import _check_disjoint, check_fits, check_offset
from pallas_kernels.config import word_dtype

KINDS = ("numpy", "cupy", "jax")
PLATFORMS = ("host", "cpu", "tpu", "cuda", "rocm")

# Preference per platform of the pack; the first backend that is available and takes the
# geometry wins. CUDA: Triton first while the JAX version ships it (KERNELS' `select_backend`
# measured it faster on the H200: 4,150 GB/s), which `_cuda_order` applies.
AUTO_ORDER = {
    "host": ("host",),
    "cpu": ("xla",),
    "tpu": ("tpu", "xla"),
    "cuda": ("gpu-triton", "gpu-mosaic", "xla"),
    "rocm": ("gpu-triton", "xla"),
}

_REGISTRY: dict[str, "PackBackend"] = {}


class PackBackend(abc.ABC):
    """One way to gather a pack region. Subclasses set the class attributes and `_pack`.

    Attributes:
        name: registry name (see the module table).
        kinds: array kinds it takes ("numpy", "cupy", "jax"), all inputs of one kind.
        interpret: True for a kernel run by an interpreter on the CPU (tests, CI).
    """

    name: str = ""
    kinds: tuple[str, ...] = ()
    interpret: bool = False

    def unavailable(self) -> str | None:
        """Why this backend cannot run in this process (None when it can)."""
        return None

    def unsupported(self, item_lens: tuple[int, ...], offset: int) -> str | None:
        """Why this backend cannot take rows of `item_lens` bytes at byte `offset` (or None)."""
        return None

    def warm(self, layers: Sequence, max_rows: int) -> list[int]:
        """Compiles what packing up to `max_rows` rows of `layers` (u8[num_rows, item_len], of
        one of `kinds`) compiles, writing nothing: a serving loop's warm-up. Returns the row
        buckets compiled, ascending; [] where nothing is compiled ahead (this default)."""
        return []


#: Largest byte offset a backend that passes it to its kernel as int32 takes (`int32_offset`).
MAX_INT32_OFFSET = 2**31 - 1


def int32_offset(name: str, offset: int) -> str | None:
    """Why backend `name`, which hands the region's byte offset to XLA or its kernel as int32, cannot
    take `offset` (None when it fits): `auto` then picks another backend; naming it is refused
    with this reason before anything is written (an offset past 2**31 raised OverflowError)."""
    if offset > MAX_INT32_OFFSET:
        return f"offset={offset} must be < 2**31 B for the {name} backend (it passes the offset as int32)"
    return None


class WordBackend(PackBackend):
    """A backend whose kernel moves words (`pallas_kernels.word_dtype` of the row lengths): the
    region's byte offset must be a multiple of the word (the Pallas GPU and TPU backends)."""

    def unsupported(self, item_lens: tuple[int, ...], offset: int) -> str | None:
        word = word_dtype(item_lens)
        if offset % word.itemsize:
            return (f"offset={offset} must be a multiple of {word.itemsize} B (the {word.name} "
                    f"word of rows of {list(item_lens)} B)")
        return None

    @abc.abstractmethod
    def _pack(self, layers, idx: np.ndarray, pack, offset: int, kind: str, page_size):
        """Write the region (arguments already checked); return the pack."""

    def __repr__(self) -> str:
        return f"<PackBackend {self.name} kinds={self.kinds}>"


def register_backend(backend: PackBackend) -> PackBackend:
    """Add `backend` under its name (a second one of the same name replaces the first)."""
    if not isinstance(backend, PackBackend) or not backend.name:
        raise TypeError(f"backend must be a named PackBackend, got {backend!r}")
    _REGISTRY[backend.name] = backend
    return backend


def _load() -> None:
    import pallas_kernels.backends  # noqa: F401  (registers the built-in backends)


def backend_names() -> tuple[str, ...]:
    """Every registered backend's name."""
    _load()
    return tuple(_REGISTRY)


def get_backend(name: str) -> PackBackend:
    """The backend registered as `name`.

    Raises:
        ValueError: no such backend (the message lists the registered names).
    """
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"backend={name!r} must be 'auto' or one of {tuple(_REGISTRY)}")
    return _REGISTRY[name]


def available_backends(kind: str | None = None) -> tuple[str, ...]:
    """Names of the backends that can run here (optionally: that take arrays of `kind`)."""
    _load()
    return tuple(n for n, b in _REGISTRY.items()
                 if b.unavailable() is None and (kind is None or kind in b.kinds))


def array_kind(a) -> str:
    """"numpy", "cupy" or "jax" for an array; TypeError for anything else."""
    if isinstance(a, np.ndarray):
        return "numpy"
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        return "cupy"
    if mod in ("jax", "jaxlib"):
        return "jax"
    raise TypeError(f"expected a numpy, CuPy or JAX array, got {type(a).__name__}")


def array_platform(a) -> str:
    """Where an array lives: "host" (numpy), "cpu", "tpu", "cuda" or "rocm"."""
    kind = array_kind(a)
    if kind == "numpy":
        return "host"
    if kind == "cupy":
        import cupy as cp

        return "rocm" if cp.cuda.runtime.is_hip else "cuda"
    dev = next(iter(a.devices()))
    if dev.platform == "gpu":  # older JAX names both GPU platforms "gpu"
        return "rocm" if "rocm" in dev.client.platform_version.lower() else "cuda"
    return dev.platform


def select_pack_backend(layers, pack, backend: str = "auto", *, offset: int = 0) -> PackBackend:
    """The backend `pack_region` would use for these arrays.

    Raises:
        ValueError: unknown name; a named backend that is unavailable here, does not take
            this array kind or this geometry (the message says which); no backend fits.
    """
    kind = array_kind(pack)
    item_lens = tuple(int(a.shape[1]) for a in layers)
    if backend != "auto":
        b = get_backend(backend)
        why = b.unavailable()
        if why is None and kind not in b.kinds:
            why = f"it takes {b.kinds} arrays, not {kind}"
        if why is None:
            why = b.unsupported(item_lens, offset)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot pack here: {why}")
        return b
    _load()
    platform = array_platform(pack)
    tried = []
    for name in _auto_order(platform):
        b = _REGISTRY.get(name)
        if b is None or kind not in b.kinds:
            continue
        why = b.unavailable() or b.unsupported(item_lens, offset)
        if why is None:
            return b
        tried.append(f"{name}: {why}")
    raise ValueError(f"no pack backend for {kind} arrays on {platform}: {'; '.join(tried)}")


def _auto_order(platform: str) -> tuple[str, ...]:
    if platform != "cuda":
        return AUTO_ORDER.get(platform, ("xla",))
    from pallas_kernels import select_backend

    try:
        first = {"triton": "gpu-triton", "mosaic": "gpu-mosaic"}[select_backend("auto")]
    except (KeyError, ValueError):  # no GPU for JAX (CuPy only): keep the table's order
        return AUTO_ORDER["cuda"]
    return (first,) + tuple(n for n in AUTO_ORDER["cuda"] if n != first)


def _check(layers, indices, pack, offset):
    """Common checks: (kind, idx int64 numpy, item_lens, offset as a Python int). Errors name
    the argument."""
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("layers must be a non-empty list of 2-D uint8 arrays")
    kind = array_kind(pack)
    for l, a in enumerate(layers):
        try:
            k = array_kind(a)
        except TypeError as e:
            raise TypeError(f"layers[{l}]: {e}") from None
        if k != kind:
            raise TypeError(f"layers[{l}] is a {k} array but pack is {kind}: use one kind")
        if a.ndim != 2:
            raise ValueError(f"layers[{l}] must be 2-D [num_rows, kv_item_len], got {a.shape}")
        if np.dtype(a.dtype) != np.uint8:
            raise TypeError(f"layers[{l}] dtype {a.dtype} must be uint8 (view rows as bytes)")
    if pack.ndim != 1 or np.dtype(pack.dtype) != np.uint8:
        raise ValueError(f"pack must be a 1-D uint8 array, got {pack.dtype}{list(pack.shape)}")
    if kind in ("numpy", "cupy"):  # written in place: the same rules on every backend
        if not pack.flags.c_contiguous:
            raise ValueError("pack must be C-contiguous (a registered buffer, not a strided view)")
        if kind == "numpy" and not pack.flags.writeable:
            raise ValueError("pack must be writeable (a registered buffer, not a read-only view)")
        _check_disjoint(list(layers), "layers", [pack], "pack")
    offset = check_offset(offset)  # a Python int: numpy's uint64 near 2**64 overflowed the sums below
    if kind == "cupy":
        import cupy as cp

        idx = cp.asnumpy(indices) if _kind_or_none(indices) == "cupy" else np.asarray(indices)
    else:
        idx = np.asarray(indices)
    if idx.ndim == 0:  # a str, None or one int: not a list of rows (TypeError, as pack_rows)
        raise TypeError(f"indices must be a sequence or 1-D array of ints, got {type(indices).__name__}")
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
    if idx.size == 0:
        idx = idx.astype(np.int64)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices dtype {idx.dtype} must be an integer type")
    item_lens = tuple(int(a.shape[1]) for a in layers)
    if 0 in item_lens:  # refused by the kernel backends' configs; xla and host alike here
        raise ValueError(f"layers[{item_lens.index(0)}] has rows of 0 bytes: every layer needs kv_item_len >= 1")
    num_rows = min(int(a.shape[0]) for a in layers)
    if idx.size and (idx.min() < 0 or idx.max() >= num_rows):
        raise ValueError(f"indices must be in [0, num_rows={num_rows}), got "
                         f"[{idx.min()}, {idx.max()}]")
    check_fits(offset, idx.size, item_lens, pack.shape[0])
    return kind, idx.astype(np.int64), item_lens, offset


def _kind_or_none(a) -> str | None:
    try:
        return array_kind(a)
    except TypeError:
        return None


def pack_region(layers: Sequence, indices, pack, *, offset: int = 0, backend: str = "auto",
                page_size: int | None = None):
    """Gather rows of every layer into the layer-major region of `pack` at byte `offset`.

    Args:
        layers: non-empty sequence of u8[num_rows_l, kv_item_len_l] arrays (numpy, CuPy or
            JAX; all of `pack`'s kind) sharing one row index space. A cache of another dtype
            is refused: view its rows as bytes first (numpy / CuPy ``a.view(np.uint8)``; JAX
            ``jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(a.shape[0], -1)``).
        indices: int[n] source rows (any order, duplicates allowed), each < every layer's
            num_rows. Read on the host (a device array is copied once to check its range).
        pack: u8[size], the pack buffer (numpy/CuPy: written in place).
        offset: byte offset of the region. The kernel backends need a multiple of the word
            they move (`pallas_kernels.word_dtype(item_lens).itemsize`; 16 B for gpu-mosaic);
            host and xla take any offset.
        backend: "auto" or a registered name (`backend_names()`).
        page_size: rows per KV page. With it, the tpu backends gather whole pages through
            BlockSpecs when `indices` are whole aligned pages (block round-robin).

    Returns:
        The pack with the region written: the same numpy/CuPy object, or a new JAX array.

    Raises:
        ValueError: bad shapes, `indices` out of range, a negative `offset`, a region past the
            end of `pack`, an unknown or unfit `backend` (the message says why); a numpy or CuPy
            `pack` that is not C-contiguous, is read-only, or shares memory with a layer (on
            every backend alike).
        TypeError: non-uint8 buffers, mixed kinds, non-integer `indices`.
    """
    kind, idx, _, offset = _check(layers, indices, pack, offset)
    if page_size is not None and (isinstance(page_size, bool) or
                                  not isinstance(page_size, (int, np.integer)) or page_size <= 0):
        raise ValueError(f"{page_size=} must be None or a positive int (rows per page)")
    b = select_pack_backend(layers, pack, backend, offset=int(offset))
    return b._pack(list(layers), idx, pack, int(offset), kind, page_size)


def reference_region(layers, indices, pack, *, offset: int = 0) -> np.ndarray:
    """The reference gather: a numpy copy of `pack` with the region written row by row.

    Independent of every backend (a Python loop over rows, bytes joined), for tests.

    Raises:
        ValueError: `layers` empty or not 2-D with one row count; `indices` not 1-D integers
            in [0, num_rows); `pack` not 1-D, or the region past its end (each names the argument).
        TypeError: `indices` not a sequence or array (a str, None), or a buffer that is not
            numpy, CuPy or JAX.
    """
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("layers must be a non-empty list of 2-D uint8 arrays")
    out = np.array(_to_host(pack), dtype=np.uint8, copy=True)
    host = [_to_host(a) for a in layers]
    if any(a.ndim != 2 for a in host):
        raise ValueError("layers must be 2-D [num_rows, kv_item_len] arrays")
    if out.ndim != 1:
        raise ValueError(f"pack must be 1-D, got shape {out.shape}")
    try:
        idx = np.asarray(indices if isinstance(indices, (list, tuple, range)) else _to_host(indices))
    except TypeError:
        raise TypeError(f"indices must be a sequence or 1-D array of ints, got {type(indices).__name__}") from None
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"indices must be a 1-D integer array, got {idx.dtype}{list(idx.shape)}")
    num_rows = min(a.shape[0] for a in host)
    if idx.size and (idx.min() < 0 or idx.max() >= num_rows):
        raise ValueError(f"indices must be in [0, {num_rows}) (rows of the smallest layer)")
    offset = check_offset(offset)
    end = offset + idx.size * sum(a.shape[1] * a.itemsize for a in host)
    if end > out.size:
        raise ValueError(f"pack of {out.size} bytes cannot hold the region [{offset}, {end})")
    region = b"".join(host[l][int(r)].tobytes() for l in range(len(host)) for r in idx)
    out[offset:offset + len(region)] = np.frombuffer(region, np.uint8)
    return out


def _to_host(a) -> np.ndarray:
    kind = array_kind(a)
    if kind == "cupy":
        import cupy as cp

        return cp.asnumpy(a)
    return np.asarray(a)


__all__ = [
    "AUTO_ORDER", "PackBackend", "WordBackend", "array_kind", "array_platform", "available_backends",
    "backend_names", "get_backend", "pack_region", "reference_region", "register_backend",
    "select_pack_backend",
]
