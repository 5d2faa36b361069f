"""The ``host`` pack backend: numpy buffers through `pallas_kernels.pack_rows(backend="numpy")`
(threaded `np.take` straight into the pack; any byte offset, no compile)."""

from __future__ import annotations

from pallas_kernels import pack_rows
from pallas_kernels.registry import PackBackend, register_backend


class HostBackend(PackBackend):
    name = "host"
    kinds = ("numpy",)

    def _pack(self, layers, idx, pack, offset, kind, page_size):
        if not pack.flags.writeable:
            raise ValueError("pack must be writeable (a registered buffer, not a read-only view)")
        pack_rows(layers, idx, pack, offset=offset, backend="numpy")
        return pack


register_backend(HostBackend())
