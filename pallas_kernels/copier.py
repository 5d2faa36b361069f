"""`RowCopier`: `copy_rows` between the same two sets of KV layers, prepared once for many calls.

The fused connector path copies a decode rank's rows from the prefill pages into the rank's
IPC-mapped pages once per window of every request, always between the same two layer lists.
`copy_rows` re-derives per call what only changes with the lists (layer checks, the disjointness
check, DLPack views, the destinations' handles: cache lookups keyed on 2 x 61 arrays); on an H200
that host work was ~0.7 ms a call against a 0.16 ms kernel, and the fused path pays it once per
decode rank per round. A `RowCopier` does it at construction and keeps the results, so a call
costs the index checks, one index staging and one jitted dispatch.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels import device, triton_launch
from pallas_kernels._buffer_args import (_check_no_overlap, _extent, check_bool, check_indices, check_range,
                                         check_still_writeable)
from pallas_kernels.config import GatherConfig, word_dtype
from pallas_kernels.host import check_threads, copy_host
from pallas_kernels.pack import PackSource
from pallas_kernels.unpack import (
    _check_disjoint,
    _check_layer_list,
    _is_jax,
    _resolve,
    check_item_lens_match,
)
from pallas_kernels.unpack_device import (
    _contiguous,
    copy_cupy,
    copy_pallas,
    copy_sources,
    enqueue_copy,
    flat_layers,
)

__all__ = ["RowCopier"]


class RowCopier:
    """`dst_layers[l][dst_indices[j]] = src_layers[l][src_indices[j]]`, for many calls between
    the same layer lists: the semantics of `copy_rows`, with its per-list work done once.

    Holds both lists (and, on the GPU, the kernel's views of them and the destinations' JAX
    handles) until `close()` or until it is dropped; it allocates nothing else but the small
    device index slots of the destinations. Drop it before the destination memory goes away
    (e.g. before closing the IPC mapping the destinations view): a later `copy` would write
    into freed memory.

    Args:
        src_layers: sequence of u8[num_rows_src_l, kv_item_len_l] arrays (numpy or CuPy), read;
            or a `PackSource` of them, shared by the copiers of one source (their copies can
            then go out in one launch: `copy_fanout`). CuPy layers of one shape lying back to
            back in one buffer (a layer-major cache) are read through ONE stacked view
            (`device.stacked_words`).
        dst_layers: sequence of u8[num_rows_dst_l, kv_item_len_l] arrays of the same kind and
            item lengths, writeable (CuPy: C-contiguous; possibly over IPC-mapped memory). Layers
            lying back to back are written through one flat destination.
        backend: as `copy_rows` ("auto": "numpy" for host layers; on the GPU "triton", or
            "cupy" on a JAX without the Triton lowering).
        config: Pallas tuning knobs (`GatherConfig.default()` when None).
        threads: host form only: worker threads (as `pack_rows`).

    Raises:
        ValueError, TypeError: as `copy_rows` for the layer lists, the backend and `threads`
            (each naming the argument): mismatched layer counts or item lengths, rows of 0
            bytes, a destination layer sharing memory with a source or another destination.
    """

    def __init__(self, src_layers, dst_layers, *, backend: str = "auto",
                 config: GatherConfig | None = None, threads: int | None = None):
        if not isinstance(dst_layers, (list, tuple)) or not dst_layers:
            raise ValueError("dst_layers must be a non-empty list of 2-D uint8 arrays")
        if isinstance(src_layers, PackSource):
            source = src_layers
            skind = "device" if source.on_device else "host"
            s_lens, s_rows = source.item_lens, source.num_rows
        else:
            if not isinstance(src_layers, (list, tuple)) or not src_layers:
                raise ValueError("src_layers must be a non-empty list of 2-D uint8 arrays")
            skind, s_lens, s_rows = _check_layer_list(src_layers, "src_layers", writeable=False)
            if any(_is_jax(a) for a in src_layers):
                raise TypeError("src_layers must be numpy or CuPy arrays (got a JAX array)")
            source = PackSource(src_layers)
        dkind, d_lens, d_rows = _check_layer_list(dst_layers, "dst_layers", writeable=True)
        if skind != dkind:
            raise TypeError("src_layers and dst_layers must both be numpy (host) or both CuPy "
                            "(device) arrays")
        check_item_lens_match(s_lens, d_lens)
        if config is not None and not isinstance(config, GatherConfig):
            raise TypeError(f"config must be a GatherConfig or None, got {type(config).__name__}")
        check_threads(threads)
        _check_disjoint(list(source.layers), "src_layers", dst_layers, "dst_layers")
        _check_no_overlap(dst_layers, "dst_layers")
        spans = [_extent(a) for a in dst_layers if a.size]
        #: [first, last) byte addresses the destinations span (made once: `copy_fanout` compares
        #: the copiers of a call by it on every round).
        self.dst_span = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
        self.source = source
        self.on_device = skind == "device"
        self.backend = _resolve(backend, self.on_device)
        self.item_lens = tuple(s_lens)
        self.src_rows, self.dst_rows = s_rows, d_rows
        self.config = GatherConfig.default() if config is None else config
        self.threads = threads
        self._dst = tuple(dst_layers)
        self._word = word_dtype(s_lens)
        self._flat = self._dests = None
        #: Rows of every destination layer when they are one flat buffer of one shape (the
        #: fan-out kernel's condition, `pallas_kernels.fanout`); else None.
        self.uniform_rows = None
        if self.on_device and self.backend == "triton":
            _contiguous(self._dst, "dst_layers")
            self._flat = flat_layers(self._dst, self._word.itemsize)
            if self._flat is not None and len(set(self._flat)) == 1:
                self.uniform_rows = self._flat[0][0]

    @property
    def dst_layers(self) -> tuple:
        """The destination layers (empty once closed)."""
        return self._dst or ()

    def check_pair(self, src_indices, dst_indices, checked: bool = False):
        """The (src, dst) index arrays of one copy, checked as `copy` checks them.

        Returns:
            (sidx, didx): int arrays of one length n (numpy or CuPy as given).

        Raises:
            As `copy`.
        """
        if self.source is None:
            raise RuntimeError("this RowCopier is closed")
        check_bool(checked, "checked")
        sidx = check_indices(src_indices, "src_indices", device_ok=self.on_device)
        didx = check_indices(dst_indices, "dst_indices", device_ok=self.on_device)
        n = int(sidx.shape[0])
        if didx.shape[0] != n:
            raise ValueError(f"src_indices ({n}) and dst_indices ({didx.shape[0]}) must have the "
                             "same length")
        if n and (not checked or not self.on_device):  # host checks are cheap; numpy's -1 stays out
            check_range(sidx, "src_indices", self.src_rows, "src_layers", unique=False)
            check_range(didx, "dst_indices", self.dst_rows, "dst_layers", unique=True)
        return sidx, didx

    def copy(self, src_indices, dst_indices, *, checked: bool = False) -> int:
        """Copy rows `src_indices[j]` of every source layer into rows `dst_indices[j]`.

        Args:
            src_indices: int[n] source rows (numpy, CuPy or a sequence), repeats allowed.
            dst_indices: int[n] destination rows, unique.
            checked: device copiers: skip the range and uniqueness checks (the caller checked
                them; the kernel still clamps every index in range, so nothing is written out
                of bounds). Host copiers always check (cheap there).

        Returns:
            Rows copied (n). Host: the bytes are there on return. Device: the kernel is
            enqueued; `synchronize(dst_layers)` waits for it.

        Raises:
            ValueError: index lists of different lengths or not 1-D, an index out of range, a
                duplicate destination index (unless `checked`), a host destination layer made
                read-only since (nothing written); RuntimeError: `close()`d.
            TypeError: non-integer indices.
        """
        sidx, didx = self.check_pair(src_indices, dst_indices, checked)
        n = int(sidx.shape[0])
        if n == 0:
            return 0
        src = list(self.source.layers)
        if self.backend in ("numpy", "interpret"):  # host layers: all written or none
            check_still_writeable(self._dst, "dst_layers")
        if self.backend == "numpy":
            copy_host(src, sidx, list(self._dst), didx, self.item_lens, self.threads)
        elif self.backend == "cupy":
            copy_cupy(src, sidx, self._dst, didx)
        elif self.backend == "interpret":
            copy_pallas(src, sidx, list(self._dst), didx, self.item_lens, self.backend, self.config)
        else:
            dests = self.destinations()
            triton_launch.after_direct([dests])  # a fan-out launched without JAX ends first
            try:
                enqueue_copy(copy_sources(src, self.source.device_views(), self._word), sidx,
                             dests, didx, self._flat, self.config, self.backend)
            except Exception:
                self.drop_destinations()
                raise
        return n

    def destinations(self) -> "device.Destinations":
        """The JAX handles over the destination layers (made on first use; one flat handle when
        the layers lie back to back). Device copier only.

        Raises:
            RuntimeError: `close()`d."""
        if self._dst is None:
            raise RuntimeError("this RowCopier is closed")
        if self._dests is None or self._dests.handles is None:
            self._dests = device.Destinations(self._dst, self._word, flat=self._flat is not None)
        return self._dests

    def drop_destinations(self) -> None:
        """Forget the handles after a failed call (its donated handles may be gone)."""
        self._dests = None

    def fans_out_with(self, other: "RowCopier") -> bool:
        """Whether this copier's copies can share one fan-out kernel launch with `other`'s
        (`pallas_kernels.fanout.copy_fanout`): one source, stacked, flat uniform destinations,
        the same knobs, on the GPU."""
        return (self.source is other.source and self.source is not None
                and self.backend == "triton" == other.backend
                and (self.config is other.config or self.config == other.config)
                and self.uniform_rows is not None and other.uniform_rows is not None
                and self.source.stacked_groups() is not None)

    def close(self) -> None:
        """Drop the layers, views and handles (idempotent). Enqueued kernels still finish."""
        self.source = self._dst = self._dests = None

    def __repr__(self) -> str:
        state = "closed" if self.source is None else \
            f"{len(self.item_lens)} layers, item_lens={list(self.item_lens)}"
        return f"RowCopier({state}, backend={self.backend!r})"
