"""Pallas kernels of dcp-jax: the strided row gather into a pack buffer (spec section 6)."""

from pallas_kernels.gather import (
    BACKENDS,
    GatherConfig,
    bucket_rows,
    clear_import_cache,
    gather_rows,
    gather_rows_reference,
    pack_rows,
    pow2_chunks,
    select_backend,
    word_dtype,
)

__all__ = [
    "BACKENDS",
    "GatherConfig",
    "bucket_rows",
    "clear_import_cache",
    "gather_rows",
    "gather_rows_reference",
    "pack_rows",
    "pow2_chunks",
    "select_backend",
    "word_dtype",
]
