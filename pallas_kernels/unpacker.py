"""`RowUnpacker`: `unpack_rows` out of one receive region into one set of KV layers, prepared once.

The region path's decode rank unpacks every window that lands in its receive region into its
pages: always the same region buffer and the same layer list. `unpack_rows` re-derives per call
what only changes with them (the layer checks, the disjointness checks, the one-buffer test,
the DLPack views and the destinations' handles: cache lookups keyed on the 61 layers); on an
H200 that host work was 528 us a call back to back and 1,665 us after 0.3 s asleep (the
receiver's worker waits between windows), against a 0.16 ms kernel (2026-12-04,
`benchmarks/gpu/host_profile.py`). A `RowUnpacker` does it at construction, so a call costs
the offset and index checks, one index staging and one launch: on the GPU, into a layer-major
cache (one flat destination) with host indices, Triton's own launcher (`triton_plans.UnpackPlan`,
no JAX dispatch; ``DCP_JAX_DIRECT_LAUNCH=0`` or a failure turns it off: the jitted call serves).
"""

from __future__ import annotations

import threading

import numpy as np

from pallas_kernels import device, triton_launch
from pallas_kernels._args import offset_arg
from pallas_kernels._buffer_args import (_check_no_overlap, check_bool, check_fits, check_indices, check_offset,
                                         check_range, check_still_writeable)
from pallas_kernels.config import GatherConfig, bucket_rows, buckets_up_to, word_dtype
from pallas_kernels.host import check_threads, unpack_host
from pallas_kernels.pack import _offset_align
from pallas_kernels.unpack import _check_disjoint, _check_layer_list, _kind, _resolve
from pallas_kernels.unpack_device import (
    _contiguous,
    check_pallas_region,
    enqueue_unpack,
    flat_layers,
    unpack_cupy,
    unpack_pallas,
)

__all__ = ["RowUnpacker"]


class RowUnpacker:
    """`layers[l][indices[j]] = row j of entry l of the layer-major region at pack[offset:]`,
    for many calls between the same region buffer and layer list: the semantics of
    `unpack_rows`, with its per-buffer work done once.

    Holds both (and, on the GPU, the kernel's view of the region and the layers' JAX handles)
    until `close()`; it allocates nothing else but the small device index slots of the layers.
    Close it before the layers' or the region's memory goes away.

    Args:
        pack: u8[size], 1-D, C-contiguous: the receive region's buffer (numpy for host layers,
            CuPy for CuPy layers), read only.
        layers: sequence of u8[num_rows_l, kv_item_len_l] arrays (all numpy or all CuPy),
            writeable, sharing one row index space, no byte shared with `pack` or each other;
            CuPy layers C-contiguous for the "triton" backend (lying back to back in one buffer,
            a layer-major cache, they are written through ONE flat destination).
        backend: as `unpack_rows` ("auto": "numpy" for host layers; on the GPU "triton", or
            "cupy" on a JAX without the Triton lowering).
        config: Pallas tuning knobs (`GatherConfig.default()` when None).
        threads: host form only: worker threads (as `pack_rows`).

    Raises:
        ValueError, TypeError: as `unpack_rows` for the layers, the pack and the backend, each
            naming the argument: an empty or non-2-D layer list, a read-only layer, rows of 0
            bytes, a pack that is not 1-D uint8 C-contiguous or not of the layers' kind,
            `pack` sharing memory with a layer, two layers sharing memory, a "triton" layer
            that is not C-contiguous, a CuPy pack whose address is off the word size.
    """

    def __init__(self, pack, layers, *, backend: str = "auto", config: GatherConfig | None = None,
                 threads: int | None = None):
        if not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError("layers must be a non-empty list of 2-D uint8 arrays")
        kind, item_lens, num_rows = _check_layer_list(layers, "layers", writeable=True)  # rows of >= 1 byte
        self.on_device = kind == "device"
        pk = _kind(pack)
        if pk is None or pk == "jax" or (pk == "numpy") == self.on_device:
            want = "CuPy" if self.on_device else "numpy"
            raise TypeError(f"pack must be a {want} uint8 array like the layers, got {type(pack).__name__}")
        if pack.ndim != 1 or pack.dtype != np.uint8 or not pack.flags.c_contiguous:
            raise ValueError(f"pack must be a 1-D C-contiguous uint8 array, got {pack.dtype}{list(pack.shape)}")
        if config is not None and not isinstance(config, GatherConfig):
            raise TypeError(f"config must be a GatherConfig or None, got {type(config).__name__}")
        check_threads(threads)
        _check_disjoint([pack], "pack", layers, "layers")
        _check_no_overlap(layers, "layers")
        self.backend = _resolve(backend, self.on_device)
        self.item_lens, self.num_rows = tuple(item_lens), num_rows
        self.config = GatherConfig.default() if config is None else config
        self.threads = threads
        self._pack, self._layers = pack, tuple(layers)
        self._word = word_dtype(item_lens)
        self._flat = self._dests = self._src = self._plan = None
        self._lock = threading.Lock()  # close() waits for an unpack in progress on another thread
        if self.backend in ("triton", "interpret"):
            check_pallas_region(0, 0, item_lens, int(pack.size), self.backend, pack)  # the address
        if self.backend == "triton":
            _contiguous(self._layers, "layers")
            self._flat = flat_layers(self._layers, self._word.itemsize)
            self._src = device.source_views([pack], self._word)[0]  # None: copied per call

    @property
    def layers(self) -> tuple:
        """The destination layers (empty once closed)."""
        return self._layers or ()

    def unpack(self, indices, *, offset: int = 0, checked: bool = False) -> int:
        """Write the n rows of the region at byte `offset` of the pack into rows `indices`.

        Args:
            indices: int[n] destination rows (numpy, CuPy or a sequence), unique.
            offset: byte offset of the region inside the pack (>= 0); Pallas backends: a
                multiple of the word size, the region ending within the addressable words
                (as `unpack_rows`).
            checked: device layers: skip the index range and uniqueness checks (the caller
                checked them, e.g. against a page table it validated; the kernel still clamps
                every index in range). Host layers always check (cheap there).

        Returns:
            Rows unpacked (n). Host: the bytes are there on return. Device: the kernel is
            enqueued on JAX's stream; `synchronize(layers)` waits for it.

        Raises:
            ValueError: an `offset` that is not a non-negative int (as `unpack_rows`) or is
                misaligned, a region past the end of the pack,
                an index out of range or repeated (unless `checked`), non-1-D `indices`, a
                host layer made read-only since (nothing written); RuntimeError: `close()`d.
            TypeError: non-integer `indices`, a non-bool `checked`.
        """
        with self._lock:
            return self._unpack(indices, offset, checked)

    def _unpack(self, indices, offset, checked) -> int:
        if self._layers is None:
            raise RuntimeError("this RowUnpacker is closed")
        check_bool(checked, "checked")
        offset = check_offset(offset)
        idx = check_indices(indices, "indices", device_ok=self.on_device)
        n = int(idx.shape[0])
        size = int(self._pack.size)
        total = check_fits(offset, n, self.item_lens, size)
        if self.backend in ("triton", "interpret"):
            check_pallas_region(offset, total, self.item_lens, size, self.backend, None)
        if n == 0:
            return 0
        if not checked or not self.on_device:  # host checks are cheap; numpy's -1 stays out
            check_range(idx, "indices", self.num_rows, "layers", unique=True)
        if self.backend in ("numpy", "interpret"):  # host layers: all written or none
            check_still_writeable(self._layers, "layers")
        if self.backend == "numpy":
            unpack_host(self._pack, list(self._layers), idx, offset, self.item_lens, self.threads)
        elif self.backend == "cupy":
            unpack_cupy(self._pack, self._layers, idx, offset, self.item_lens)
        elif self.backend == "interpret" or self._src is None:  # no zero-copy view: the general form
            unpack_pallas(self._pack, list(self._layers), idx, offset, self.item_lens, self.backend, self.config)
        else:
            ws = self._word.itemsize
            dests = self._destinations()
            align = _offset_align(offset, self._word)
            if self._flat is not None and isinstance(idx, np.ndarray) and triton_launch.enabled(self.backend, "unpack") \
                    and self._launch_direct(dests, idx, offset // ws, align):
                return n
            try:
                triton_launch.after_direct([dests])  # a direct unpack into these rows ends first
                enqueue_unpack(self._src, idx, dests, self._flat, offset // ws, align, ws, self.config, self.backend)
            except Exception:
                self._dests = None  # its donated handles may be gone: made afresh next call
                raise
        return n

    def _launch_direct(self, dests, idx: np.ndarray, offset_words: int, align: int) -> bool:
        """The unpack through `triton_plans.UnpackPlan` (made on first use: pointers and shapes
        only); False if it could not launch (then off for the process, the JAX launch serves)."""
        n = int(idx.shape[0])
        units, ok = offset_arg(offset_words, align, self.backend, self._word.itemsize)
        return self._enqueue_direct(dests, idx, bucket_rows(n, self.config.block_rows), (n, int(units), int(ok)),
                                    align)

    def warm(self, max_rows: int, *, every_bucket: bool = False) -> list[int]:
        """Compiles the direct unpack (`triton_plans.UnpackPlan`, what `unpack` launches on CuPy
        layers) for the index bucket of `max_rows` rows (or every bucket up to it), at a
        16-byte-aligned offset (every receive-region range is), writing nothing (each launch
        masks every row). The compile is process-wide (another `RowUnpacker` of the same shapes
        reuses it) and takes seconds a bucket: on an H100, 27.5 s for the 32k job's first window
        in each of eight decode processes at once on a fresh machine, 29.6 s for all seven
        buckets up to 4,096 rows with Triton's cache partly filled (2026-12-07). A decode rank
        calls this before its first window (`KVReceiver.warm_up`) so no window pays it on the
        thread that answers its peers.

        Args:
            max_rows: the most rows one `unpack` call carries (an int >= 1; more than the pack
                holds count as that many).
            every_bucket: also every smaller bucket (`config.buckets_up_to`), for callers whose
                windows vary in size; False: a smaller window compiles its bucket on first use.

        Returns:
            The buckets (rows, ascending) now compiled; [] where `unpack` does not launch this
            way (host layers, a backend other than "triton", direct launches of "unpack" off,
            a pack with no zero-copy view) or the launch failed (then off for the process).

        Raises:
            RuntimeError: `close()`d. TypeError: `max_rows` not an int (a bool, a float), or
                `every_bucket` not a bool; ValueError: `max_rows` < 1.
        """
        with self._lock:
            if self._layers is None:
                raise RuntimeError("this RowUnpacker is closed")
            if isinstance(max_rows, np.ndarray) and max_rows.ndim == 0 and max_rows.dtype.kind in "iu":
                max_rows = max_rows[()]
            if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)):
                raise TypeError(f"max_rows must be an int, got {type(max_rows).__name__} (max_rows={max_rows!r})")
            if max_rows < 1:
                raise ValueError(f"max_rows={max_rows!r} must be an int >= 1")
            check_bool(every_bucket, "every_bucket")
            if self.backend != "triton" or self._src is None or self._flat is None \
                    or not triton_launch.enabled(self.backend, "unpack"):
                return []
            fits = int(self._pack.size) // sum(self.item_lens)
            if fits < 1:
                return []
            dests, align, none = self._destinations(), _offset_align(0, self._word), np.zeros(0, np.int64)
            done = []
            rows = min(int(max_rows), fits)
            wanted = buckets_up_to(rows, self.config.block_rows) if every_bucket \
                else [bucket_rows(rows, self.config.block_rows)]
            for m in wanted:
                if not self._enqueue_direct(dests, none, m, (0, 0, 0), align):  # n = 0, ok = 0
                    break
                done.append(m)
            return done

    def _enqueue_direct(self, dests, idx: np.ndarray, m: int, meta: tuple, align: int) -> bool:
        from pallas_kernels.triton_plans import UnpackPlan

        def launch():
            if self._plan is None:
                self._plan = UnpackPlan(self._src, dests.ptrs[0], dests.handles[0].shape[0], self._flat, self.config)
            return self._plan.launch(idx, m, meta, align)

        with dests.lock:
            return triton_launch.launch_into("unpack", [dests], launch) is not None

    def _destinations(self) -> "device.Destinations":
        if self._dests is None or self._dests.handles is None:
            self._dests = device.Destinations(self._layers, self._word, flat=self._flat is not None)
        return self._dests

    def close(self) -> None:
        """Drop the buffers, view and handles (idempotent; after an `unpack` running on another
        thread returned). Enqueued kernels still finish."""
        with self._lock:
            self._pack = self._layers = self._dests = self._src = self._plan = None

    def __repr__(self) -> str:
        state = "closed" if self._layers is None else \
            f"{len(self.item_lens)} layers, item_lens={list(self.item_lens)}"
        return f"RowUnpacker({state}, backend={self.backend!r})"
