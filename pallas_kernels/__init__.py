"""Pallas kernels of dcp-jax: the strided row gather into a pack buffer (spec section 6).

`gather_rows` (kernel, jitted; traced row count and offset) and its oracle live in
`pallas_kernels.gather`; the host contract `pack_rows` / `PackSource` in `pallas_kernels.pack` (`pack_windows`, every
window of a round in one kernel launch, in `pallas_kernels.pack_windows`); the scatter side
`unpack_rows` / `copy_rows` in `pallas_kernels.unpack` (`RowCopier`, copies between the same two
layer lists prepared once, in `pallas_kernels.copier`; `RowUnpacker`, unpacks out of one receive
region into one layer list prepared once, in `pallas_kernels.unpacker`);
`pack_region`, one pack API over the TPU, GPU, XLA and host backends, in `pallas_kernels.registry`;
`written(buffer)`, a ticket that polls or waits for the kernels enqueued into one buffer only
(`synchronize` waits for the whole device), in `pallas_kernels.written`.
"""

from pallas_kernels import gather as _gather
from pallas_kernels.gather import (
    BACKENDS,
    MAX_PACK_WORDS,
    MAX_WORD_OFFSET,
    GatherConfig,
    addressable_words,
    bucket_rows,
    compile_count,
    compile_log,
    gather_rows,
    gather_rows_reference,
    pow2_chunks,
    select_backend,
    word_dtype,
)
from pallas_kernels.pack import PackSource, clear_import_cache, pack_rows, warm_pack_rows
from pallas_kernels.pack_windows import pack_windows, warm_pack_windows, warm_pack_windows_direct
from pallas_kernels.registry import (
    PackBackend,
    available_backends,
    backend_names,
    get_backend,
    pack_region,
    reference_region,
    register_backend,
    select_pack_backend,
)
from pallas_kernels.unpack import SCATTER_BACKENDS, copy_rows, synchronize, unpack_rows
from pallas_kernels.copier import RowCopier
from pallas_kernels.unpacker import RowUnpacker
from pallas_kernels.fanout import copy_fanout, warm_copy_fanout
from pallas_kernels.written import Written, written

__all__ = [
    # The gather, its knobs and the host contract (`pack_rows`, `PackSource`): gather's names.
    *_gather.__all__,
    "pack_windows",
    "warm_pack_rows",
    "warm_pack_windows",
    "warm_pack_windows_direct",
    "SCATTER_BACKENDS",
    "copy_rows",
    "RowCopier",
    "RowUnpacker",
    "copy_fanout",
    "warm_copy_fanout",
    "synchronize",
    "Written",
    "written",
    "unpack_rows",
    # One pack API over every accelerator (pallas_kernels.registry, pallas_kernels.backends).
    "PackBackend",
    "available_backends",
    "backend_names",
    "get_backend",
    "pack_region",
    "reference_region",
    "register_backend",
    "select_pack_backend",
]
