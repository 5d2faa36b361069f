"""KV-cache geometries of real models, by name, for the main job and the cost report.

A geometry fixes what one token of one layer costs on the wire: the number of layer entries (one
registered KV buffer per layer for MLA models) and ``kv_item_len``, the bytes of one row of each entry.

MLA (multi-head latent attention, DeepSeek-V2/V3 and Kimi K2) caches one latent vector per token and
layer, shared by all heads: ``kv_lora_rank`` (512) latent values plus the ``qk_rope_head_dim`` (64)
decoupled RoPE key, 576 values per row. In bf16 that is 576 x 2 = 1152 B per row; with an FP8 KV
cache (vLLM's ``kv_cache_dtype="fp8"`` for MLA) it is 576 B. Numbers are from the models' published
``config.json`` files (``num_hidden_layers``, ``kv_lora_rank``, ``qk_rope_head_dim``,
``num_attention_heads``).
"""

from __future__ import annotations

import dataclasses

__all__ = ["ModelGeometry", "GEOMETRIES", "DEFAULT_GEOMETRY", "get_geometry", "geometry_names"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The KV-cache shape of one model, as seen by a KV transfer.

    Attributes:
        name: Registry name (``"deepseek-v3"``, ...).
        num_layers: Number of layer entries (registered KV buffers); one per layer for MLA.
        kv_item_lens: Bytes of one row (one token) of each layer entry, ``len == num_layers``.
            Entries may differ (the spec allows per-entry ``item_len``).
        dtype: Element type of the cached values (``"bfloat16"``, ``"float8_e4m3fn"``, ``"uint8"``).
        kv_lora_rank: MLA latent width in elements (0 for the synthetic test geometries).
        qk_rope_head_dim: MLA decoupled RoPE key width in elements.
        num_heads: Query heads of the model (MLA shares one latent row across all of them, so the
            heads do not change the row size; they matter for the decode attention and LSE merge).
        description: One line for ``--help`` and the report.

    Raises:
        ValueError: ``num_layers`` < 1, ``len(kv_item_lens) != num_layers`` or an item length < 1.
    """

    name: str
    num_layers: int
    kv_item_lens: tuple[int, ...]
    dtype: str
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_heads: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"{self.num_layers=} must be >= 1")
        if len(self.kv_item_lens) != self.num_layers:
            raise ValueError(
                f"len(kv_item_lens)={len(self.kv_item_lens)} must equal {self.num_layers=}"
            )
        if any(int(n) < 1 for n in self.kv_item_lens):
            raise ValueError(f"every kv_item_len must be >= 1 byte, got {self.kv_item_lens=}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token across all layer entries (``sum(kv_item_lens)``)."""
        return int(sum(self.kv_item_lens))

    def request_bytes(self, num_tokens: int) -> int:
        """Bytes of the KV of ``num_tokens`` tokens over all layer entries.

        Raises:
            ValueError: ``num_tokens`` negative.
        """
        if num_tokens < 0:
            raise ValueError(f"{num_tokens=} must be >= 0")
        return int(num_tokens) * self.row_bytes


def _mla(name: str, layers: int, bytes_per_value: int, dtype: str, heads: int, desc: str) -> ModelGeometry:
    kv_lora_rank, rope = 512, 64
    item = (kv_lora_rank + rope) * bytes_per_value
    return ModelGeometry(
        name=name,
        num_layers=layers,
        kv_item_lens=(item,) * layers,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope,
        num_heads=heads,
        description=desc,
    )


GEOMETRIES: dict[str, ModelGeometry] = {
    g.name: g
    for g in (
        _mla("deepseek-v3", 61, 2, "bfloat16", 128,
             "DeepSeek-V3/R1: 61 layers, MLA 512+64 bf16 = 1152 B rows, 128 heads"),
        # Kimi K2 keeps DeepSeek-V3's MLA cache shape (61 layers, 576-wide latent rows) but halves
        # the attention heads to 64: same bytes per token on the wire, half the heads to merge.
        _mla("kimi-k2", 61, 2, "bfloat16", 64,
             "Kimi K2: 61 layers, MLA 512+64 bf16 = 1152 B rows, 64 heads"),
        _mla("deepseek-v3-fp8", 61, 1, "float8_e4m3fn", 128,
             "DeepSeek-V3 with an FP8 MLA cache: 61 layers, 576 B rows"),
        # Llama 3.1 8B (GQA): 8 KV heads of 128, K and V, bf16 -> 4096 B per token and layer at
        # TP 1 (the connector moves whole rows; TP head splits are the heterogeneous plan's).
        ModelGeometry("llama-3.1-8b", 32, (4096,) * 32, "bfloat16",
                      description="Llama 3.1 8B: 32 layers, GQA 8 KV heads x 128, K and V, bf16 = 4096 B rows (TP1)"),
        # Synthetic geometries for fast tests: few layers, and entries of different item_len so
        # layer-major pack offsets and per-entry descriptors are exercised.
        ModelGeometry("tiny", 3, (64, 64, 64), "uint8", description="test: 3 layers of 64 B rows"),
        # Rows of 128 B: the smallest the Mosaic GPU kernel copies (its bulk-copy quantum).
        ModelGeometry("tiny-128", 2, (128, 256), "uint8",
                      description="test: 2 layers of 128/256 B rows (Mosaic GPU's copy quantum)"),
        ModelGeometry("tiny-mixed", 4, (48, 16, 96, 8), "uint8",
                      description="test: 4 layers of 48/16/96/8 B rows (mixed item_len)"),
    )
}

DEFAULT_GEOMETRY = "deepseek-v3"


def geometry_names() -> list[str]:
    """Registered geometry names, in registry order."""
    return list(GEOMETRIES)


def get_geometry(name: str) -> ModelGeometry:
    """Look up a geometry by name (case-insensitive; ``_`` and ``-`` are interchangeable).

    Args:
        name: A registered name, e.g. ``"deepseek-v3"``.

    Returns:
        The frozen :class:`ModelGeometry`.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: unknown name; the message lists the valid names.
    """
    if not isinstance(name, str):
        raise TypeError(f"{name=} must be a str")
    key = name.strip().lower().replace("_", "-")
    try:
        return GEOMETRIES[key]
    except KeyError:
        raise ValueError(
            f"unknown model geometry {name=}; valid names: {', '.join(GEOMETRIES)}"
        ) from None
