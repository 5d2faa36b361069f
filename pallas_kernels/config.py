"""Shared knobs and geometry of the row-copy kernels (gather, scatter, copy).

Words: the kernels move the widest unsigned word (uint32, uint16, uint8) dividing every row
length (`word_dtype`). Row counts are padded to `bucket_rows` so few shapes compile; Triton
loads and stores have power-of-2 sizes (`pow2_chunks`). `GatherConfig` tunes every kernel;
`select_backend` resolves "auto". Addresses: `addressable_words` is the most words of a flat pack
a kernel may address (see `pallas_kernels.row_copy` for the 64-bit-safe address arithmetic).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import numpy as np

# Word dtypes the kernel moves, widest first. JAX without x64 has no 64-bit integers.
WORD_DTYPES = (np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))
BACKENDS = ("auto", "triton", "mosaic", "interpret")
SCHEDULES = ("grid", "loop")
DEFAULT_BLOCK_ROWS = 32
MAX_BLOCK_ROWS = 1024  # a program's rows live in registers: more would never compile well
# Word indices into a flat pack are uint32 in the kernels: a region may end at word 2**32 - 1.
MAX_PACK_WORDS = 2**32 - 1
# Kept for callers of the int32 era: offsets below it are valid on every backend (Mosaic's
# address arithmetic is int32, so it stays limited to this).
MAX_WORD_OFFSET = 2**31 - 1


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
        return _default_of(cls)


@functools.cache
def _default_of(cls) -> "GatherConfig":
    """`GatherConfig.default()`: one frozen instance per class (every call without a config built
    it anew, ~8 us of checks on the H200 host, and handed the jit a new static argument to hash)."""
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

    Raises:
        TypeError: `n` not an int (a numpy integer is one); ValueError: a negative `n`, or a
            `block_rows` that is not a power of 2 >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n={n!r} must be an int (rows), not {type(n).__name__}")
    n = int(n)  # (a numpy integer has no bit_length)
    if n < 0:
        raise ValueError(f"{n=} must be >= 0")
    if isinstance(block_rows, bool) or not isinstance(block_rows, (int, np.integer)) or block_rows < 1 \
            or block_rows & (block_rows - 1):
        raise ValueError(f"{block_rows=} must be a power of 2 >= 1 (rows per program)")
    return max(block_rows, 1 << (max(n, 1) - 1).bit_length())


def buckets_up_to(n: int, block_rows: int = DEFAULT_BLOCK_ROWS) -> list[int]:
    """Every `bucket_rows` value a call of at most `n` rows (>= 1) can have, ascending:
    `block_rows`, doubling up to `bucket_rows(n, block_rows)` (what a warm-up compiles)."""
    out, m = [], block_rows
    while m <= bucket_rows(n, block_rows):
        out.append(m)
        m *= 2
    return out


def pow2_chunks(width: int) -> tuple[tuple[int, int], ...]:
    """Split a row of `width` words into power-of-2 pieces, largest first.

    The Triton lowering needs every load/store to have a power-of-2 element count:
    288 -> ((0, 256), (256, 32)); 576 -> ((0, 512), (512, 64)); 5 -> ((0, 4), (4, 1)).

    Raises:
        ValueError: `width` is not an int >= 0.
    """
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 0:
        raise ValueError(f"{width=} must be an int >= 0 (words)")
    width, chunks, off = int(width), [], 0  # (a numpy integer has no bit_length)
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


def addressable_words(pack_words: int, itemsize: int, backend: str = "triton") -> int:
    """How many leading words of a flat pack of `pack_words` words the kernels can address.

    The Triton lowering turns an index into a byte offset of 64 bits only when the array
    exceeds 2**32 bytes, and zero-extends the index to it: the kernels' uint32 word indices
    then reach word 2**32 - 1. A smaller array gets signed 32-bit offsets: words up to
    2**31 - 1 (only a uint8 pack of 2..4 GiB is cut short by this). Mosaic computes its
    addresses in int32.

    Args:
        pack_words: words in the pack (>= 0).
        itemsize: bytes per word (1, 2 or 4).
        backend: "triton", "interpret" or "mosaic".

    Returns:
        The count; a region must end at or before it.

    Raises:
        ValueError: a negative `pack_words`, an `itemsize` other than 1, 2 or 4, an unknown
            `backend`.
    """
    if pack_words < 0:
        raise ValueError(f"{pack_words=} must be >= 0")
    if itemsize not in (1, 2, 4):
        raise ValueError(f"{itemsize=} must be 1, 2 or 4 (bytes per word)")
    if backend not in ("triton", "interpret", "mosaic"):
        raise ValueError(f"{backend=} must be 'triton', 'interpret' or 'mosaic'")
    if backend == "mosaic":
        return min(pack_words, MAX_WORD_OFFSET)
    if pack_words * itemsize > 2**32:
        return min(pack_words, MAX_PACK_WORDS)
    return min(pack_words, MAX_WORD_OFFSET)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvSwitchError(ValueError):
    """A ``DCP_JAX_*`` environment switch holds a value it does not know (the message names the
    variable). Raised where the switch is read, which for some is at import: the CLI's entry point
    (`dcp_jax.cli_entry`) turns it into one error line and exit status 2."""


def env_flag(name: str, default: bool) -> bool:
    """The on/off environment switch `name` ("1"/"true"/"yes"/"on" or "0"/"false"/"no"/"off",
    any case, blanks around ignored; unset or empty: `default`).

    Raises:
        EnvSwitchError: any other value, naming the variable (a typo must not leave an A/B
            measuring the same thing twice).
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE or raw in _FALSE:
        return raw in _TRUE
    raise EnvSwitchError(f"{name}={os.environ[name]!r} must be one of {_TRUE + _FALSE} (or unset)")


__all__ = [
    "BACKENDS",
    "DEFAULT_BLOCK_ROWS",
    "EnvSwitchError",
    "MAX_BLOCK_ROWS",
    "MAX_PACK_WORDS",
    "MAX_WORD_OFFSET",
    "WORD_DTYPES",
    "GatherConfig",
    "addressable_words",
    "bucket_rows",
    "buckets_up_to",
    "env_flag",
    "pow2_chunks",
    "select_backend",
    "word_dtype",
]
