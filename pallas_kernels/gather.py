"""Strided row gather into a pack buffer (DCP spec section 6), as a Pallas kernel.

Before sending to a decode rank, the prefill side gathers that rank's source rows of every
layer entry into a contiguous, registered pack region, layer-major:

    entry l occupies words [offset + off_l, offset + off_l + n * width[l]),
    off_l = sum_{k<l} n * width[k]

where a *word* is the element type the kernel moves (uint32, uint16 or uint8: the widest one
that divides every row length, see `word_dtype`). Row `j < n` of entry `l` is
`src[l][indices[j]]`; no other word of the pack is touched.

Forms:

- stacked: `src` is one array `[L, R, W]` (every layer entry the same width);
- list: `src` is a sequence of `[R_l, W_l]` arrays, one per layer entry (what a serving engine
  registers); widths may differ between entries.

Backends:

- ``"triton"``: `pallas_call` with the Triton lowering (explicit `pltriton.CompilerParams`).
  Every load and store has a power-of-2 element count (a 288-word row is 256 + 32).
- ``"mosaic"``: `plgpu.kernel` (Mosaic GPU), per-row bulk copies through shared memory
  (see `pallas_kernels.mosaic_gather`).
- ``"interpret"``: the Triton kernel body under `interpret=True` (CPU, CI).
- ``"auto"``: interpret on CPU; on a GPU, Triton while the JAX version still ships the Triton
  lowering (< 0.12), Mosaic GPU afterwards.

The pack is aliased to the output (`input_output_aliases`) and donated, so the call writes in
place: into the CuPy memory when the pack was imported from CuPy by DLPack.

What compiles: one kernel per (shapes and dtype of `src`, `indices` and `pack`, `config`,
`backend`, `offset_align`, and whether `num_rows`/`offset` come as ints or as arrays). The row
count and the region offset are traced int32 values: pass `indices` padded to
`bucket_rows(n)` (any values) and the true count as `num_rows`, rows `>= num_rows` are
masked; a new `offset` (words, `0 <= offset <= MAX_WORD_OFFSET = 2**31 - 1`) never
recompiles. `compile_count()` says how many gather kernels this process has traced.

`gather_rows_reference` (plain `jnp.take`) is the oracle the tests compare against. The host
contract (`pack_rows`, `PackSource`) lives in `pallas_kernels.pack`; its names are re-exported
here.
"""

from __future__ import annotations

import dataclasses
import functools
import os  # noqa: F401  (`gather.os` stays patchable: the host pool in `pack` reads os.getpid)
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Word dtypes the kernel moves, widest first. JAX without x64 has no 64-bit integers.
WORD_DTYPES = (np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))
BACKENDS = ("auto", "triton", "mosaic", "interpret")
SCHEDULES = ("grid", "loop")
DEFAULT_BLOCK_ROWS = 32
MAX_BLOCK_ROWS = 1024  # a program's rows live in registers: more would never compile well
MAX_WORD_OFFSET = 2**31 - 1  # offsets and region ends are int32 word indices in the kernel
# Static arguments of the jitted entry point, written once.
_STATIC_ARGNAMES = ("config", "backend", "offset_align")


@dataclasses.dataclass(frozen=True, slots=True)
class GatherConfig:
    """Tuning knobs of the gather kernel (hashable, so it can be a static argument).

    Attributes:
        block_rows: rows per program (a power of 2). The Triton kernel holds
            `block_rows * W` words per program in registers.
        num_warps: warps per program (Triton).
        num_stages: software-pipelining depth (Triton; matters for ``schedule="loop"``).
        schedule: ``"grid"`` runs one program per (row block, layer entry); ``"loop"`` runs one
            program per row block that walks every layer entry (indices loaded once).
        eviction_policy: Triton cache hint for the streaming loads and stores
            (``None``, ``"evict_first"`` or ``"evict_last"``).
        layers_per_step: ``"loop"`` schedule: layer entries whose loads are issued before
            their stores (more bytes in flight per program, more registers).
        layers_per_program: ``"grid"`` schedule: layer entries one program copies (the grid's
            layer axis has ceil(L / layers_per_program) steps); their loads are issued before
            their stores, the row indices are loaded once.
        interleave: store each power-of-2 piece of a row right after loading it (fewer live
            registers, so more programs per SM) instead of loading every piece first.
        mask_loads: read only the rows < n (masked loads) instead of reading row 0 for the
            masked rows of the tail block.
        layers_fastest: ``"grid"`` schedule: launch the layer axis as the fastest-varying one
            (consecutive programs copy the same row block of successive layer entries) instead
            of the row-block axis.
        load_eviction_policy: Triton cache hint of the gathered loads (``None``,
            ``"evict_first"``: each row is read once; ``"evict_last"``).
        load_cache_modifier: PTX cache operator of the gathered loads (``None``, ``".cg"``:
            cache in L2 only, not L1; ``".ca"``). JAX 0.11's Triton lowering accepts these
            names but looks them up without the dot (a KeyError); `_patch_cache_modifiers`
            adds the dotted keys before the first such call.
    """

    block_rows: int = DEFAULT_BLOCK_ROWS
    num_warps: int = 8
    num_stages: int = 1
    schedule: str = "grid"
    eviction_policy: str | None = None
    layers_per_step: int = 1
    layers_per_program: int = 1
    interleave: bool = False
    load_eviction_policy: str | None = None
    mask_loads: bool = False
    layers_fastest: bool = False
    load_cache_modifier: str | None = None

    def __post_init__(self):
        for name in ("block_rows", "num_warps", "num_stages", "layers_per_step",
                     "layers_per_program"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name}={v!r} must be an int")
        for name in ("interleave", "mask_loads", "layers_fastest"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.block_rows > MAX_BLOCK_ROWS:
            raise ValueError(f"{self.block_rows=} must be <= {MAX_BLOCK_ROWS} (rows per program)")
        if self.num_warps > 32:  # 1024 threads, the most one CUDA thread block may have
            raise ValueError(f"{self.num_warps=} must be <= 32")
        if self.num_stages > 16:
            raise ValueError(f"{self.num_stages=} must be <= 16")
        if self.block_rows <= 0 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"{self.block_rows=} must be a positive power of 2")
        if self.num_warps <= 0 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.num_warps=} must be a positive power of 2")
        if self.num_stages <= 0:
            raise ValueError(f"{self.num_stages=} must be positive")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{self.schedule=} must be one of {SCHEDULES}")
        if self.layers_per_step <= 0:
            raise ValueError(f"{self.layers_per_step=} must be positive")
        if self.layers_per_program <= 0:
            raise ValueError(f"{self.layers_per_program=} must be positive")
        if self.load_eviction_policy not in (None, "evict_first", "evict_last"):
            raise ValueError(f"{self.load_eviction_policy=} must be None, 'evict_first' or "
                             "'evict_last'")
        if self.load_cache_modifier not in (None, ".ca", ".cg"):
            raise ValueError(f"{self.load_cache_modifier=} must be None, '.ca' or '.cg'")
        if self.eviction_policy not in (None, "evict_first", "evict_last"):
            raise ValueError(f"{self.eviction_policy=} must be None, 'evict_first' or 'evict_last'")

    @classmethod
    def default(cls) -> "GatherConfig":
        """The tuned knobs `pack_rows` uses: 64 rows x 16 warps, pieces stored right after their
        loads, loads hinted evict_last. Fastest or within 0.1 % of the fastest for every
        geometry, form and row count of benchmark run 7 on one H200 (4,150-4,160 GB/s on the
        61-layer 32,768-row packs, 97 % of a device copy; benchmarks/results/pack_notes.md)."""
        return cls(block_rows=64, num_warps=16, interleave=True, load_eviction_policy="evict_last")


def word_dtype(item_lens: Sequence[int], offset: int | None = None) -> np.dtype:
    """Widest word (uint32, uint16 or uint8) dividing every row length.

    The word depends on the row lengths alone, so one kernel serves every region offset. The
    alignment rule that comes with it: a byte offset handed to the Pallas paths of `pack_rows`
    must be a multiple of the word's size (4 bytes for rows of 1152 B or 576 B; the connector's
    arena aligns regions to 64 bytes, which satisfies every word).

    Args:
        item_lens: bytes per row of each layer entry (positive ints).
        offset: optional byte offset to check against that rule.

    Returns:
        The numpy dtype to view rows and pack as.

    Raises:
        ValueError: `item_lens` empty or not positive; `offset` negative or not a multiple of
            the word size.
    """
    item_lens = [int(x) for x in item_lens]
    if not item_lens or min(item_lens) <= 0:
        raise ValueError(f"{item_lens=} must be a non-empty list of positive byte counts")
    word = next(dt for dt in WORD_DTYPES if all(x % dt.itemsize == 0 for x in item_lens))
    if offset is not None:
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise ValueError(f"{offset=} must be a non-negative int (bytes)")
        if offset % word.itemsize:
            raise ValueError(f"{offset=} must be a multiple of {word.itemsize} bytes: the word "
                             f"({word.name}) of rows of {item_lens} B")
    return word


def bucket_rows(n: int, block_rows: int = DEFAULT_BLOCK_ROWS) -> int:
    """Padded row count: the next power of 2 >= max(n, block_rows), so few shapes compile.

    Args:
        n: rows to gather (>= 0).
        block_rows: the kernel's rows per program (a power of 2).

    Returns:
        The bucket size in rows, a multiple of `block_rows`.
    """
    if n < 0:
        raise ValueError(f"{n=} must be >= 0")
    return max(block_rows, 1 << max(0, (n - 1).bit_length()))


def pow2_chunks(width: int) -> tuple[tuple[int, int], ...]:
    """Split a row of `width` words into power-of-2 pieces, largest first.

    The Triton lowering needs every load/store to have a power-of-2 element count:
    288 -> ((0, 256), (256, 32)); 576 -> ((0, 512), (512, 64)); 5 -> ((0, 4), (4, 1)).
    """
    chunks, off = [], 0
    while off < width:
        size = 1 << ((width - off).bit_length() - 1)
        chunks.append((off, size))
        off += size
    return tuple(chunks)


def _pow2_factor(x: int, cap: int = 16) -> int:
    """Largest power of 2 dividing x, at most `cap` (x = 0 counts as divisible by cap)."""
    if x == 0:
        return cap
    return min(cap, x & -x)


def select_backend(backend: str = "auto") -> str:
    """Resolve ``"auto"`` by device and JAX version; validate explicit choices.

    Raises:
        ValueError: unknown `backend`, or a GPU backend requested without a GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} must be one of {BACKENDS}")
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        if not on_gpu:
            return "interpret"
        version = tuple(int(p) for p in jax.__version__.split(".")[:2])
        # The Triton lowering is deprecated from 0.11 and its pallas_call path breaks on 0.12.
        return "triton" if version < (0, 12) else "mosaic"
    if backend in ("triton", "mosaic") and not on_gpu:
        raise ValueError(f"{backend=} needs a CUDA GPU; use backend='interpret' on CPU")
    return backend


# --------------------------------------------------------------------------- kernel body


def _patch_cache_modifiers() -> None:
    """Let JAX 0.11's Triton lowering find the dotted cache modifiers it accepts.

    Its load rule admits ``".ca"``/``".cg"`` and then indexes a table keyed ``"ca"``/``"cg"``
    (KeyError). Adding the dotted keys is a no-op on versions whose table already has them.
    """
    from jax._src.pallas.triton import lowering

    table = getattr(lowering, "_STR_TO_CACHE_MODIFIER", None)
    if isinstance(table, dict):
        for key in ("ca", "cg"):
            if key in table:
                table.setdefault("." + key, table[key])


def _load_piece(src_ref, idx, off, size, *, layer, load_evict, mask=None, cache=None):
    """Gather one power-of-2 piece [block_rows, size] of `block_rows` rows.

    src_ref: [R, W] block (stacked "grid" schedule squeezes L, list entries) or [L, R, W]
    (a static or traced `layer`). `mask` ([block_rows] bool): rows to read (others read no
    memory); `load_evict`: Triton eviction policy of the loads; `cache`: PTX cache operator.
    """
    if load_evict is None and mask is None and cache is None:
        cols = pl.ds(off, size)
        return src_ref[idx, cols] if layer is None else src_ref[layer, idx, cols]
    from jax.experimental.pallas import triton as pltriton

    # All-array indexers ([block_rows, 1] rows x [1, size] columns): the masked-load path of
    # interpret mode does not take a slice next to an array index.
    r2 = idx[:, None]
    c2 = (off + jnp.arange(size, dtype=jnp.int32))[None, :]
    ref = src_ref.at[r2, c2] if layer is None else src_ref.at[layer, r2, c2]
    if mask is not None:
        mask = jnp.broadcast_to(mask[:, None], (idx.shape[0], size))
    return pltriton.load(ref, mask=mask, eviction_policy=load_evict, cache_modifier=cache)


def _load_layer(src_ref, idx, *, width, layer, load_evict=None, mask=None, cache=None):
    """Gather `block_rows` rows of one layer entry: one [block_rows, size] value per piece."""
    return [_load_piece(src_ref, idx, off, size, layer=layer, load_evict=load_evict, mask=mask,
                        cache=cache)
            for off, size in pow2_chunks(width)]


def _store_piece(out_ref, v, rows, valid, base, off, *, width, evict):
    """Store one piece at `base + row * width + off` of the flat pack [P], rows < n only."""
    from jax.experimental.pallas import triton as pltriton

    size = v.shape[1]
    flat = base + rows[:, None] * width + (off + jnp.arange(size, dtype=jnp.int32))[None, :]
    mask = jnp.broadcast_to(valid[:, None], (rows.shape[0], size))
    pltriton.store(out_ref.at[flat], v, mask=mask, eviction_policy=evict)


def _store_layer(out_ref, vals, rows, valid, base, *, width, evict):
    """Store gathered pieces at `base + row * width` of the flat pack [P], rows < n only."""
    for (off, _), v in zip(pow2_chunks(width), vals):
        _store_piece(out_ref, v, rows, valid, base, off, width=width, evict=evict)


def _copy_layers(jobs, out_ref, idx, rows, valid, *, evict, interleave, load_evict, cache=None):
    """Copy `block_rows` gathered rows of each job's layer entry into the flat pack.

    jobs: (src_ref, layer or None, width, base, load mask or None, store mask) per entry.
    Without `interleave` every load is issued before the first store (more bytes in flight);
    with it each piece is stored right after its load (fewer live registers).
    """
    if interleave:
        for src_ref, layer, width, base, lmask, smask in jobs:
            for off, size in pow2_chunks(width):
                v = _load_piece(src_ref, idx, off, size, layer=layer, load_evict=load_evict,
                                mask=lmask, cache=cache)
                _store_piece(out_ref, v, rows, smask, base, off, width=width, evict=evict)
        return
    loaded = [_load_layer(src_ref, idx, width=width, layer=layer, load_evict=load_evict,
                          mask=lmask, cache=cache)
              for src_ref, layer, width, _, lmask, _ in jobs]
    for (_, _, width, base, _, smask), vals in zip(jobs, loaded):
        _store_layer(out_ref, vals, rows, smask, base, width=width, evict=evict)


def _gather_kernel(
    meta_ref,  # i32[2]: rows to gather, region offset in units of offset_align words
    idx_ref,  # i32[block_rows]
    *refs,  # src refs (one stacked or L list entries), pack_in [P] (aliased), out [P]
    widths: tuple[int, ...],
    stacked: bool,
    schedule: str,
    block_rows: int,
    max_rows: int,
    pack_words: int,
    num_src_rows: int,
    offset_align: int,
    align: tuple[int, ...],
    evict: str | None,
    layers_per_step: int = 1,
    layers_per_program: int = 1,
    interleave: bool = False,
    load_evict: str | None = None,
    mask_loads: bool = False,
    layers_fastest: bool = False,
    load_cache: str | None = None,
):
    src_refs, out_ref = refs[:-2], refs[-1]
    num_layers = len(widths)
    i = pl.program_id(1 if layers_fastest and schedule == "grid" else 0)
    # The offset comes in units of `offset_align` words: a product with that constant lets
    # Triton's alignment analysis prove it (wide stores); a hint on a sum with a loaded
    # scalar can be lost, which cost 7 % on the 61-layer list form (H200).
    offset = meta_ref[1] * offset_align
    # Clamped here, not in XLA around the call: the jitted function is the kernel alone.
    # n never takes the region past the pack (nor past word 2**31 - 1: indices are int32); a
    # negative offset writes nothing.
    room = jax.lax.div(jnp.maximum(pack_words - offset, 0), sum(widths))
    n = jnp.minimum(jnp.maximum(meta_ref[0], 0), jnp.minimum(room, max_rows))
    n = jnp.where(offset >= 0, n, 0)
    rows = i * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    valid = rows < n
    # Masked rows read row 0 and store nothing; indices are clamped so no read is out of bounds.
    idx = jnp.where(valid, jnp.clip(idx_ref[...], 0, num_src_rows - 1), 0)
    prefix = [0]
    for w in widths:
        prefix.append(prefix[-1] + w)

    def base_of(l):
        # n * prefix[l] is divisible by prefix[l]'s power-of-2 factor, the offset by
        # `offset_align`: the hint states what the products already show.
        return pl.multiple_of(offset + n * prefix[l], align[l])

    copy = functools.partial(_copy_layers, out_ref=out_ref, idx=idx, rows=rows, valid=valid,
                             evict=evict, interleave=interleave, load_evict=load_evict,
                             cache=load_cache)
    G = layers_per_program
    lm = valid if mask_loads else None
    if schedule == "grid":
        g = pl.program_id(0 if layers_fastest else 1)
        if stacked and G == 1:
            # The src block is already layer `g` ([R, W], L squeezed).
            base = pl.multiple_of(offset + n * widths[0] * g,
                                  min(align[0], _pow2_factor(widths[0])))
            copy([(src_refs[0], None, widths[0], base, lm, valid)])
        elif stacked:
            # One program copies layers g*G .. g*G+G-1 of the whole [L, R, W] ref; past the
            # last layer, loads and stores are masked off (no memory traffic).
            W = widths[0]
            jobs = []
            for k in range(G):
                lk = g * G + k
                ok = lk < num_layers
                lc = jnp.minimum(lk, num_layers - 1)
                base = pl.multiple_of(offset + n * W * lc, min(align[0], _pow2_factor(W)))
                lmask = lm if num_layers % G == 0 else jnp.logical_and(valid, ok)
                jobs.append((src_refs[0], lc, W, base, lmask, jnp.logical_and(valid, ok)))
            copy(jobs)
        else:
            for gi in range(-(-num_layers // G)):
                @pl.when(g == gi)
                def _(gi=gi):
                    copy([(src_refs[l], None, widths[l], base_of(l), lm, valid)
                          for l in range(gi * G, min(num_layers, gi * G + G))])
    else:
        # Issue the loads of `layers_per_step` entries before their stores, so that many row
        # gathers are in flight per program (stores would otherwise order every next load).
        for s0 in range(0, num_layers, layers_per_step):
            copy([(src_refs[0] if stacked else src_refs[l], l if stacked else None, widths[l],
                   base_of(l), lm, valid)
                  for l in range(s0, min(num_layers, s0 + layers_per_step))])


# --------------------------------------------------------------------------- validation


def _layer_shapes(src) -> tuple[bool, list[tuple[int, int]], Any]:
    """(stacked, [(rows, width)] per layer entry, dtype); raises on bad ndim / dtype."""
    if isinstance(src, (list, tuple)):
        if not src:
            raise ValueError("src must hold at least one layer entry")
        shapes, dtypes = [], set()
        for l, a in enumerate(src):
            if a.ndim != 2:
                raise ValueError(f"src[{l}] must be 2-D [rows, width], got shape {a.shape}")
            shapes.append((int(a.shape[0]), int(a.shape[1])))
            dtypes.add(np.dtype(a.dtype))
        if len(dtypes) != 1:
            raise TypeError(f"src entries must share one dtype, got {sorted(map(str, dtypes))}")
        return False, shapes, dtypes.pop()
    if src.ndim != 3:
        raise ValueError(f"src must be [L, R, W] or a list of [R, W] arrays, got shape {src.shape}")
    L, R, W = (int(d) for d in src.shape)
    return True, [(R, W)] * L, np.dtype(src.dtype)


def _static_validate(src, indices, pack):
    stacked, shapes, dtype = _layer_shapes(src)
    if dtype not in WORD_DTYPES:
        raise TypeError(f"src dtype {dtype} must be one of uint32/uint16/uint8 (view rows as words)")
    if pack.ndim != 1:
        raise ValueError(f"pack must be 1-D, got shape {pack.shape}")
    if np.dtype(pack.dtype) != dtype:
        raise TypeError(f"pack dtype {pack.dtype} must equal the src dtype {dtype}")
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"indices dtype {indices.dtype} must be an integer type")
    if shapes and min(w for _, w in shapes) <= 0:
        raise ValueError(f"every layer width must be positive, got {[w for _, w in shapes]}")
    return stacked, shapes


def _is_int(x) -> bool:
    """A concrete integer: Python or numpy int (not bool) or a 0-d numpy integer array."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    return isinstance(x, np.ndarray) and x.ndim == 0 and np.issubdtype(x.dtype, np.integer)


def _i32_scalar(x, name: str):
    """An int32 scalar array (traced or on device) as the kernel takes it; others raise."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None or isinstance(x, np.ndarray):
        raise ValueError(f"{name}={x!r} must be an int or an integer scalar array")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} dtype {dtype} must be an integer type")
    if int(np.prod(shape)) != 1:
        raise ValueError(f"{name} must be a scalar, got shape {shape}")
    if dtype != jnp.int32:
        x = x.astype(jnp.int32)
    return x.reshape(()) if shape != () else x


def _rows_arg(num_rows, m: int):
    """num_rows as an int32 scalar: None -> m; a concrete int clamped to [0, m]."""
    if num_rows is None:
        return np.int32(m)
    if _is_int(num_rows):
        return np.int32(min(max(int(num_rows), 0), m))
    return _i32_scalar(num_rows, "num_rows")


def _offset_arg(offset, offset_align: int, backend: str, itemsize: int):
    """The offset in units of `offset_align` words, an int32 scalar as the kernel takes it.

    A concrete offset is checked against every rule (ValueError). A traced one that is not a
    multiple of `offset_align` becomes -1: the kernel then writes nothing.
    """
    if not _is_int(offset):
        if getattr(offset, "dtype", None) is None:  # bool, float, str, ...
            raise ValueError(f"{offset=} must be a non-negative int (words) or an int32 "
                             "scalar array")
        off = _i32_scalar(offset, "offset")
        if offset_align == 1:
            return off
        return jnp.where(off % offset_align == 0, off // offset_align, -1)
    off = int(offset)
    if off < 0:
        raise ValueError(f"{offset=} must be a non-negative int (words)")
    if off > MAX_WORD_OFFSET:
        raise ValueError(f"{offset=} words must be <= {MAX_WORD_OFFSET} (the kernel's word "
                         "indices are int32)")
    if off % offset_align:
        raise ValueError(f"{offset=} words must be a multiple of {offset_align=}")
    if backend == "mosaic" and (off * itemsize) % 16:
        raise ValueError(f"{offset=} words ({off * itemsize} bytes) must be a multiple of 16 "
                         "bytes for mosaic (bulk copies)")
    return np.int32(off // offset_align)


# --------------------------------------------------------------------------- trace counter

_KERNEL_TRACES = [0]
_KERNEL_TRACES_LOCK = threading.Lock()


def _count_kernel_trace() -> None:
    """Called by every kernel builder, in the Python body that runs only while tracing."""
    with _KERNEL_TRACES_LOCK:
        _KERNEL_TRACES[0] += 1


def compile_count() -> int:
    """Gather kernels (Triton/interpret `pallas_call` or Mosaic GPU) traced in this process.

    Each trace of `gather_rows` (or of `mosaic_gather.gather_rows_mosaic`) that builds a kernel
    adds one; a call that hits the jit cache adds nothing. After one warm-up call per row
    bucket, a serving loop should leave it unchanged: offsets, row counts and index values
    are traced.

    Returns:
        The count since the module was imported (an int >= 0).
    """
    return _KERNEL_TRACES[0]


# Modules the first lowering of each backend imports lazily. The Mosaic interpreters (imported
# by pallas_call's interpret lowering) register a JAX config flag that is part of the tracing
# context: were they imported during the first trace, every gather traced before would be
# traced, and compiled, once more on its next call. Importing them first keeps the count exact.
_LOWERING_MODULES = {
    "interpret": ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",
                  "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call"),
    "triton": ("jax.experimental.pallas.triton",),
    "mosaic": ("jax.experimental.pallas.mosaic_gpu",),
}
_PRELOADED: set[str] = set()


def _preload_lowering(backend: str) -> None:
    """Import `backend`'s lowering modules once, before its first trace (missing ones skipped)."""
    import importlib

    for name in _LOWERING_MODULES.get(backend, ()):
        try:
            importlib.import_module(name)
        except ImportError:  # another JAX version: its pallas_call skips them too
            pass
    _PRELOADED.add(backend)


# --------------------------------------------------------------------------- entry point


def gather_rows(
    src,
    indices: jax.Array,
    pack: jax.Array,
    num_rows: jax.Array | int | None = None,
    *,
    offset: jax.Array | int = 0,
    config: GatherConfig = GatherConfig(),
    backend: str = "auto",
    offset_align: int = 1,
) -> jax.Array:
    """Gather rows of every layer entry into the flat pack, layer-major, in place.

    For entry l (width W_l words) and j < n: pack[offset + off_l + j*W_l : ... + W_l] =
    src[l][indices[j]], off_l = sum_{k<l} n*W_k. Words outside these ranges keep their value.
    Jitted: `num_rows` and `offset` are traced int32 scalars, so neither recompiles.

    Args:
        src: u32/u16/u8[L, R, W] (stacked) or a list of u*[R_l, W_l] arrays (one per layer
            entry; widths may differ). Rows are words of the dtype, not bytes.
        indices: int[m] source rows (m >= n; rows past n are ignored, any value). Indices are
            clamped to [0, R-1] so the kernel never reads out of bounds; `pack_rows` checks
            them and raises instead.
        pack: 1-D array of the src dtype, donated; the result aliases its memory.
        num_rows: n, rows to gather (int or int32 scalar array, traced; default m). n is
            clamped so the layer-major region never extends past the end of `pack`, nor past
            word 2**31 - 1.
        offset: word offset of this region inside `pack` (int or integer scalar array,
            traced). An int must be in [0, 2**31 - 1] (`MAX_WORD_OFFSET`) and a multiple of
            `offset_align`; a traced one is not checked, but a negative one, or one off
            `offset_align`, writes nothing.
        config: `GatherConfig` tuning knobs (static). The dataclass defaults are the plain
            32-row kernel; `GatherConfig.default()` is the tuned one (`pack_rows` uses it).
        backend: "auto", "triton", "mosaic" or "interpret" (static; see module docstring).
            "mosaic" also needs the offset to be a multiple of 16 bytes.
        offset_align: power of 2 in [1, 16] (static, words) that `offset` is a multiple of.
            The kernel takes the offset in these units, so Triton can prove the region's
            alignment and keep 16-byte stores (4 words of uint32 are enough). With 1, the
            61-layer list pack of 1152-B rows ran at 58 % of the speed on an H200.
            `pack_rows` picks it from the offset (see `pallas_kernels.pack`).

    Returns:
        The pack (same shape and dtype), written in place when the input was donated.

    Raises:
        ValueError: wrong ndim, widths, `offset` (negative, past `MAX_WORD_OFFSET`, off
            `offset_align` or, for mosaic, off 16 bytes), `offset_align`, or a GPU backend
            without a GPU.
        TypeError: mixed or unsupported dtypes, or a non-integer `offset`/`num_rows` array.
    """
    backend = select_backend(backend)
    if backend not in _PRELOADED:
        _preload_lowering(backend)
    if (isinstance(offset_align, bool) or not isinstance(offset_align, (int, np.integer))
            or not 1 <= offset_align <= 16 or offset_align & (offset_align - 1)):
        raise ValueError(f"{offset_align=} must be a power of 2 in [1, 16] (words)")
    shape = getattr(indices, "shape", ())
    m = int(shape[0]) if len(shape) else 0
    n = _rows_arg(num_rows, m)
    units = _offset_arg(offset, int(offset_align), backend, np.dtype(pack.dtype).itemsize)
    # Concrete values travel as one i32[2] (one host-to-device copy per call, as many as a
    # bare row count); device or traced ones as a pair, stacked in the jitted function.
    if isinstance(n, np.integer) and isinstance(units, np.integer):
        meta = np.array((n, units), np.int32)
    else:
        meta = (n, units)
    return _gather_rows_jit(src, indices, pack, meta, config=config, backend=backend,
                            offset_align=int(offset_align))


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES, donate_argnames=("pack",))
def _gather_rows_jit(src, indices, pack, meta, *, config, backend, offset_align):
    """`gather_rows` after its argument checks. meta: i32[2] or a pair of i32[] (traced):
    rows to gather, offset in units of offset_align words (negative: write nothing)."""
    stacked, shapes = _static_validate(src, indices, pack)
    widths = tuple(w for _, w in shapes)
    m = int(indices.shape[0])
    if m == 0:
        return pack
    idx = indices if indices.dtype == jnp.int32 else indices.astype(jnp.int32)
    if isinstance(meta, tuple):
        meta = jnp.stack(meta)
    if backend == "mosaic":
        from pallas_kernels import mosaic_gather

        # The clamps of the Triton kernel, in XLA (the Mosaic kernel takes n as it is).
        num_rows, offset = meta[0], meta[1] * offset_align
        room = jnp.maximum(min(int(pack.shape[0]), MAX_WORD_OFFSET) - offset, 0) // sum(widths)
        n = jnp.where(offset >= 0, jnp.clip(num_rows, 0, jnp.minimum(room, m)), 0)
        min_rows = min(r for r, _ in shapes)
        return mosaic_gather.gather_rows_mosaic(src, jnp.clip(idx, 0, min_rows - 1), pack, n,
                                                offset=offset, widths=widths, config=config)
    return _gather_triton(src, idx, pack, meta, shapes=tuple(shapes), stacked=stacked,
                          config=config, interpret=backend == "interpret",
                          offset_align=offset_align)


gather_rows._cache_size = _gather_rows_jit._cache_size  # compiled variants (tests, tools)


def _gather_triton(src, idx, pack, meta, *, shapes, stacked, config, interpret, offset_align):
    """Build and call the Triton-form `pallas_call` (meta: i32[2], rows and offset units)."""
    from jax.experimental.pallas import triton as pltriton

    _count_kernel_trace()
    widths = tuple(w for _, w in shapes)
    br = config.block_rows
    m = int(idx.shape[0])
    m_pad = -(-m // br) * br
    if m_pad != m:
        idx = jnp.pad(idx, (0, m_pad - m))
    num_blocks = m_pad // br
    prefix = np.concatenate([[0], np.cumsum(widths)])
    align = tuple(min(offset_align, _pow2_factor(int(p))) for p in prefix[:-1])
    P = int(pack.shape[0])
    L = len(widths)
    srcs = [src] if stacked else list(src)
    if config.schedule == "grid":
        num_groups = -(-L // config.layers_per_program)
        if config.layers_fastest:
            grid = (num_groups, num_blocks)

            def spec(block, f):  # index maps take (row block, layer group) either way
                return pl.BlockSpec(block, lambda l, i: f(i, l))
        else:
            grid = (num_blocks, num_groups)

            def spec(block, f):
                return pl.BlockSpec(block, f)
        meta_spec = spec((2,), lambda i, l: (0,))
        idx_spec = spec((br,), lambda i, l: (i,))
        if stacked and config.layers_per_program > 1:
            src_specs = [spec(tuple(src.shape), lambda i, l: (0, 0, 0))]
        elif stacked:
            R, W = shapes[0]
            src_specs = [spec((None, R, W), lambda i, l: (l, 0, 0))]
        else:
            src_specs = [spec(s, lambda i, l: (0, 0)) for s in shapes]
        pack_spec = spec((P,), lambda i, l: (0,))
    else:
        grid = (num_blocks,)
        meta_spec = pl.BlockSpec((2,), lambda i: (0,))
        idx_spec = pl.BlockSpec((br,), lambda i: (i,))
        if stacked:
            src_specs = [pl.BlockSpec(tuple(src.shape), lambda i: (0, 0, 0))]
        else:
            src_specs = [pl.BlockSpec(s, lambda i: (0, 0)) for s in shapes]
        pack_spec = pl.BlockSpec((P,), lambda i: (0,))
    kernel = functools.partial(
        _gather_kernel, widths=widths, stacked=stacked, schedule=config.schedule,
        block_rows=br, max_rows=m, pack_words=min(P, MAX_WORD_OFFSET), offset_align=offset_align,
        num_src_rows=min(r for r, _ in shapes), align=align, evict=config.eviction_policy,
        layers_per_step=config.layers_per_step, layers_per_program=config.layers_per_program,
        interleave=config.interleave, load_evict=config.load_eviction_policy,
        mask_loads=config.mask_loads, layers_fastest=config.layers_fastest,
        load_cache=config.load_cache_modifier)
    if config.load_cache_modifier is not None:
        _patch_cache_modifiers()
    n_in = 2 + len(srcs)
    call = pl.pallas_call(
        kernel,
        grid=grid,
        # The aliased pack input gets the output's BlockSpec (an ANY-space alias crashes
        # interpret mode on 0.11+ with ragged blocks; on Triton it is never read).
        in_specs=[meta_spec, idx_spec, *src_specs, pack_spec],
        out_specs=pack_spec,
        out_shape=jax.ShapeDtypeStruct(pack.shape, pack.dtype),
        input_output_aliases={n_in: 0},
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"kv_gather_{config.schedule}_{br=}_{L=}_g{config.layers_per_program}",
    )
    return call(meta, idx, *srcs, pack)


# --------------------------------------------------------------------------- reference


def gather_rows_reference(src, indices, pack, num_rows=None, *, offset: int = 0) -> jax.Array:
    """`gather_rows` in plain `jnp.take` (the oracle; same arguments and result).

    Args:
        src: [L, R, W] or a list of [R_l, W_l] arrays (one integer dtype).
        indices: int[m]; the first `num_rows` are used.
        pack: 1-D array of the src dtype (not modified; a new array is returned).
        num_rows: n (Python int, default m).
        offset: word offset of the region (a concrete int, unlike `gather_rows`).

    Returns:
        A copy of `pack` with the layer-major region written.

    Raises:
        ValueError: as `gather_rows` (shapes, a negative or too large `offset`).
        TypeError: as `gather_rows` (dtypes).
    """
    stacked, shapes = _static_validate(src, indices, pack)
    if not _is_int(offset):
        raise ValueError(f"{offset=} must be a concrete non-negative int (words)")
    offset = int(_offset_arg(offset, 1, "interpret", 1))
    n = int(indices.shape[0]) if num_rows is None else int(num_rows)
    layers = [src[l] for l in range(len(shapes))] if stacked else list(src)
    idx = jnp.asarray(indices)[:n]
    pieces = [jnp.take(jnp.asarray(a), idx, axis=0).reshape(-1) for a in layers]
    region = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), pack.dtype)
    return jnp.asarray(pack).at[offset:offset + region.shape[0]].set(region)


# --------------------------------------------------------------------------- host contract

# `pack_rows` and its helpers moved to `pallas_kernels.pack`; `from pallas_kernels.gather import
# pack_rows` (and the private names tests use) still works, resolved lazily (pack imports this).
_PACK_NAMES = frozenset({
    "PackSource", "pack_rows", "clear_import_cache", "HOST_MAX_THREADS", "HOST_MAX_THREADS_ARG",
    "HOST_THREADS_MIN_BYTES", "_HOST_POOL", "_host_pool", "_CHECKED_LAYERS", "_IMPORTED_LAYERS",
    "_MAX_CACHED_LAYERS", "_is_cupy"})


def __getattr__(name: str):
    if name in _PACK_NAMES:
        from pallas_kernels import pack

        return getattr(pack, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "MAX_WORD_OFFSET",
    "GatherConfig",
    "PackSource",
    "bucket_rows",
    "clear_import_cache",
    "compile_count",
    "gather_rows",
    "gather_rows_reference",
    "pack_rows",
    "pow2_chunks",
    "select_backend",
    "word_dtype",
]
