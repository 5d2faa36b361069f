"""The caller's KV layers as the pack kernel reads them: `PackSource` (checked once, kept for
many `pack_rows` calls), the zero-copy DLPack word views of CuPy layers (`_device_views`), and
`kernel_sources`, what one kernel call reads (a layer without a view copied per call).

Moved out of `pallas_kernels.pack`, which re-exports every name.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels import device
from pallas_kernels.config import word_dtype
from pallas_kernels._buffer_args import check_layers, is_cupy


def _device_views(layers, word: np.dtype, owning: bool):
    """JAX views (DLPack, zero-copy) of C-contiguous CuPy layers as words; None for the rest.
    Layers of one shape that lie back to back (a layer-major cache) come as ONE stacked
    u-word[L, R, W] view instead (`device.stacked_words`): one kernel argument, not L.

    `owning=False` imports through `cupy.cuda.UnownedMemory`, so the view keeps no reference
    to the caller's array (the weak cache evicts it when that array dies). An import that
    copied (another pointer) is not kept: a copy would go stale as the KV cache changes.
    """
    import cupy as cp

    stacked = device.stacked_words(layers, word, tuple(layers) if owning else None)
    if stacked is not None:
        return stacked
    views = []
    for a in layers:
        view = None
        if a.flags.c_contiguous and a.size:
            w = a.view(word)
            if not owning:
                mem = cp.cuda.UnownedMemory(a.data.ptr, a.nbytes, None, a.device.id)
                w = cp.ndarray(w.shape, word, cp.cuda.MemoryPointer(mem, 0))
            view = jax.dlpack.from_dlpack(w)
            if view.unsafe_buffer_pointer() != a.data.ptr:
                view = None
        views.append(view)
    return views


class PackSource:
    """The caller's KV layer buffers, checked once, for many `pack_rows` calls.

    Pass it to `pack_rows` in place of the layer list: the per-call type and shape checks are
    skipped and, for CuPy layers, the zero-copy DLPack imports are made once and kept here.
    It holds the layers (and the imports) as long as it lives, and nothing else does: drop it
    and the buffers are released. The layers are read, never written; their contents may
    change between calls (C-contiguous ones are read in place, others copied per call).

    Args:
        layers: non-empty sequence of u8[num_rows_l, kv_item_len_l] arrays, all numpy or all
            CuPy, sharing one row index space.

    Attributes:
        layers: the buffers (a tuple).
        on_device: True for CuPy layers.
        item_lens: bytes per row of each layer entry.
        num_rows: rows every layer has (the smallest `num_rows_l`).
        word: `word_dtype(item_lens)`, what the kernel moves; Pallas-path offsets must be
            multiples of its size.

    Raises:
        ValueError: empty `layers` or a layer that is not 2-D.
        TypeError: a layer that is not a numpy/CuPy uint8 array, or mixed kinds.
    """

    __slots__ = ("layers", "on_device", "item_lens", "num_rows", "word", "_views", "_groups",
                 "disjoint", "__weakref__")

    def __init__(self, layers):
        if not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError("layers must be a non-empty list of 2-D uint8 arrays")
        self.on_device = is_cupy(layers[0])
        self.item_lens, self.num_rows = check_layers(layers, self.on_device, "layers[0]")
        self.layers = tuple(layers)
        self.word = word_dtype(self.item_lens)
        self._views = self._groups = None
        self.disjoint: set = set()  # (address, bytes) of packs checked not to overlap the layers

    def device_views(self):
        """The cached JAX word views of CuPy layers (None where a layer is copied per call), or
        one stacked u-word[L, R, W] view of layers that lie back to back (`_device_views`)."""
        if self._views is None:
            self._views = _device_views(self.layers, self.word, owning=True)
        return self._views

    def stacked_groups(self):
        """CuPy layers that lie back to back as consecutive stacked u-word[L_j, R, W] views of at
        most 2**31 - 1 words each (`device.stacked_groups`: one view unless the stack is
        larger; the fused fan-out kernel reads them all in one launch); None otherwise (host
        layers, other shapes, not one buffer). Made once."""
        if self._groups is None:
            self._groups = (device.stacked_groups(self.layers, self.word, self.layers)
                            if self.on_device else None) or ()
        return self._groups or None

    def __repr__(self) -> str:
        kind = "cupy" if self.on_device else "numpy"
        return (f"PackSource({len(self.layers)} {kind} layers, item_lens={list(self.item_lens)}, "
                f"num_rows={self.num_rows}, word={self.word.name})")


def kernel_sources(layers, views, word):
    """What the kernel reads: the stacked view as it is, else one view per layer. Layers
    without a cached zero-copy view (not C-contiguous) are copied on every call, so the kernel
    always reads the KV cache as it is now."""
    if not isinstance(views, list):
        return views
    return [v if v is not None else _copy_view(a, word) for v, a in zip(views, layers)]


def _copy_view(a, word):
    import cupy as cp

    return jax.dlpack.from_dlpack(cp.ascontiguousarray(a).view(word))
