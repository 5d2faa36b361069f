"""The main job: ship one request's KV from prefill processes to DCP decode-rank processes.

``dcp-jax transfer`` (see ``dcp_jax.cli``) calls :func:`run_job`. It starts ``prefill_dcp_size``
prefill processes and ``dcp_size`` decode-rank processes (multiprocessing *spawn*), each with one
transfer engine (NIXL or Mooncake) created once and reused for every mode. Control messages travel
over Pipes: engine ``PeerInfo``, page tables, layer base addresses, per-chunk completions, results.

Before the timed modes, an untimed warm-up (:meth:`PrefillServer.warm_up`) sends one small WRITE
per (prefill, decode) pair through the same engines and regions (from the KV and from the pack
region, with a notification the decode rank consumes) and plans chunk 0 once, so the first mode
does not pay first-use costs (connections, page faults, notification path) alone.

One request, per mode:

1. Every decode rank takes its page table from a seeded shuffled free list of its pool (as a real
   allocator leaves it), fills its whole registered pool with :data:`~dcp_jax.kv_data.SENTINEL_BYTE`
   and tells the prefill side ``dst_pages`` and its layer base addresses.
2. The prefill side (KV filled once with the deterministic pattern of ``dcp_jax.kv_data``, in pages
   drawn the same way) plans every (chunk, destination rank) with ``dcp_jax.plan`` and sends:

   - ``direct``: descriptors straight from the KV buffers (token round-robin: one per token per
     layer entry);
   - ``packed``: the rank's rows of every layer entry are gathered (``pallas_kernels.pack_rows``)
     into the rank's fixed region of the registered pack buffer, layer-major, then one descriptor
     per destination page run per layer entry.

   All layer entries of one (chunk, rank) are ONE engine call (or one per ``max_batch_indices``
   window, sent in order, stopping at the first failure). Packs for all ranks are in flight at
   once in their own regions; a region slot is rewritten only after the transfer reading it has
   completed (chunk barrier). Each region holds as many chunk slots as fit, so with
   ``chunk_tokens`` the pack of chunk k+1 overlaps the transfer of chunk k. Rows that do not fit
   a region are sent in slices (gather, send, wait, repeat); a region that holds no row falls back
   to per-row descriptors with a logged warning. Nothing is ever written past a region.
3. After a batch completes, the prefill sends the rank a completion message (with per-layer CRC-32
   checksums when ``verify``). The decode rank waits for the engine's own notification too (NIXL)
   before it reads the chunk; with ``verify`` it checks the checksums on arrival.
4. Every decode rank then verifies its whole pool byte for byte against the pattern (received rows
   hold their token's bytes; every other row still holds the sentinel). This full check, computed
   from the spec's ownership formulas independently of the planner, is the test of record; it runs
   always. The job's result is not verified if any byte of any rank is wrong.

With ``device="gpu"`` (``--device gpu``) the same code runs on device memory of GPU 0: the prefill KV
layer buffers and the pack buffer are CuPy allocations registered once as VRAM (the KV pattern is
generated on the host and copied over once at setup), ``pack_rows`` runs the Pallas gather writing
in place into the registered pack buffer, every decode pool is a CuPy allocation registered as VRAM
(decode processes never import JAX), and each decode rank copies its pool back to the host once to
verify it. Plans, descriptors, engine calls, barriers and results are the same as on the CPU; only
NIXL registers VRAM here.

The prefill side is a reusable :class:`PrefillServer`; a request that fails (a decode rank killed
mid-transfer, an engine error) raises :class:`RequestFailed` naming the rank and chunk within the
configured timeout, after every in-flight handle was waited or aborted and every pack region freed,
so the server can serve the next request to the ranks that remain.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing as mp
import os
import signal
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait as conn_wait
from typing import Any

import numpy as np

from dcp_jax.geometry import ModelGeometry, get_geometry
from dcp_jax.kv_data import (
    DECODE_SIDE,
    PREFILL_SIDE,
    SENTINEL_BYTE,
    draw_page_table,
    fill_rows,
    page_rows,
    pool_pages_for,
    rows_checksum,
    verify_rows,
)

__all__ = [
    "MODES",
    "ENGINES",
    "DEVICES",
    "check_device",
    "JobConfig",
    "RequestFailed",
    "DecodeTarget",
    "PrefillServer",
    "DecodeProcess",
    "start_decode_processes",
    "decode_owned_tokens",
    "decode_pool_pages",
    "check_host_memory",
    "estimate_host_bytes",
    "decode_page_table",
    "pack_region_rows",
    "request_page_tables",
    "run_job",
]

logger = logging.getLogger(__name__)

MODES = ("direct", "packed")
ENGINES = ("nixl", "mooncake", "auto")
DEVICES = ("cpu", "gpu")
MAX_RANKS = 64  # dcp_size / prefill_dcp_size: one process per rank
MAX_TIMEOUT_S = 86400.0  # a day; larger values overflow the pipes' and engines' wait calls
FAILURE_GRACE_S = 5.0  # after a process fails mid-mode, how long the others get to report
WARMUP_TAG = b"dcp-jax-warm-up"  # notification of the warm-up WRITE (NIXL), consumed by the decode rank

# Engines log to stderr on their own; keep loopback traffic and quiet logs unless the user set them.
_ENGINE_ENV = {
    "UCX_NET_DEVICES": "lo",
    "UCX_LOG_LEVEL": "fatal",
    "NIXL_LOG_LEVEL": "WARN",
    "MC_LOG_LEVEL": "ERROR",
}


def _engine_env() -> None:
    for k, v in _ENGINE_ENV.items():
        os.environ.setdefault(k, v)


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Knobs of one ``dcp-jax transfer`` run (all sizes in tokens unless stated).

    Attributes:
        model: geometry name (``dcp_jax.geometry``), e.g. ``"deepseek-v3"``.
        prompt_tokens: request length L (prefix included).
        page_size: tokens per KV page P, both sides.
        dcp_size: decode ranks N (processes).
        prefill_dcp_size: prefill ranks M (processes); each holds its own shard.
        interleave_size: decode-side interleave I (1 = token round-robin).
        prefill_interleave_size: prefill-side interleave when ``prefill_dcp_size > 1``.
        chunk_tokens: chunked prefill: send the request in chunks of this many tokens (a multiple
            of ``page_size``); None sends it as one chunk.
        prefix_tokens: tokens the decode side already holds (not sent); a multiple of
            ``lcm(P*N, I*N)``.
        modes: subset of :data:`MODES`, run in this order.
        engine: ``"nixl"``, ``"mooncake"`` or ``"auto"``.
        max_batch_indices: split each (chunk, rank) into windows of at most this many rows.
        pack_tokens: the pack buffer serves chunks of up to this many tokens
            (``N * ceil(pack_tokens / N) * sum(item_len)`` bytes); default: each region holds the
            most rows the prefill rank sends to one decode rank over the send range
            (:func:`pack_region_rows`), so nothing is sliced. Smaller values force sliced packing.
        verify: also send a CRC-32 per (chunk, rank, layer) with each completion and check it on
            arrival (the full byte verification runs regardless).
        seed: seeds the KV pattern and the page allocators.
        timeout_s: deadline for any single wait (engine, notification, control message), seconds.
        pool_slack: each side's page pool is this many times the pages the request needs.
        corrupt_rank: test hook: this decode rank flips one received byte on arrival of its first
            chunk (checks that verification catches it).
        die_rank: test hook: this decode rank SIGKILLs itself after ``die_after_chunks`` chunks.
        die_after_chunks: see ``die_rank``.
        device: where the KV, pack buffer and decode pools live: ``"cpu"`` (host memory registered
            as DRAM, numpy gather) or ``"gpu"`` (CuPy device memory of GPU 0 registered as VRAM,
            the Pallas gather writing in place into the registered pack buffer). ``"gpu"`` needs
            NIXL (the Mooncake build used here registers host memory only); ``engine="auto"``
            then means NIXL. Whether CuPy and a CUDA device are present is checked by
            :func:`check_device` (``run_job`` calls it), not here.

    Raises:
        ValueError: any value out of range; the message names the argument.
    """

    model: str = "deepseek-v3"
    prompt_tokens: int = 32768
    page_size: int = 64
    dcp_size: int = 8
    prefill_dcp_size: int = 1
    interleave_size: int = 1
    prefill_interleave_size: int = 1
    chunk_tokens: int | None = None
    prefix_tokens: int = 0
    modes: tuple[str, ...] = MODES
    engine: str = "nixl"
    max_batch_indices: int | None = None
    pack_tokens: int | None = None
    verify: bool = False
    seed: int = 0
    timeout_s: float = 300.0
    pool_slack: float = 1.25
    corrupt_rank: int | None = None
    die_rank: int | None = None
    die_after_chunks: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(self.modes))
        get_geometry(self.model)  # raises ValueError listing the valid names
        for name in ("prompt_tokens", "page_size", "dcp_size", "prefill_dcp_size",
                     "interleave_size", "prefill_interleave_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        for name in ("dcp_size", "prefill_dcp_size"):  # one process per rank
            if getattr(self, name) > MAX_RANKS:
                raise ValueError(f"{name}={getattr(self, name)} must be <= {MAX_RANKS} "
                                 "(the job starts one process per rank)")
        if isinstance(self.prefix_tokens, bool) or not isinstance(self.prefix_tokens, int) or self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens={self.prefix_tokens!r} must be an int >= 0")
        if self.prefix_tokens >= self.prompt_tokens:
            raise ValueError(f"prefix_tokens={self.prefix_tokens} must be < prompt_tokens={self.prompt_tokens}")
        n, p, i = self.dcp_size, self.page_size, self.interleave_size
        align = math.lcm(p * n, i * n)
        if self.prefix_tokens % align:
            raise ValueError(
                f"prefix_tokens={self.prefix_tokens} must be a multiple of {align} "
                f"(lcm(page_size*dcp_size, interleave_size*dcp_size))")
        if self.chunk_tokens is not None:
            if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
                raise ValueError(f"chunk_tokens={self.chunk_tokens!r} must be an int >= 1 (or None)")
            if self.chunk_tokens % p:
                raise ValueError(f"chunk_tokens={self.chunk_tokens} must be a multiple of page_size={p}")
        if not self.modes or any(md not in MODES for md in self.modes):
            raise ValueError(f"modes={self.modes!r} must be a non-empty subset of {MODES}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} must be one of {ENGINES}")
        for name in ("max_batch_indices", "pack_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r} must be an int >= 1 (or None)")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be in (0, {MAX_TIMEOUT_S}] seconds")
        if not self.pool_slack >= 1.0:
            raise ValueError(f"pool_slack={self.pool_slack!r} must be >= 1.0")
        for name in ("corrupt_rank", "die_rank"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.dcp_size:
                raise ValueError(f"{name}={v!r} must be in [0, dcp_size={self.dcp_size})")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} (--device) must be one of {DEVICES}")
        if self.device == "gpu" and self.engine == "mooncake":
            raise ValueError("device='gpu' (--device gpu) needs engine='nixl' (--engine nixl or auto): the "
                             "Mooncake build used here registers host memory only, not VRAM")

    @property
    def geometry(self) -> ModelGeometry:
        return get_geometry(self.model)

    @property
    def engine_kind(self) -> str:
        """The engine kind the processes create: ``engine``, except that ``"auto"`` on the GPU is NIXL."""
        return "nixl" if self.device == "gpu" and self.engine == "auto" else self.engine

    @property
    def send_tokens(self) -> int:
        """Tokens actually sent: ``prompt_tokens - prefix_tokens``."""
        return self.prompt_tokens - self.prefix_tokens

    def chunks(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every chunk in absolute token positions, in order."""
        c = self.chunk_tokens or self.send_tokens
        return [(s, min(c, self.prompt_tokens - s)) for s in range(self.prefix_tokens, self.prompt_tokens, c)]


# ------------------------------------------------------------------------------------------------
# Ownership, computed straight from the spec's formulas (section 2). The decode ranks use this
# brute-force form to verify what they received, independently of the planner being exercised.
# ------------------------------------------------------------------------------------------------
def _owner(t: np.ndarray, n: int, i: int) -> np.ndarray:
    return (t // i) % n


def _local_index(t: np.ndarray, n: int, i: int) -> np.ndarray:
    return (t // (i * n)) * i + t % i


def decode_owned_tokens(start: int, stop: int, dcp_size: int, dcp_rank: int, interleave_size: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``[start, stop)`` that rank ``dcp_rank`` owns, and their dense local index.

    The local index is counted from ``start`` (``local_index(t) - local_len(start, r)``), i.e. the
    position inside the rank's page table for the send range (spec sections 2-4). Brute force over
    every token, owner by definition.

    Args:
        start, stop: absolute token positions (tokens), ``0 <= start <= stop``.
        dcp_size, dcp_rank, interleave_size: N, r, I.

    Returns:
        ``(tokens, local)``: two int64 [n] arrays in token order.
    """
    t = np.arange(start, stop, dtype=np.int64)
    t = t[_owner(t, dcp_size, interleave_size) == dcp_rank]
    base = int(np.count_nonzero(_owner(np.arange(start, dtype=np.int64), dcp_size, interleave_size) == dcp_rank)) \
        if start else 0
    local = _local_index(t, dcp_size, interleave_size) - base
    return t, local


def decode_pool_pages(cfg: JobConfig, min_dcp_size: int | None = None) -> int:
    """Pages in each decode rank's pool: the largest share of any group of ``min_dcp_size`` ..
    ``cfg.dcp_size`` ranks, times ``cfg.pool_slack`` (plus one page).

    Raises:
        ValueError: ``min_dcp_size`` outside ``[1, cfg.dcp_size]``.
    """
    lo = cfg.dcp_size if min_dcp_size is None else min_dcp_size
    if not 1 <= lo <= cfg.dcp_size:
        raise ValueError(f"{min_dcp_size=} must be in [1, dcp_size={cfg.dcp_size}]")
    share = max(len(decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, n, r, cfg.interleave_size)[0])
                for n in range(lo, cfg.dcp_size + 1) for r in range(n))
    return _pool_pages(_pages_for(share, cfg.page_size), cfg.pool_slack)


def decode_page_table(cfg: JobConfig, dcp_rank: int, dcp_size: int, pool_pages: int, *, seq: int = 0) -> np.ndarray:
    """A decode rank's page table for the send range, popped from a seeded shuffled free list.

    Args:
        cfg: job configuration (seed, sizes).
        dcp_rank, dcp_size: r and N of the group serving this request.
        pool_pages: pages in the rank's registered pool.
        seq: request sequence number (a new request gets a new allocation).

    Returns:
        int64 [ceil(rows / P)] page ids.

    Raises:
        ValueError: the pool is too small for the rank's rows.
    """
    rows = len(decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, dcp_size, dcp_rank, cfg.interleave_size)[0])
    need = _pages_for(rows, cfg.page_size)
    if need > pool_pages:
        raise ValueError(f"dcp_rank={dcp_rank} of dcp_size={dcp_size} needs {need} pages, {pool_pages=}")
    return draw_page_table(rows, cfg.page_size, pool_pages, cfg.seed, DECODE_SIDE, dcp_rank, seq)


def _pages_for(rows: int, page_size: int) -> int:
    return -(-rows // page_size)


def _pool_pages(pages: int, slack: float) -> int:
    return pool_pages_for(pages, slack)


def _host_alloc(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] in anonymous, page-aligned memory, with transparent huge pages requested.

    Huge pages cut the page faults of first touch and the page walks of engine copies on the
    multi-GB KV, pool and pack buffers; where the kernel refuses, ordinary pages are used.
    """
    import mmap

    mm = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP support: plain pages
        pass
    return np.frombuffer(mm, dtype=np.uint8, count=int(nbytes))


# ------------------------------------------------------------------------------------------------
# Device selection: the only place that knows host (numpy) from device (CuPy) buffers. Everything
# else (plans, descriptors, engine calls, barriers) sees an array, its address and its region.
# ------------------------------------------------------------------------------------------------
def check_device(device: str) -> None:
    """Checks that ``device`` can run here.

    Args:
        device: ``"cpu"`` or ``"gpu"``.

    Raises:
        ValueError: unknown device, or ``"gpu"`` without CuPy or without a CUDA device; the
            message names the ``--device`` option.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} (--device) must be one of {DEVICES}")
    if device == "cpu":
        return
    try:
        import cupy as cp
    except Exception as exc:  # noqa: BLE001 - ImportError, or CuPy failing to load its CUDA libraries
        raise ValueError(f"device='gpu' (--device gpu) needs CuPy and a CUDA GPU, but CuPy does not import here "
                         f"({type(exc).__name__}: {exc}); install the gpu extra or use --device cpu") from None
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
        why = f"{count} CUDA devices"
    except Exception as exc:  # noqa: BLE001 - no driver: CUDARuntimeError
        count, why = 0, f"{type(exc).__name__}: {exc}"
    if count < 1:
        raise ValueError(f"device='gpu' (--device gpu) needs a CUDA GPU, found none ({why}); use --device cpu")


def _is_host(a: Any) -> bool:
    return isinstance(a, np.ndarray)


def _alloc_buffer(nbytes: int, device: str, *, like: np.ndarray | None = None) -> tuple[Any, Any]:
    """One registrable uint8 [nbytes] buffer: ``(array, region)``.

    ``"cpu"``: page-aligned host memory (``_host_alloc``); the region is the numpy array itself.
    ``"gpu"``: a CuPy allocation on GPU 0 (``bridge.buffers.DeviceBuffer``, registered as VRAM).
    ``like`` (host uint8 [nbytes]) gives the initial bytes: on the CPU it is returned as the buffer,
    on the GPU it is copied to the device once. Otherwise the buffer is zeroed.
    """
    if like is not None and like.nbytes != nbytes:
        raise ValueError(f"like has {like.nbytes} bytes, {nbytes=}")
    if device == "cpu":
        buf = like if like is not None else _host_alloc(nbytes)
        return buf, buf
    if device != "gpu":
        raise ValueError(f"device={device!r} (--device) must be one of {DEVICES}")
    from bridge.buffers import DeviceBuffer

    dev = DeviceBuffer(max(int(nbytes), 1), device_id=0)
    if like is not None:
        dev.array.set(like)  # host -> device, once, at setup
    _sync(dev.array)
    return dev.array, dev


def _buffer_addr(a: Any) -> int:
    """Address of byte 0 of a numpy (host) or CuPy (device) array."""
    return int(a.ctypes.data) if _is_host(a) else int(a.data.ptr)


def _sync(a: Any) -> None:
    """Waits until every queued device operation on ``a`` has finished (no-op on the host).

    The engines read and write device memory on their own streams: a fill or an upload must be
    complete before a peer is told the buffer is ready.
    """
    if not _is_host(a):
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


def _to_host(a: Any) -> np.ndarray:
    """The bytes of ``a`` as a numpy array (``a`` itself on the host; one device-to-host copy on the GPU)."""
    return a if _is_host(a) else a.get()


def _checksum(layer_rows: Any, rows: np.ndarray) -> int:
    """``rows_checksum`` of host or device rows (device rows are gathered on the GPU, then copied)."""
    if _is_host(layer_rows):
        return rows_checksum(layer_rows, rows)
    import cupy as cp

    got = layer_rows[cp.asarray(np.asarray(rows, np.int64))].get()
    return rows_checksum(got, slice(None))


def _flip_first_byte(layer_rows: Any, row: int) -> None:
    """Test hook: inverts byte 0 of one row (host or device)."""
    layer_rows[int(row), 0:1] ^= np.uint8(0xFF)
    _sync(layer_rows)


def _layer_views(buf: np.ndarray, pool_rows: int, item_lens: Sequence[int]) -> tuple[list[np.ndarray], list[int]]:
    """Views ``uint8 [pool_rows, item_len_l]`` of a layer-major buffer, and their byte offsets."""
    views, offs, off = [], [], 0
    for il in item_lens:
        views.append(buf[off: off + pool_rows * il].reshape(pool_rows, il))
        offs.append(off)
        off += pool_rows * il
    return views, offs


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
class RequestFailed(RuntimeError):
    """A request could not be delivered; raised by the prefill side after cleaning up.

    Attributes:
        dcp_rank: decode rank whose transfer failed (None if not rank-specific).
        chunk: chunk index that failed (None if not chunk-specific).
        cause: the underlying error's text.
    """

    def __init__(self, message: str, *, dcp_rank: int | None = None, chunk: int | None = None, cause: str = ""):
        self.dcp_rank, self.chunk, self.cause = dcp_rank, chunk, cause
        where = ", ".join(f"{k}={v}" for k, v in (("dcp_rank", dcp_rank), ("chunk", chunk)) if v is not None)
        super().__init__(f"{message}{f' ({where})' if where else ''}{': ' + cause if cause else ''}")

    def __reduce__(self):
        return (_rebuild_failed, (self.args[0], self.dcp_rank, self.chunk, self.cause))


def _rebuild_failed(text, rank, chunk, cause):
    e = RequestFailed.__new__(RequestFailed)
    e.dcp_rank, e.chunk, e.cause = rank, chunk, cause
    RuntimeError.__init__(e, text)
    return e


# ------------------------------------------------------------------------------------------------
# Plans (the only place that calls dcp_jax.plan)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DecodeTarget:
    """Where one decode rank receives a request (what the prefill side needs to send to it).

    Attributes:
        dcp_rank: the rank in the group serving this request.
        peer: its engine's peer name (from ``PrefillServer.connect``).
        layer_bases: i64[L] address of row 0 of each layer entry in its registered pool (bytes).
        dst_pages: i64[pages] its page table for the send range.
        conn: pipe end for completion messages (None: no messages, e.g. in unit tests).
    """

    dcp_rank: int
    peer: str
    layer_bases: np.ndarray  # i64[L] absolute addresses of each layer entry's row 0
    dst_pages: np.ndarray
    conn: Connection | None


def _prefill_page_table(cfg: JobConfig, prefill_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Prefill rank's (tokens, local index, page table, pool pages) for the send range.

    Deterministic in ``cfg.seed``, so every prefill rank can rebuild every other rank's table
    (the DCP-M -> DCP-N planner takes all of them).
    """
    tokens, local = decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.prefill_dcp_size,
                                        prefill_rank, cfg.prefill_interleave_size)
    num_pages = _pages_for(len(tokens), cfg.page_size)
    pool = _pool_pages(num_pages, cfg.pool_slack)
    return tokens, local, draw_page_table(len(tokens), cfg.page_size, pool, cfg.seed, PREFILL_SIDE, prefill_rank), pool


def pack_region_rows(tokens: np.ndarray, *, dcp_size: int, interleave_size: int, prefix_tokens: int = 0,
                     chunk_tokens: int | None = None, pack_tokens: int | None = None) -> tuple[int, int]:
    """Rows of one decode rank's pack region of a prefill rank, and the rows one chunk slot needs.

    The region holds the most rows this prefill rank sends to any one decode rank over the send
    range, so the default pack never slices, also when ``prefill_dcp_size > 1`` (one decode rank
    may then receive more than ``shard / N`` rows from one prefill rank) or when interleave
    blocks split unevenly. It is never smaller than the spec's ``ceil(max_tokens / N)`` (section
    6), which it equals for ``M = 1`` with even shares. ``pack_tokens`` overrides it with
    ``ceil(pack_tokens / N)`` (smaller values force sliced packing). The main job and the cost
    report (``dcp-jax plan``) both size regions with this function.

    Args:
        tokens: int64 [n] absolute positions of the prefill rank's tokens in the send range.
        dcp_size: N of the decode group.
        interleave_size: decode-side I (tokens).
        prefix_tokens: first token of the send range.
        chunk_tokens: chunk length (tokens), None for one chunk.
        pack_tokens: explicit pack buffer size in tokens (``--pack-tokens``), or None.

    Returns:
        ``(region_rows, slot_rows)``: rows per layer entry of a region, and the most rows this
        prefill rank sends to one decode rank in one chunk.
    """
    tokens = np.asarray(tokens, np.int64)
    owner = _owner(tokens, dcp_size, interleave_size)
    whole = int(np.bincount(owner, minlength=dcp_size).max()) if len(tokens) else 0
    per_chunk = whole
    if chunk_tokens and len(tokens):
        chunk = (tokens - prefix_tokens) // chunk_tokens
        per_chunk = int(np.bincount(chunk * dcp_size + owner).max())
    if pack_tokens is not None:
        return -(-pack_tokens // dcp_size), per_chunk
    return max(-(-len(tokens) // dcp_size), whole), per_chunk


def request_page_tables(cfg: JobConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The page tables of one request as the job draws them: every prefill rank's and every decode rank's.

    Decode tables are those of the first request (``seq=0``) to the ``cfg.dcp_size`` ranks, in
    pools of :func:`decode_pool_pages` pages; prefill tables are :func:`_prefill_page_table`'s.
    The cost report (``dcp-jax plan``) plans on these, so it prints the job's counts.

    Returns:
        ``(src_tables, dst_tables)``: ``prefill_dcp_size`` and ``dcp_size`` int64 page tables.
    """
    src = [_prefill_page_table(cfg, k)[2] for k in range(cfg.prefill_dcp_size)]
    pool = decode_pool_pages(cfg)
    return src, [decode_page_table(cfg, r, cfg.dcp_size, pool) for r in range(cfg.dcp_size)]


def _chunk_plans(cfg: JobConfig, prefill_rank: int, src_pages: np.ndarray, chunk: tuple[int, int],
                 targets: Sequence[DecodeTarget], dcp_size: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{dcp_rank: (src rows, dst rows)} int64 of one chunk from this prefill rank, via dcp_jax.plan."""
    from dcp_jax import plan as planmod

    p = cfg.page_size
    start, length = chunk
    out = {}
    if cfg.prefill_dcp_size == 1:
        off_pages = (start - cfg.prefix_tokens) // p
        pages = src_pages[off_pages: off_pages + _pages_for(length, p)]
        for tgt in targets:
            tp = planmod.build_token_transfer_plan(
                pages, tgt.dst_pages, page_size=p, dcp_size=dcp_size, dcp_rank=tgt.dcp_rank,
                interleave_size=cfg.interleave_size, src_page_offset=off_pages,
                decode_prefix_len=cfg.prefix_tokens, num_kv_tokens=length)
            out[tgt.dcp_rank] = (np.asarray(tp.src_token_indices, np.int64),
                                 np.asarray(tp.dst_token_indices, np.int64))
        return out
    m = cfg.prefill_dcp_size
    src_tables = [src_pages if k == prefill_rank else _prefill_page_table(cfg, k)[2] for k in range(m)]
    by_rank = {t.dcp_rank: t.dst_pages for t in targets}
    if sorted(by_rank) != list(range(dcp_size)):
        raise ValueError(f"prefill_dcp_size={m} needs page tables of all {dcp_size=} decode ranks")
    plans = planmod.build_mxn_transfer_plans(
        src_tables, [by_rank[r] for r in range(dcp_size)], page_size=p, prefill_dcp_size=m,
        dcp_size=dcp_size, num_kv_tokens=length, prefill_interleave_size=cfg.prefill_interleave_size,
        interleave_size=cfg.interleave_size, decode_prefix_len=cfg.prefix_tokens, chunk_start=start)
    empty = np.zeros(0, np.int64)
    for tgt in targets:
        tp = plans.get((prefill_rank, tgt.dcp_rank))
        out[tgt.dcp_rank] = (empty, empty) if tp is None else (
            np.asarray(tp.src_token_indices, np.int64), np.asarray(tp.dst_token_indices, np.int64))
    return out


def _descriptors(src_rows: np.ndarray, dst_rows: np.ndarray, src_bases: np.ndarray, dst_bases: np.ndarray,
                 item_lens: np.ndarray) -> np.ndarray:
    """i64[L*k, 3] layer-major descriptors of the runs of (src_rows, dst_rows) (spec section 5)."""
    from dcp_jax import plan as planmod

    runs = planmod.group_runs(src_rows, dst_rows)
    return planmod.build_descriptors(runs, src_bases, dst_bases, item_lens)


def _windows(n: int, w: int | None) -> list[tuple[int, int]]:
    if n == 0:
        return []  # nothing for this rank in this chunk: no batch, only the completion message
    if w is None:
        return [(0, n)]
    return [(s, min(s + w, n)) for s in range(0, n, w)]


# ------------------------------------------------------------------------------------------------
# Prefill side
# ------------------------------------------------------------------------------------------------
class PrefillServer:
    """One prefill rank: KV buffers holding its shard of the request, a pack buffer, an engine.

    Buffers are allocated and registered once; the KV holds the deterministic pattern of
    ``dcp_jax.kv_data`` in pages drawn from a shuffled pool. :meth:`send_request` serves one request
    to a set of decode targets and may be called again (other mode, other ranks).

    Args:
        cfg: the job configuration (geometry, sizes, engine kind, seed).
        prefill_rank: this rank, ``0 <= prefill_rank < cfg.prefill_dcp_size``.
        name: engine name, unique among the communicating engines.

    Raises:
        ValueError: ``prefill_rank`` out of range.
        bridge.BridgeError: the engine could not start or register.
    """

    def __init__(self, cfg: JobConfig, prefill_rank: int = 0, *, name: str | None = None):
        if not 0 <= prefill_rank < cfg.prefill_dcp_size:
            raise ValueError(f"{prefill_rank=} must be in [0, prefill_dcp_size={cfg.prefill_dcp_size})")
        _engine_env()
        if cfg.device == "gpu":
            # Several processes share the GPU: JAX must not reserve 75% of its memory up front.
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        from bridge import make_engine

        self.cfg = cfg
        self.rank = prefill_rank
        t0 = time.perf_counter()
        self.setup_seconds: dict[str, float] = {}
        geo = cfg.geometry
        self.item_lens = np.asarray(geo.kv_item_lens, np.int64)
        # This rank's tokens of the send range (all of it when M = 1).
        tokens, local, self.src_pages, self.pool_pages = _prefill_page_table(cfg, prefill_rank)
        self.pool_rows = self.pool_pages * cfg.page_size
        kv_bytes = self.pool_rows * int(self.item_lens.sum())
        host_kv = _host_alloc(kv_bytes)
        host_layers, offs = _layer_views(host_kv, self.pool_rows, self.item_lens.tolist())
        rows = page_rows(self.src_pages, local, cfg.page_size)
        for li, view in enumerate(host_layers):
            # Only the request's pages are written; the pool's free pages are never read.
            fill_rows(view, rows, tokens, li, cfg.seed)
        self.setup_seconds["fill_kv"] = time.perf_counter() - t0
        # KV and pack buffer: host memory, or device memory (the pattern copied over once).
        t1 = time.perf_counter()
        self.kv, kv_region = _alloc_buffer(kv_bytes, cfg.device, like=host_kv)
        del host_kv, host_layers  # on the GPU the host copy is no longer needed
        self.layers, _ = _layer_views(self.kv, self.pool_rows, self.item_lens.tolist())
        self.kv_bases = _buffer_addr(self.kv) + np.asarray(offs, np.int64)
        # Pack buffer: one fixed region per decode rank, sized by pack_region_rows (the spec's
        # N * ceil(max_tokens / N) * sum(item_len) when M = 1 and the shares are even).
        self.tokens = tokens
        self.pack_tokens = cfg.pack_tokens or len(tokens)
        region_rows, _ = self._pack_rows(cfg.dcp_size)
        self.pack_size = cfg.dcp_size * region_rows * int(self.item_lens.sum())
        self.pack, pack_region = _alloc_buffer(max(self.pack_size, 1), cfg.device)
        self.pack_addr = _buffer_addr(self.pack)
        if cfg.device != "cpu":
            self.setup_seconds["device_buffers"] = time.perf_counter() - t1
        # Import the planner and the gather kernel now, so their (jax) import is not timed as planning.
        t1 = time.perf_counter()
        import dcp_jax.plan  # noqa: F401
        import pallas_kernels  # noqa: F401

        self.setup_seconds["imports"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        if cfg.device == "cpu":
            # The pack buffer is allocated once and reused: fault its pages in now, not in the first pack.
            self.pack[:] = 0
        else:
            # Compile the device gather now (JAX client start, Pallas lowering), not in the first pack.
            self._warm_up_pack(len(tokens))

        self.engine = make_engine(cfg.engine_kind, name or f"prefill{prefill_rank}-{uuid.uuid4().hex[:8]}")
        self.engine.register([kv_region, pack_region])
        self._busy_slots: dict[tuple[int, int], Any] = {}
        self._rank_counts: dict[int, tuple[int, int, int, int]] = {}
        self._transfer_s = 0.0  # seconds inside engine submit calls (engines may copy there)
        self.setup_seconds["engine_and_pack"] = time.perf_counter() - t1
        self.setup_seconds["total"] = time.perf_counter() - t0

    def _region_layout(self, dcp_size: int) -> tuple[int, int, int, int, int]:
        """``(region_size, row_bytes, region_rows, nslots, slot_rows)`` of the pack for ``dcp_size`` ranks.

        Rank r's region of ``pack_size // N`` bytes holds ``nslots`` chunk-sized slots of
        ``slot_rows`` rows each, so chunk k+1 can be packed while chunk k is in flight.
        """
        cfg = self.cfg
        region_size = self.pack_size // dcp_size
        row_bytes = int(self.item_lens.sum())
        region_rows = region_size // row_bytes
        # Each slot holds the most rows this prefill rank sends to one rank in one chunk.
        _, bound = self._pack_rows(dcp_size)
        nslots = max(1, region_rows // max(bound, 1))
        return region_size, row_bytes, region_rows, nslots, region_rows // nslots

    def _pack_rows(self, dcp_size: int) -> tuple[int, int]:
        cfg = self.cfg
        return pack_region_rows(self.tokens, dcp_size=dcp_size, interleave_size=cfg.interleave_size,
                                prefix_tokens=cfg.prefix_tokens, chunk_tokens=cfg.chunk_tokens,
                                pack_tokens=cfg.pack_tokens)

    def _warm_up_pack(self, num_tokens: int, max_compiles: int = 64) -> None:
        """Compiles the device gather for every region slot the request will use, then re-zeroes the pack.

        The kernel is specialised on the region's offset (static) and on the row-count bucket, so
        each (rank, slot) offset is packed once here with a typical (chunk, rank) row count: the
        timed packs then find it compiled.
        """
        from pallas_kernels import pack_rows

        cfg = self.cfg
        region_size, row_bytes, region_rows, nslots, slot_rows = self._region_layout(cfg.dcp_size)
        if region_rows == 0:
            return  # per-row fallback: no packing
        typical = -(-min(cfg.chunk_tokens or cfg.send_tokens, num_tokens) // cfg.dcp_size)
        n = typical if typical <= slot_rows else region_rows  # larger: sliced, whole-region windows
        slots = 1 if typical > slot_rows else nslots
        offsets = [r * region_size + s * slot_rows * row_bytes for r in range(cfg.dcp_size) for s in range(slots)]
        for off in offsets[:max_compiles]:
            pack_rows(self.layers, np.zeros(max(n, 1), np.int64), self.pack, offset=off)
        self.pack[:] = 0
        _sync(self.pack)

    # -- peers ------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.engine.name

    def peer_info(self):
        """This engine's ``PeerInfo`` (picklable; send to decode ranks out of band)."""
        return self.engine.peer_info()

    def connect(self, info) -> str:
        """Adds (or refreshes) a decode rank's engine; returns its peer name."""
        return self.engine.add_peer(info)

    def disconnect(self, peer: str) -> None:
        """Forgets a decode rank's engine (e.g. after it died)."""
        if peer in self.engine.peers:
            self.engine.remove_peer(peer)

    def warm_up(self, targets: Sequence[tuple[int, str, np.ndarray]], *, dcp_size: int) -> float:
        """Untimed first use of every path the timed modes take, so no mode pays it alone.

        Per decode rank: one gather of one row into the rank's pack region, then ONE batch of two
        one-row WRITEs (one from the KV buffer, as direct sends; one from the pack region, as
        packed sends) into rows 0 and 1 of the rank's pool, waited for. This opens the engine's
        connection to the peer and takes the first-use costs (page faults, registration
        caches, endpoint set-up) out of whichever mode runs first. The bytes written are
        overwritten: every request fills the pool with the sentinel before it is sent.

        Args:
            targets: ``(dcp_rank, peer, layer_bases)`` per decode rank (``layer_bases``: i64[L]).
            dcp_size: N of the decode group.

        Returns:
            Seconds the warm-up took.

        Raises:
            ValueError: a peer is not connected or ``layer_bases`` has the wrong length.
            bridge.BridgeError: the engine failed.
        """
        from pallas_kernels import pack_rows

        t0 = time.perf_counter()
        eng = self.engine
        region_size, row_bytes, region_rows, _, _ = self._region_layout(dcp_size)
        il = int(self.item_lens[0])
        handles = []
        for r, peer, bases in targets:
            bases = np.asarray(bases, np.int64)
            if len(bases) != len(self.item_lens) or peer not in eng.peers:
                raise ValueError(f"warm-up target dcp_rank={r}: peer {peer!r} not connected or layer_bases of "
                                 f"{len(bases)} entries (this prefill has {len(self.item_lens)})")
            descs = [(int(self.kv_bases[0]), int(bases[0]), il)]
            if region_rows > 0:
                if _is_host(self.pack):
                    # On the GPU the gather was compiled and run for every region at setup
                    # (_warm_up_pack); a one-row gather there would compile a new row bucket.
                    pack_rows(self.layers, np.zeros(1, np.int64), self.pack, offset=r * region_size)
                descs.append((self.pack_addr + r * region_size, int(bases[0]) + il, il))
            handles.append(eng.transfer_batch(peer, np.asarray(descs, np.int64), dcp_rank=r,
                                              notif=WARMUP_TAG if eng.kind == "nixl" else None))
        _sync(self.pack)
        # The planner's first call (numpy set-up) is a first-use cost too: plan chunk 0 once on
        # stand-in decode page tables (the real ones come with the request).
        cfg = self.cfg
        fake = [DecodeTarget(r, "", np.zeros(len(self.item_lens), np.int64), np.arange(_pages_for(len(
                    decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, dcp_size, r, cfg.interleave_size)[0]),
                    cfg.page_size), dtype=np.int64), None) for r in range(dcp_size)]
        for src, dst in _chunk_plans(cfg, self.rank, self.src_pages, cfg.chunks()[0], fake, dcp_size).values():
            _descriptors(src, dst, self.kv_bases, fake[0].layer_bases, self.item_lens)
        for h in handles:
            eng.wait(h, timeout_s=cfg.timeout_s)
        eng.reset_counters()
        return time.perf_counter() - t0

    @property
    def busy_regions(self) -> int:
        """Pack region slots still held by an in-flight transfer (0 between requests)."""
        return len(self._busy_slots)

    def close(self) -> None:
        self.engine.close()

    # -- one request ------------------------------------------------------------------------------
    def send_request(self, mode: str, targets: Sequence[DecodeTarget], *, dcp_size: int, request_id: str = "r",
                     progress: Callable[[int], None] | None = None) -> dict:
        """Sends this rank's share of the request to every target, in ``mode``.

        Args:
            mode: ``"direct"`` or ``"packed"``.
            targets: decode ranks (``DecodeTarget``: rank, peer name, layer bases, page table, pipe).
            dcp_size: N of the decode group the targets belong to.
            request_id: tag prefix for notifications.
            progress: called with 1 after each (chunk, rank) completed.

        Returns:
            Statistics: per-rank and total descriptors, bytes, engine calls; plan / pack /
            transfer / total seconds; strategy used per rank.

        Raises:
            ValueError: unknown mode.
            RequestFailed: a transfer, notification or completion message failed; names the rank
                and chunk. Every handle was waited or aborted and every region freed first.
        """
        if mode not in MODES:
            raise ValueError(f"{mode=} must be one of {MODES}")
        if not 1 <= dcp_size or sorted(t.dcp_rank for t in targets) != sorted(set(t.dcp_rank for t in targets)) \
                or any(not 0 <= t.dcp_rank < dcp_size for t in targets):
            raise ValueError(f"targets must have distinct dcp_rank in [0, {dcp_size=})")
        for t in targets:
            # A decode side of another geometry is refused before anything is sent.
            if len(t.layer_bases) != len(self.item_lens):
                raise ValueError(f"targets[dcp_rank={t.dcp_rank}].layer_bases has {len(t.layer_bases)} layer "
                                 f"entries, this prefill has {len(self.item_lens)} ({self.cfg.model})")
            if t.peer not in self.engine.peers:
                raise ValueError(f"targets[dcp_rank={t.dcp_rank}].peer={t.peer!r} is not connected")
        cfg, eng = self.cfg, self.engine
        eng.reset_counters()
        self._transfer_s = 0.0
        item_lens = self.item_lens
        chunks = cfg.chunks()
        per_rank = {t.dcp_rank: dict(descriptors=0, bytes=0, batches=0, rows=0, strategy=set()) for t in targets}
        stats = dict(mode=mode, plan_seconds=0.0, pack_seconds=0.0, transfer_seconds=0.0)
        region_size, row_bytes, region_rows, nslots, slot_rows = self._region_layout(dcp_size)
        pending: dict[int, deque] = {t.dcp_rank: deque() for t in targets}
        t0 = time.perf_counter()

        def complete(rank: int) -> None:
            """Waits for the oldest pending (chunk, rank) batch set and tells the decode rank."""
            chunk_i, handles, slot, msg = pending[rank].popleft()
            ts = time.perf_counter()
            try:
                for h in handles:
                    eng.wait(h, timeout_s=cfg.timeout_s)
            finally:
                stats["transfer_seconds"] += time.perf_counter() - ts
                self._busy_slots.pop((rank, slot), None)
            _send(tmap[rank].conn, ("chunk", msg), rank, chunk_i)
            if progress:
                progress(1)

        tmap = {t.dcp_rank: t for t in targets}
        try:
            for ci, chunk in enumerate(chunks):
                tp = time.perf_counter()
                plans = _chunk_plans(cfg, self.rank, self.src_pages, chunk, targets, dcp_size)
                stats["plan_seconds"] += time.perf_counter() - tp
                for tgt in targets:
                    r = tgt.dcp_rank
                    src, dst = plans[r]
                    n = len(src)
                    per_rank[r]["rows"] += n
                    tag_base = f"{request_id}:{mode}:{self.rank}:{ci}:{r}"
                    checks = None
                    if cfg.verify:
                        checks = [_checksum(v, src) for v in self.layers]
                    msg = dict(chunk=ci, source=self.name, tags=[], rows=dst, checksums=checks)
                    if n == 0:
                        # Nothing from this prefill rank for r in this chunk (M > 1): no batch, no
                        # strategy, no slot; only the completion message, in order.
                        pending[r].append((ci, [], -1, msg))
                        continue
                    handles = []
                    slot = -1
                    use_pack = mode == "packed" and region_rows > 0
                    if mode == "packed" and region_rows == 0:
                        # choose_pack_strategy logs the warning for the per-row fallback.
                        from dcp_jax import packing
                        packing.choose_pack_strategy(n, None if region_size == 0 else region_size,
                                                     item_lens.tolist())
                    if use_pack:
                        if n <= slot_rows:
                            slot = ci % nslots
                            # Chunk barrier: the slot's previous reader must have completed.
                            while (r, slot) in self._busy_slots:
                                complete(r)
                            off = r * region_size + slot * slot_rows * row_bytes
                            per_rank[r]["strategy"].add("packed")
                            handles, tp_s, pk_s = self._send_packed(tgt, src, dst, off, ci, tag_base, msg)
                            stats["plan_seconds"] += tp_s
                            stats["pack_seconds"] += pk_s
                            self._busy_slots[(r, slot)] = True
                        else:
                            # Sliced: gather, send, wait, repeat, using the whole region.
                            while pending[r]:
                                complete(r)
                            per_rank[r]["strategy"].add("sliced")
                            self._busy_slots[(r, -1)] = True
                            try:
                                for s, e in _windows(n, region_rows):
                                    hs, tp_s, pk_s = self._send_packed(tgt, src[s:e], dst[s:e], r * region_size,
                                                                       ci, f"{tag_base}:s{s}", msg)
                                    stats["plan_seconds"] += tp_s
                                    stats["pack_seconds"] += pk_s
                                    ts = time.perf_counter()
                                    for h in hs:
                                        eng.wait(h, timeout_s=cfg.timeout_s)
                                    stats["transfer_seconds"] += time.perf_counter() - ts
                            finally:
                                self._busy_slots.pop((r, -1), None)
                    else:
                        # Direct (or per-row fallback): descriptors straight from the KV buffers.
                        while len(pending[r]) >= 2:
                            complete(r)
                        if mode == "direct":
                            per_rank[r]["strategy"].add("direct")
                        else:
                            per_rank[r]["strategy"].add("per_row")
                        handles, tp_s = self._send_direct(tgt, src, dst, ci, tag_base, msg)
                        stats["plan_seconds"] += tp_s
                    pending[r].append((ci, handles, slot, msg))
            for tgt in targets:
                while pending[tgt.dcp_rank]:
                    complete(tgt.dcp_rank)
        except Exception as exc:  # noqa: BLE001 - turned into RequestFailed after cleanup
            rank = getattr(exc, "dcp_rank", None)
            chunk_i = getattr(exc, "chunk", None)
            self._abort(pending)
            for tgt in targets:
                _send_quiet(tgt.conn, ("done", dict(source=self.name, ok=False, error=str(exc))))
            if isinstance(exc, RequestFailed):
                raise
            raise RequestFailed(f"{mode} request failed", dcp_rank=rank, chunk=chunk_i,
                                cause=f"{type(exc).__name__}: {exc}") from exc
        total = time.perf_counter() - t0
        stats["transfer_seconds"] += self._transfer_s
        for tgt in targets:
            _send(tgt.conn, ("done", dict(source=self.name, ok=True, chunks=len(chunks))), tgt.dcp_rank, None)
        c = eng.counters
        stats.update(
            total_seconds=total,
            descriptors=c.descriptors, bytes=c.bytes, batches=c.batches, engine_calls=c.engine_calls,
            per_rank={r: dict(descriptors=v["descriptors"], bytes=v["bytes"], batches=v["batches"],
                              engine_calls=v["engine_calls"], rows=v["rows"], strategy=",".join(sorted(v["strategy"])))
                      for r, v in self._per_rank_totals(per_rank).items()},
        )
        return stats

    def _per_rank_totals(self, per_rank: dict) -> dict:
        for r, v in per_rank.items():
            tot = self._rank_counts.get(r, (0, 0, 0, 0))
            v["descriptors"], v["bytes"], v["batches"], v["engine_calls"] = tot
        self._rank_counts = {}
        return per_rank

    def _count(self, rank: int, descs: np.ndarray, notif: bytes | None) -> None:
        """Per-rank totals: descriptors, bytes, batches and engine calls of one batch.

        Engine calls follow the engines' submit rule (NIXL: one per batch; Mooncake: one per
        window of ``engine.window`` descriptors, plus one for a notification); the job's tests
        check their sum against the engine's own counter.
        """
        d, b, n, c = self._rank_counts.get(rank, (0, 0, 0, 0))
        window = getattr(self.engine, "window", None)
        calls = 1 if window is None else -(-len(descs) // window) + (notif is not None)
        self._rank_counts[rank] = (d + len(descs), b + int(descs[:, 2].sum()) if len(descs) else b, n + 1, c + calls)

    def _submit_windows(self, tgt: DecodeTarget, src: np.ndarray, dst: np.ndarray, src_bases_fn, ci: int,
                        tag_base: str, msg: dict, wait_between: bool) -> tuple[list, float]:
        """Builds and submits one batch per window of rows; returns (handles, plan seconds)."""
        eng, cfg = self.engine, self.cfg
        handles, plan_s = [], 0.0
        wins = _windows(len(src), cfg.max_batch_indices)
        for wi, (s, e) in enumerate(wins):
            tp = time.perf_counter()
            descs = _descriptors(src[s:e], dst[s:e], src_bases_fn(s, e), tgt.layer_bases, self.item_lens) \
                if e > s else np.zeros((0, 3), np.int64)
            plan_s += time.perf_counter() - tp
            tag = f"{tag_base}:w{wi}".encode()
            notif = tag if eng.kind == "nixl" else None
            if notif is not None:
                msg["tags"].append(tag)
            self._count(tgt.dcp_rank, descs, notif)
            ts = time.perf_counter()
            h = eng.transfer_batch(tgt.peer, descs, notif=notif, dcp_rank=tgt.dcp_rank, chunk=ci)
            handles.append(h)
            if wait_between and len(wins) > 1:
                # Windows go in order and stop at the first failure.
                eng.wait(h, timeout_s=cfg.timeout_s)
                handles.pop()
            self._transfer_s += time.perf_counter() - ts
        return handles, plan_s

    def _send_direct(self, tgt: DecodeTarget, src, dst, ci, tag_base, msg):
        kv_bases = self.kv_bases
        return self._submit_windows(tgt, src, dst, lambda s, e: kv_bases, ci, tag_base, msg, True)

    def _send_packed(self, tgt: DecodeTarget, src, dst, region_off: int, ci, tag_base, msg):
        from dcp_jax import packing
        from pallas_kernels import pack_rows

        n = len(src)
        tk = time.perf_counter()
        if n:
            pack_rows(self.layers, src, self.pack, offset=region_off)
        pack_s = time.perf_counter() - tk
        bases = self.pack_addr + region_off + packing.layer_offsets(n, self.item_lens.tolist())
        local = np.arange(n, dtype=np.int64)
        # Windows index the packed rows 0..n-1; the layer-major bases stay those of the whole pack.
        handles, plan_s = self._submit_windows(tgt, local, dst, lambda s, e: bases, ci, tag_base, msg, True)
        return handles, plan_s, pack_s

    def _abort(self, pending: dict[int, deque]) -> None:
        """Waits (briefly) or aborts every in-flight handle and frees every region slot."""
        for q in pending.values():
            while q:
                _, handles, _, _ = q.popleft()
                for h in handles:
                    if not h.released:
                        try:
                            self.engine.wait(h, timeout_s=min(self.cfg.timeout_s, 5.0))
                        except Exception:  # noqa: BLE001 - the request already failed
                            pass
        self._busy_slots.clear()
        self._rank_counts = {}


def _try_send(conn: Connection, msg: Any) -> str | None:
    """Sends ``msg``; returns None, or the pipe error's text if the other end is gone.

    Callers raise their own error *after* this returns, outside any except block, so the pipe
    error is not kept as ``__context__`` (``from None`` only hides it): its frames hold
    multiprocessing's pickled message (a memoryview of a BytesIO), and when the garbage collector
    frees that pair at exit CPython can crash ("deallocated BytesIO object has exported buffers").
    """
    try:
        conn.send(msg)
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _send(conn: Connection | None, msg: Any, rank: int, chunk: int | None) -> None:
    if conn is None:
        return
    cause = _try_send(conn, msg)
    if cause is not None:
        raise RequestFailed("decode rank is gone", dcp_rank=rank, chunk=chunk, cause=cause)


def _send_quiet(conn: Connection | None, msg: Any) -> None:
    if conn is None:
        return
    try:
        conn.send(msg)
    except Exception:  # noqa: BLE001 - best effort on the failure path
        pass


# ------------------------------------------------------------------------------------------------
# Decode side
# ------------------------------------------------------------------------------------------------
def _decode_request(cfg: JobConfig, eng, layers: list[np.ndarray], buf: np.ndarray, pool_pages: int,
                    layer_bases: np.ndarray, ctrl: Connection, src_conns: Sequence[Connection],
                    arg: dict) -> dict:
    """Serves one request on a decode rank: page table, sentinel, arrivals, full verification."""
    r, n = int(arg["dcp_rank"]), int(arg["dcp_size"])
    p = cfg.page_size
    tokens, local = decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, n, r, cfg.interleave_size)
    dst_pages = decode_page_table(cfg, r, n, pool_pages, seq=int(arg.get("seq", 0)))
    buf[:] = SENTINEL_BYTE
    _sync(buf)  # the sentinel must be in place before the prefill side may write
    ctrl.send(("ready", dict(dcp_rank=r, peer_info=eng.peer_info(), layer_bases=layer_bases, dst_pages=dst_pages)))

    sources = [c for c in src_conns if c is not None]
    open_conns = {id(c): c for c in sources}
    chunks, errors, bad_checks, corrupted = 0, [], [], False
    notif_wait = 0.0
    deadline = time.monotonic() + cfg.timeout_s
    while open_conns:
        ready = conn_wait(list(open_conns.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            errors.append(f"no message from the prefill side within {cfg.timeout_s} s")
            break
        for c in ready:
            try:
                kind, msg = c.recv()
            except (EOFError, OSError) as exc:
                errors.append(f"prefill connection lost: {type(exc).__name__}")
                open_conns.pop(id(c), None)
                continue
            deadline = time.monotonic() + cfg.timeout_s
            if kind == "done":
                open_conns.pop(id(c), None)
                if not msg.get("ok", False):
                    errors.append(f"prefill {msg.get('source')} failed: {msg.get('error')}")
                continue
            # A chunk: learn from the engine itself that every byte landed before reading it.
            tn = time.perf_counter()
            for tag in msg["tags"]:
                eng.wait_notification(msg["source"], tag, timeout_s=cfg.timeout_s)
            notif_wait += time.perf_counter() - tn
            rows = np.asarray(msg["rows"], np.int64)
            if cfg.corrupt_rank == r and not corrupted and len(rows):
                _flip_first_byte(layers[-1], rows[0])  # test hook: a byte damaged on arrival
                corrupted = True
            if msg.get("checksums") is not None:
                for li, want in enumerate(msg["checksums"]):
                    if _checksum(layers[li], rows) != want:
                        bad_checks.append((int(msg["chunk"]), li))
            chunks += 1
            if cfg.die_rank == r and chunks >= cfg.die_after_chunks:
                os.kill(os.getpid(), signal.SIGKILL)  # test hook: die in the middle of a request
    tv = time.perf_counter()
    # Device pools are copied back to the host once and checked by the same code as host pools.
    host_layers = layers if _is_host(buf) else \
        _layer_views(_to_host(buf), int(layers[0].shape[0]), [int(v.shape[1]) for v in layers])[0]
    res = verify_rows(host_layers, page_rows(dst_pages, local, p), tokens, cfg.seed)
    verify_s = time.perf_counter() - tv
    return dict(
        dcp_rank=r, rows=int(len(tokens)), chunks=chunks, errors=errors,
        bytes_verified=int(len(tokens)) * int(sum(v.shape[1] for v in layers)),
        verified=bool(res["ok"]) and not errors and not bad_checks,
        bytes_exact=bool(res["ok"]), bad_rows=res["bad_rows"], bad_sentinel_rows=res["bad_sentinel_rows"],
        first_bad=res["first_bad"], checksum_ok=(not bad_checks) if cfg.verify else None,
        bad_checksums=bad_checks[:10], verify_seconds=verify_s, notification_seconds=notif_wait,
    )


def _decode_main(cfg_dict: dict, index: int, ctrl: Connection, src_conns: Sequence[Connection],
                 pool_pages: int, name: str) -> None:
    """Decode-rank process: one engine and one registered pool, serving requests until shutdown."""
    _ignore_sigint()
    try:
        _engine_env()
        cfg = JobConfig(**cfg_dict)
        from bridge import make_engine

        item_lens = list(cfg.geometry.kv_item_lens)
        pool_rows = pool_pages * cfg.page_size
        # Host memory, or a CuPy pool on the GPU registered as VRAM (no JAX in this process).
        buf, region = _alloc_buffer(pool_rows * sum(item_lens), cfg.device)
        layers, offs = _layer_views(buf, pool_rows, item_lens)
        eng = make_engine(cfg.engine_kind, name)
        eng.register([region])
        layer_bases = _buffer_addr(buf) + np.asarray(offs, np.int64)
        ctrl.send(("hello", dict(index=index, peer_info=eng.peer_info(), pool_pages=pool_pages,
                                 engine=eng.kind, layer_bases=layer_bases)))
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        _send_quiet(ctrl, ("error", traceback.format_exc()))
        raise SystemExit(1)
    try:
        while True:
            try:
                cmd, arg = ctrl.recv()
            except EOFError:
                break
            if cmd == "shutdown":
                break
            if cmd == "warmup":
                try:
                    # Consume the warm-up WRITEs' notifications (NIXL) so none stays queued.
                    t0 = time.perf_counter()
                    if eng.kind == "nixl":
                        for source in arg["sources"]:
                            eng.wait_notification(source, WARMUP_TAG, timeout_s=cfg.timeout_s)
                    ctrl.send(("warmed", time.perf_counter() - t0))
                except Exception:  # noqa: BLE001 - the orchestrator reports it
                    ctrl.send(("error", traceback.format_exc()))
            if cmd == "request":
                try:
                    out = _decode_request(cfg, eng, layers, buf, pool_pages, layer_bases, ctrl, src_conns, arg)
                    ctrl.send(("result", out))
                except Exception:  # noqa: BLE001 - the orchestrator reports it
                    ctrl.send(("error", traceback.format_exc()))
    finally:
        eng.close()


class DecodeProcess:
    """A spawned decode-rank process and its control pipe (see :func:`start_decode_processes`).

    Attributes:
        index: position in the group at start (its first ``dcp_rank``).
        process: the ``multiprocessing`` process.
        ctrl: the orchestrator's end of the control pipe.
        src_conns: the prefill side's ends of the completion pipes, one per prefill rank.
        peer_info: the rank's engine ``PeerInfo`` (after :meth:`hello`).
        layer_bases: i64[L] address of row 0 of each layer entry of its registered pool (bytes).
    """

    def __init__(self, index: int, process, ctrl: Connection, src_conns: list[Connection]):
        self.index, self.process, self.ctrl, self.src_conns = index, process, ctrl, src_conns
        self.peer_info = None
        self.layer_bases: np.ndarray | None = None

    def recv(self, timeout_s: float, expect: str) -> Any:
        """Receives one control message of kind ``expect``; raises RuntimeError otherwise."""
        if not self.ctrl.poll(timeout_s):
            raise RuntimeError(f"decode process {self.index}: no {expect!r} within {timeout_s} s")
        try:
            kind, arg = self.ctrl.recv()
        except EOFError:
            raise RuntimeError(f"decode process {self.index} exited (code {_exit_code(self.process)})") from None
        if kind != expect:
            raise RuntimeError(f"decode process {self.index}: expected {expect!r}, got {kind!r}: {arg}")
        return arg

    def stop(self, timeout_s: float = 10.0) -> None:
        """Asks the process to exit; kills it if it does not within ``timeout_s``."""
        _stop_all([(self.ctrl, self.process)], timeout_s)


def start_decode_processes(cfg: JobConfig, *, num: int | None = None, num_sources: int | None = None,
                           min_dcp_size: int | None = None, tag: str | None = None,
                           src_ends: Sequence[Sequence[Connection]] | None = None) -> list[DecodeProcess]:
    """Spawns decode-rank processes with engines and registered pools, and waits for their hello.

    Each pool holds :func:`decode_pool_pages` pages: the largest rank share of any group of
    ``min_dcp_size .. cfg.dcp_size`` ranks, times ``cfg.pool_slack``.

    Args:
        cfg: job configuration.
        num: processes to start (default ``cfg.dcp_size``).
        num_sources: prefill ranks that will send to them (default ``cfg.prefill_dcp_size``).
        min_dcp_size: smallest group these processes will serve (default ``num``; smaller when a
            request may be re-served to the ranks left after a failure).
        tag: engine name suffix (default random).
        src_ends: decode-side ends of existing completion pipes, ``src_ends[i][k]`` for process i
            and prefill rank k (they are closed here once handed over); default: new pipes, whose
            prefill-side ends are in ``DecodeProcess.src_conns``.

    Returns:
        The processes, in rank order, with ``peer_info`` filled in.

    Raises:
        RuntimeError: a process failed to start (its traceback is in the message).
    """
    ctx = mp.get_context("spawn")
    num = cfg.dcp_size if num is None else num
    num_sources = cfg.prefill_dcp_size if num_sources is None else num_sources
    tag = tag or uuid.uuid4().hex[:8]
    pool_pages = decode_pool_pages(cfg, min_dcp_size if min_dcp_size is not None else min(num, cfg.dcp_size))
    cfg_dict = dataclasses.asdict(cfg)
    procs = []
    for i in range(num):
        ctrl_parent, ctrl_child = ctx.Pipe()
        if src_ends is None:
            links = [ctx.Pipe() for _ in range(num_sources)]
        else:
            links = [(None, b) for b in src_ends[i]]
        pr = ctx.Process(target=_decode_main, name=f"dcp-decode-{i}",
                         args=(cfg_dict, i, ctrl_child, [b for _, b in links], pool_pages, f"decode{i}-{tag}"),
                         daemon=True)
        pr.start()
        ctrl_child.close()
        for _, b in links:
            b.close()  # the decode process holds this end now
        procs.append(DecodeProcess(i, pr, ctrl_parent, [a for a, _ in links if a is not None]))
    try:
        for dp in procs:
            hello = _expect_hello(dp.ctrl, dp.process, max(cfg.timeout_s, 120.0), f"decode {dp.index}")
            dp.peer_info, dp.layer_bases = hello["peer_info"], np.asarray(hello["layer_bases"], np.int64)
    except BaseException:
        for dp in procs:
            dp.process.kill()
        raise
    return procs


def _expect_hello(conn: Connection, proc, timeout_s: float, who: str) -> dict:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"{who}: no hello within {timeout_s} s")
    try:
        kind, arg = conn.recv()
    except EOFError:
        raise RuntimeError(f"{who} exited during start-up (code {proc.exitcode})") from None
    if kind != "hello":
        raise RuntimeError(f"{who} failed to start:\n{arg}")
    return arg


# ------------------------------------------------------------------------------------------------
# Prefill process
# ------------------------------------------------------------------------------------------------
def _ignore_sigint() -> None:
    """Child processes ignore Ctrl-C: it reaches the whole process group, and the parent stops
    them itself (a shutdown message, then a kill), so nine children need not print nine
    KeyboardInterrupt tracebacks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _prefill_main(cfg_dict: dict, rank: int, ctrl: Connection, dec_conns: Sequence[Connection], name: str) -> None:
    _ignore_sigint()
    try:
        cfg = JobConfig(**cfg_dict)
        server = PrefillServer(cfg, rank, name=name)
        ctrl.send(("hello", dict(index=rank, peer_info=server.peer_info(), engine=server.engine.kind,
                                 setup=server.setup_seconds)))
    except BaseException:  # noqa: BLE001
        _send_quiet(ctrl, ("error", traceback.format_exc()))
        raise SystemExit(1)
    try:
        while True:
            try:
                cmd, arg = ctrl.recv()
            except EOFError:
                break
            if cmd == "shutdown":
                break
            try:
                if cmd == "connect":
                    ctrl.send(("connected", [server.connect(i) for i in arg]))
                elif cmd == "warmup":
                    secs = server.warm_up([(t["dcp_rank"], t["peer"], np.asarray(t["layer_bases"], np.int64))
                                           for t in arg["targets"]], dcp_size=arg["dcp_size"])
                    ctrl.send(("warmed", dict(seconds=secs, source=server.name)))
                elif cmd == "send":
                    targets = [DecodeTarget(t["dcp_rank"], t["peer"], np.asarray(t["layer_bases"], np.int64),
                                       np.asarray(t["dst_pages"], np.int64), dec_conns[t["dcp_rank"]])
                               for t in arg["targets"]]
                    stats = server.send_request(arg["mode"], targets, dcp_size=arg["dcp_size"],
                                                request_id=arg["request_id"],
                                                progress=lambda k: ctrl.send(("progress", k)))
                    ctrl.send(("stats", stats))
            except RequestFailed as exc:
                ctrl.send(("failed", dict(error=str(exc), dcp_rank=exc.dcp_rank, chunk=exc.chunk)))
            except Exception:  # noqa: BLE001
                ctrl.send(("error", traceback.format_exc()))
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------
def estimate_host_bytes(cfg: JobConfig) -> int:
    """Host memory the job's processes allocate, in bytes (an upper estimate).

    Prefill: each rank's KV pool (its share of the send range in pages, times ``pool_slack``) and
    its pack buffer (at most its tokens plus a page per decode rank); decode: each rank's pool of
    :func:`decode_pool_pages` pages. On ``device="gpu"`` the pools live in VRAM, and only the
    prefill's host copy of the KV pattern counts.
    """
    row = cfg.geometry.row_bytes
    m, n, p = cfg.prefill_dcp_size, cfg.dcp_size, cfg.page_size
    share = -(-cfg.send_tokens // m) + cfg.prefill_interleave_size  # most tokens one prefill rank holds
    prefill_pool = _pool_pages(_pages_for(share, p), cfg.pool_slack) * p * row
    if cfg.device == "gpu":
        return m * prefill_pool
    prefill_pack = (share + n * p) * row
    decode_pool = decode_pool_pages(cfg) * p * row
    return m * (prefill_pool + prefill_pack) + n * decode_pool


def check_host_memory(cfg: JobConfig) -> None:
    """Refuses a job whose buffers would not fit this machine's physical memory.

    Raises:
        ValueError: :func:`estimate_host_bytes` exceeds the physical memory (naming the options).
    """
    need = estimate_host_bytes(cfg)
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: nothing to check against
        return
    if need > have:
        raise ValueError(
            f"this job needs about {need / 2**30:.1f} GiB of host memory (prompt_tokens="
            f"{cfg.prompt_tokens}, page_size={cfg.page_size}, dcp_size={cfg.dcp_size}, "
            f"prefill_dcp_size={cfg.prefill_dcp_size}, model {cfg.model}); this machine has "
            f"{have / 2**30:.1f} GiB")


def run_job(cfg: JobConfig, *, on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Runs the main job: starts the processes, ships the request once per mode, verifies, reports.

    Args:
        cfg: the configuration.
        on_progress: called as ``on_progress(mode, done, total)`` with (chunk, rank) units.

    Returns:
        ``{"config": {...}, "setup_seconds", "warmup_seconds", "runs": [{"mode", "engine",
        "descriptors", "bytes", "batches", "engine_calls", "plan_seconds", "pack_seconds",
        "transfer_seconds", "total_seconds", "gbps", "verified", "ranks": [...]}, ...],
        "comparison": {...}}``. Descriptors, bytes, batches and engine calls are totals over all
        ranks (and prefill ranks); seconds are the slowest prefill rank's. ``batches`` counts
        ``transfer_batch`` calls (one per (chunk, source, destination) window with rows);
        ``engine_calls`` counts submit calls into the engine library (a Mooncake batch longer
        than its 1024-entry window costs several). Each rank row has ``strategy`` (the union over
        the prefill ranks that sent it rows) and ``sources`` (per such prefill rank: rows,
        descriptors, batches, strategy).

    Raises:
        ValueError: ``cfg.device="gpu"`` without CuPy or a CUDA device (:func:`check_device`), or
            buffers larger than the machine's memory (:func:`check_host_memory`).
        RuntimeError: a process failed to start or crashed (with its traceback).
    """
    check_device(cfg.device)
    check_host_memory(cfg)
    ctx = mp.get_context("spawn")
    tag = uuid.uuid4().hex[:8]
    n, m = cfg.dcp_size, cfg.prefill_dcp_size
    t_start = time.perf_counter()
    # Completion pipes prefill k -> decode r, created before either side starts.
    links = [[ctx.Pipe() for _ in range(n)] for _ in range(m)]
    prefills, decodes = [], []
    try:
        # The prefill side starts first: filling its multi-GB KV is the longest part of start-up and
        # should not compete with the decode processes' engines starting.
        for k in range(m):
            a, b = ctx.Pipe()
            pr = ctx.Process(target=_prefill_main, name=f"dcp-prefill-{k}",
                             args=(dataclasses.asdict(cfg), k, b, [links[k][r][0] for r in range(n)],
                                   f"prefill{k}-{tag}"), daemon=True)
            pr.start()
            b.close()
            for r in range(n):
                links[k][r][0].close()  # the prefill process holds this end now
            prefills.append((pr, a))
        engine_kind = None
        prefill_setup = []
        for k, (pr, a) in enumerate(prefills):
            hello = _expect_hello(a, pr, max(cfg.timeout_s, 180.0), f"prefill {k}")
            engine_kind = hello["engine"]
            prefill_setup.append(hello["setup"])
        t_dec = time.perf_counter()
        decodes = start_decode_processes(cfg, tag=tag, src_ends=[[links[k][r][1] for k in range(m)] for r in range(n)])
        decode_start_s = time.perf_counter() - t_dec
        for pr, a in prefills:
            a.send(("connect", [dp.peer_info for dp in decodes]))
        peers = None
        for k, (pr, a) in enumerate(prefills):
            peers = _recv_kind(a, pr, cfg.timeout_s, "connected", f"prefill {k}")
        # Untimed warm-up: one small WRITE per (prefill, decode) pair through the same engines and
        # regions, so the first timed mode does not pay the first-use costs alone.
        t_warm = time.perf_counter()
        wt = [dict(dcp_rank=r, peer=peers[r], layer_bases=dp.layer_bases) for r, dp in enumerate(decodes)]
        for pr, a in prefills:
            a.send(("warmup", dict(targets=wt, dcp_size=n)))
        warmed = [_recv_kind(a, pr, cfg.timeout_s, "warmed", f"prefill {k}") for k, (pr, a) in enumerate(prefills)]
        for dp in decodes:
            dp.ctrl.send(("warmup", dict(sources=[w["source"] for w in warmed])))
        for dp in decodes:
            dp.recv(cfg.timeout_s, "warmed")
        warmup_s = time.perf_counter() - t_warm
        setup_s = time.perf_counter() - t_start
        runs = []
        for seq, mode in enumerate(cfg.modes):
            runs.append(_run_mode(cfg, mode, seq, decodes, prefills, peers, engine_kind, tag, on_progress))
    finally:
        _stop_all([(a, pr) for pr, a in prefills] + [(dp.ctrl, dp.process) for dp in decodes])
    out = dict(config=_config_json(cfg), setup_seconds=setup_s, decode_start_seconds=decode_start_s,
               warmup_seconds=warmup_s, prefill_setup=prefill_setup, runs=runs)
    by = {r["mode"]: r for r in runs}
    # Ratios only between two complete, verified runs: a failed mode's times mean nothing.
    if "direct" in by and "packed" in by and by["direct"]["verified"] and by["packed"]["verified"]:
        d, p = by["direct"], by["packed"]
        out["comparison"] = dict(
            descriptor_ratio=d["descriptors"] / max(p["descriptors"], 1),
            total_seconds_ratio=d["total_seconds"] / max(p["total_seconds"], 1e-9),
        )
    out["verified"] = all(r["verified"] for r in runs)
    return out


def _config_json(cfg: JobConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["modes"] = list(cfg.modes)
    g = cfg.geometry
    d.update(num_layers=g.num_layers, kv_item_lens=sorted(set(g.kv_item_lens)), row_bytes=g.row_bytes,
             request_bytes=g.request_bytes(cfg.send_tokens), chunks=len(cfg.chunks()))
    return d


def _recv_kind(conn: Connection, proc, timeout_s: float, expect: str, who: str) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"{who}: no {expect!r} within {timeout_s} s")
    try:
        kind, arg = conn.recv()
    except EOFError:
        raise RuntimeError(f"{who} exited (code {proc.exitcode})") from None
    if kind != expect:
        raise RuntimeError(f"{who}: expected {expect!r}, got {kind!r}:\n{arg}")
    return arg


def _stop_all(procs: Sequence[tuple[Connection, Any]], timeout_s: float = 10.0) -> None:
    """Asks every process to shut down, waits for all under one deadline, kills the rest.

    A process stuck in a wait of its own (a peer died mid-request) does not read its control
    pipe; one shared deadline keeps the stop at ``timeout_s`` in all, not per process.
    """
    for conn, _ in procs:
        _send_quiet(conn, ("shutdown", None))
    deadline = time.monotonic() + timeout_s
    for _, proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for _, proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _exit_code(proc) -> Any:
    """The process's exit code, after a short wait for it to be reaped (None: still running)."""
    if proc.exitcode is None:
        proc.join(1.0)
    return proc.exitcode


def _send_or_raise(conn: Connection, msg: Any, who: str, proc) -> None:
    """Sends a control message; a closed pipe becomes RuntimeError naming the process."""
    cause = _try_send(conn, msg)
    if cause is not None:
        raise RuntimeError(f"{who} exited (code {_exit_code(proc)}): {cause}")


def _failed_run(mode: str, engine_kind: str | None, n: int, failure: str) -> dict:
    """The result of a mode that could not run: nothing sent, nothing verified."""
    nan = float("nan")
    ranks = [dict(dcp_rank=r, descriptors=0, bytes=0, batches=0, engine_calls=0, strategy="",
                  sources=[], verified=False, errors=[failure]) for r in range(n)]
    return dict(mode=mode, engine=engine_kind, descriptors=0, bytes=0, engine_calls=0, batches=0,
                plan_seconds=nan, pack_seconds=nan, transfer_seconds=nan, total_seconds=nan,
                gbps=0.0, verified=False, failures=[failure], ranks=ranks)


def _run_mode(cfg: JobConfig, mode: str, seq: int, decodes: list[DecodeProcess], prefills, peers,
              engine_kind: str, tag: str, on_progress) -> dict:
    n = len(decodes)
    request_id = f"{tag}{seq}"
    try:
        for r, dp in enumerate(decodes):
            _send_or_raise(dp.ctrl, ("request", dict(dcp_rank=r, dcp_size=n, seq=0, mode=mode)),
                           f"decode process {r}", dp.process)
        ready = [dp.recv(cfg.timeout_s, "ready") for dp in decodes]
        targets = [dict(dcp_rank=r, peer=peers[r], layer_bases=ready[r]["layer_bases"],
                        dst_pages=ready[r]["dst_pages"]) for r in range(n)]
        for k, (pr, a) in enumerate(prefills):
            _send_or_raise(a, ("send", dict(mode=mode, targets=targets, dcp_size=n,
                                            request_id=request_id)), f"prefill {k}", pr)
    except RuntimeError as exc:
        # A process died earlier (e.g. in the previous mode): this mode cannot start.
        return _failed_run(mode, engine_kind, n, f"mode not started: {exc}")
    total_units = len(cfg.chunks()) * n * len(prefills)
    done_units = 0
    if on_progress:
        on_progress(mode, 0, total_units)
    stats: dict[int, dict] = {}
    results: dict[int, dict] = {}
    failures: list[str] = []
    conns = {id(a): ("prefill", k, a, pr) for k, (pr, a) in enumerate(prefills)}
    conns.update({id(dp.ctrl): ("decode", r, dp.ctrl, dp.process) for r, dp in enumerate(decodes)})
    deadline_extra = cfg.timeout_s
    last = time.monotonic()
    give_up_at = None  # set at the first failure: the others' messages may never come
    while len(stats) + len(results) < len(prefills) + n:
        if failures and give_up_at is None:
            give_up_at = time.monotonic() + min(FAILURE_GRACE_S, cfg.timeout_s)
        if give_up_at is not None and time.monotonic() > give_up_at:
            waiting = ", ".join(f"{v[0]} {v[1]}" for v in conns.values())
            failures.append(f"stopped waiting for {waiting}: no message within "
                            f"{min(FAILURE_GRACE_S, cfg.timeout_s):g} s of the first failure")
            break
        live = [v[2] for v in conns.values()]
        ready_c = conn_wait(live, timeout=1.0)
        if not ready_c:
            dead = [f"{v[0]} {v[1]} (exit {v[3].exitcode})" for v in conns.values() if not v[3].is_alive()]
            if dead or time.monotonic() - last > deadline_extra + 30:
                failures.append(f"no progress; dead processes: {dead}")
                break
            continue
        last = time.monotonic()
        for c in ready_c:
            side, idx, conn, proc = conns[id(c)]
            try:
                kind, arg = conn.recv()
            except EOFError:
                failures.append(f"{side} {idx} exited (code {_exit_code(proc)})")
                conns.pop(id(c))
                continue
            if kind == "progress":
                done_units += arg
                if on_progress:
                    on_progress(mode, done_units, total_units)
            elif kind == "stats":
                stats[idx] = arg
                conns.pop(id(c))
            elif kind == "result":
                results[idx] = arg
                conns.pop(id(c))
            elif kind == "failed":
                failures.append(f"{side} {idx}: {arg['error']}")
                stats[idx] = None
                conns.pop(id(c))
            else:
                failures.append(f"{side} {idx} error:\n{arg}")
                if side == "prefill":
                    stats[idx] = None
                else:
                    results[idx] = None
                conns.pop(id(c))
        if not conns:
            break
    good = [s for s in stats.values() if s]
    rank_rows = []
    for r in range(n):
        res = results.get(r) or dict(dcp_rank=r, verified=False, errors=["no result"])
        sent = dict(descriptors=0, bytes=0, batches=0, engine_calls=0, strategy="", sources=[])
        strategies: set[str] = set()
        for k, s in sorted(stats.items()):
            pr_ = s and (s["per_rank"].get(r) or s["per_rank"].get(str(r)))
            if pr_:
                sent["descriptors"] += pr_["descriptors"]
                sent["bytes"] += pr_["bytes"]
                sent["batches"] += pr_["batches"]
                sent["engine_calls"] += pr_.get("engine_calls", 0)
                if pr_["rows"]:
                    # Only prefill ranks that sent this rank rows say how it was sent.
                    strategies.update(x for x in pr_["strategy"].split(",") if x)
                    sent["sources"].append(dict(prefill_rank=k, rows=pr_["rows"], descriptors=pr_["descriptors"],
                                                batches=pr_["batches"], strategy=pr_["strategy"]))
        sent["strategy"] = ",".join(sorted(strategies))
        rank_rows.append({**sent, **res})
    total_bytes = sum(s["bytes"] for s in good)
    total_s = max((s["total_seconds"] for s in good), default=float("nan"))
    return dict(
        mode=mode, engine=engine_kind,
        descriptors=sum(s["descriptors"] for s in good), bytes=total_bytes,
        engine_calls=sum(s["engine_calls"] for s in good), batches=sum(s["batches"] for s in good),
        plan_seconds=max((s["plan_seconds"] for s in good), default=float("nan")),
        pack_seconds=max((s["pack_seconds"] for s in good), default=float("nan")),
        transfer_seconds=max((s["transfer_seconds"] for s in good), default=float("nan")),
        total_seconds=total_s, gbps=total_bytes / total_s / 1e9 if good and total_s > 0 else 0.0,
        verified=not failures and len(good) == len(prefills) and all(x.get("verified") for x in rank_rows),
        failures=failures, ranks=rank_rows,
    )
