"""Index slots in pinned host memory that a jitted call reads itself: no upload, no host wait.

`device.IndexRing` writes a call's indices into pinned memory, copies them to a device slot on a
CuPy stream and waits for that copy on the host, because the kernel runs on JAX's stream, which
the CuPy stream cannot order against. Measured on an H200 (`benchmarks/gpu/stage_probe.py`,
2026-12-04), that staging cost the fused fan-out 0.13 ms of host time back to back and ~0.4 ms
after the process had been idle, for 288 KB of indices.

A `MappedIndexRing` slot is the pinned buffer itself, imported into JAX once as a device array:
under CUDA's unified virtual addressing a page-locked host allocation has one address for the
host and every device, so a kernel can read it over PCIe. The jitted call copies the slot into
device memory as its first step (`to_device`: one small elementwise kernel, on JAX's stream, in
order before the row kernel; the row kernel itself reading host memory was 0.48 ms slower per
launch, every program re-reading its indices per layer). The host only fills the slot.

A slot is rewritten only after the call that last read it has run: as for `IndexRing`, the
destination handle is waited for once every `slots` calls. `supported()` checks, once per
process, that the import is zero-copy and reads back what the host wrote; where it does not (no
UVA, a DLPack consumer that copies), the callers keep `IndexRing`.

Layout of a slot (`slot_layout`, shared with `IndexRing`): `k` index vectors of `m` int32 at a
stride of whole 64-word lines, then `meta_len` int32 of metadata.
"""
from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MappedIndexRing", "claim_slot", "fill_padded", "fill_slot", "mapped_index_ring", "slot_layout", "split_slot", "stage_indices",
           "supported", "to_device"]

logger = logging.getLogger(__name__)

_INT_MIN = np.int32(-2**31)


def slot_layout(m: int, k: int, meta_len: int) -> tuple[int, int]:
    """(stride, size) in int32 words of a slot holding `k` vectors of `m` indices and
    `meta_len` metadata words: every vector starts on a 64-word (256-byte) line.

    Raises:
        TypeError: an argument that is not an int (bool refused). ValueError: `m` or `k` < 1,
            `meta_len` < 0 (the message names the argument).
    """
    for name, v, low in (("m", m, 1), ("k", k, 1), ("meta_len", meta_len, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < low:
            raise ValueError(f"{name}={v} must be >= {low}")
    m, k, meta_len = int(m), int(k), int(meta_len)
    stride = -(-m // 64) * 64
    return stride, k * stride + max(64, -(-meta_len // 64) * 64)


def to_device(slot):
    """Inside a jitted call: a slot's int32 words copied into device memory, every value kept
    (an op XLA cannot fold away, so the copy is a real kernel, not a pass-through of the mapped
    host buffer).

    Raises:
        TypeError: `slot` not int32 (slots hold int32 words; other dtypes would be converted).
    """
    if slot.dtype != jnp.int32:
        raise TypeError(f"slot must be int32 words, got {slot.dtype}")
    return jnp.where(slot < 0, slot | _INT_MIN, slot)


def split_slot(words, m: int, k: int, meta_len: int):
    """The `k` index vectors i32[m] and the metadata i32[meta_len] of a slot's words (a JAX
    array laid out by `slot_layout`; static slices inside a jitted call).

    Raises:
        ValueError: `words` not 1-D or shorter than `slot_layout(m, k, meta_len)`'s size; as
            `slot_layout` for the sizes.
    """
    stride, size = slot_layout(m, k, meta_len)
    if len(words.shape) != 1 or words.shape[0] < size:
        raise ValueError(f"words must be a 1-D slot of >= {size} words for m={m}, k={k}, "
                         f"meta_len={meta_len}, got shape {tuple(words.shape)}")
    return [words[j * stride:j * stride + m] for j in range(k)], words[k * stride:k * stride + meta_len]


def claim_slot(ring, dests) -> int:
    """The next slot of `ring` (an `IndexRing` or `MappedIndexRing`: ``next``, ``slots``,
    ``last_use``), counted as read by the call being staged. A slot is rewritten only after the
    kernel that last read it has run: when it may still be queued, everything enqueued on
    `dests` so far is waited for (in order on one stream), once per ``slots`` calls at most."""
    s = ring.next
    ring.next = (s + 1) % ring.slots
    if ring.last_use[s] > dests.done:
        dests.handles[0].block_until_ready()
        dests.done = dests.calls
    dests.calls += 1
    ring.last_use[s] = dests.calls
    return s


def fill_slot(fill, host: np.ndarray, ring) -> None:
    """Calls ``fill(segs, meta)`` on the k i32[m] vector views and the i32[meta_len] metadata
    view of the pinned words `host`, laid out as `ring`'s slots (``m``, ``k``, ``stride``,
    ``meta_len``)."""
    m, k, stride = ring.m, ring.k, ring.stride
    fill([host[j * stride:j * stride + m] for j in range(k)], host[k * stride:k * stride + ring.meta_len])


class MappedIndexRing:
    """`slots` pinned host slots for calls of `k` index vectors of bucket `m` plus `meta_len`
    metadata words, each imported into JAX once (zero-copy, via its UVA address). GPU only: it
    needs CuPy and a CUDA device (`supported` says whether this process can use it)."""

    def __init__(self, m: int, k: int, meta_len: int = 3, slots: int = 16):
        import cupy as cp

        self.m, self.k, self.meta_len, self.slots = m, k, meta_len, slots
        self.stride, self.size = slot_layout(m, k, meta_len)
        self._mem = [cp.cuda.alloc_pinned_memory(self.size * 4) for _ in range(slots)]
        self.hosts = [np.frombuffer(mem, np.int32, self.size) for mem in self._mem]
        for h in self.hosts:
            h[:] = 0
        self.views = [_import_host(h, mem) for h, mem in zip(self.hosts, self._mem)]
        self.last_use = [-1] * slots
        self.next = 0

    def stage_with(self, fill, dests):
        """``fill(segs, meta)`` writes the next slot's k i32[m] views and its i32[meta_len] view
        in place (words it leaves keep older values); returns the slot as one JAX i32[size]
        array (`split_slot` of `to_device` inside the call). Waits first, once per `slots`
        calls, for the destination's queued kernels when the slot may still be read."""
        s = claim_slot(self, dests)
        fill_slot(fill, self.hosts[s], self)
        return self.views[s]


def _import_host(host: np.ndarray, owner):
    """A JAX device array over pinned host memory `host` (its UVA address), or an error."""
    import cupy as cp

    view = cp.ndarray(host.shape, cp.int32, cp.cuda.MemoryPointer(
        cp.cuda.UnownedMemory(int(host.ctypes.data), host.nbytes, owner), 0))
    arr = jax.dlpack.from_dlpack(view)
    if arr.unsafe_buffer_pointer() != int(host.ctypes.data):
        raise RuntimeError("the pinned slot was copied on import, not mapped")
    return arr


_SUPPORTED: list = []  # [bool] once checked
_SUPPORTED_LOCK = threading.Lock()


def supported() -> bool:
    """Whether this process's GPU reads a mapped pinned slot through JAX: imported without a
    copy, and a jitted `to_device` of it returns what the host wrote after a rewrite. Checked
    once (a few ms and one tiny compile); False, with a warning, where it does not."""
    if _SUPPORTED:  # known: every staged call asks, so no lock once answered
        return _SUPPORTED[0]
    with _SUPPORTED_LOCK:
        if not _SUPPORTED:
            try:
                ring = MappedIndexRing(64, 1, 1, slots=1)
                f = jax.jit(to_device)
                ok = True
                for value in (7, -3):
                    ring.hosts[0][:] = np.arange(ring.size, dtype=np.int32) * value
                    got = np.asarray(f(ring.views[0]))
                    ok &= bool(np.array_equal(got, ring.hosts[0]))
                _SUPPORTED.append(ok)
            except Exception as exc:  # noqa: BLE001 - no UVA import here: the copying ring serves
                logger.warning("mapped index slots unavailable (%s: %s); indices are uploaded per call",
                               type(exc).__name__, exc)
                _SUPPORTED.append(False)
        return _SUPPORTED[0]


def stage_indices(dests, m: int, k: int, meta_len: int, fill, backend: str):
    """A call's indices staged for its kernel: ``(slot, None)`` in a mapped slot (GPU Triton
    backends where `supported`; the call takes `split_slot(to_device(slot), ...)`), else
    ``(None, (vectors, meta))`` through `device.IndexRing` (uploaded, then passed as they are).
    ``fill(segs, meta)`` writes the k i32[m] vectors and the i32[meta_len] metadata in place.
    Device calls only (both rings are CuPy memory: host calls take numpy indices as they are);
    ``dests``: the `device.Destinations` (or ring holder) whose kernels read the slots."""
    if backend == "triton" and supported():
        return mapped_index_ring(dests, m, k, meta_len).stage_with(fill, dests), None
    from pallas_kernels import device

    return None, device.index_ring(dests, m, k, meta_len).stage_with(fill, dests)


def fill_padded(vectors, meta):
    """A ``fill`` for `stage_indices` / `IndexRing.stage_with`: each vector zero-padded to the
    slot's m, the metadata as given."""
    def fill(segs, meta_seg):
        for seg, v in zip(segs, vectors):
            seg[:len(v)] = v
            seg[len(v):] = 0
        meta_seg[:] = meta
    return fill


def mapped_index_ring(dests, m: int, k: int, meta_len: int = 3) -> MappedIndexRing:
    """The `MappedIndexRing` of a destination set (`device.Destinations` or a ring holder with
    ``rings``) for `k` vectors of bucket `m` and `meta_len` metadata words (made once)."""
    key = ("mapped", m, k, meta_len)
    ring = dests.rings.get(key)
    if ring is None:
        ring = dests.rings[key] = MappedIndexRing(m, k, meta_len)
    return ring
