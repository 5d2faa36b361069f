"""Model geometries: published MLA shapes, lookup by name, and bad input."""
import dataclasses

import pytest

from dcp_jax.geometry import DEFAULT_GEOMETRY, GEOMETRIES, ModelGeometry, geometry_names, get_geometry


@pytest.mark.parametrize(
    "name, layers, item_len, heads",
    [("deepseek-v3", 61, 1152, 128), ("kimi-k2", 61, 1152, 64), ("deepseek-v3-fp8", 61, 576, 128)],
)
def test_real_geometries(name, layers, item_len, heads):
    g = get_geometry(name)
    assert g.num_layers == layers
    assert g.kv_item_lens == (item_len,) * layers
    assert g.num_heads == heads
    # MLA rows are the 512-wide latent plus the 64-wide RoPE key.
    assert (g.kv_lora_rank + g.qk_rope_head_dim) * (2 if g.dtype == "bfloat16" else 1) == item_len
    assert g.row_bytes == layers * item_len


def test_default_is_deepseek_and_request_bytes():
    g = get_geometry(DEFAULT_GEOMETRY)
    assert g.name == "deepseek-v3"
    # 61 x 32768 x 1152 B, the prefill side of the default request.
    assert g.request_bytes(32768) == 61 * 32768 * 1152 == 2_302_672_896
    with pytest.raises(ValueError, match="num_tokens"):
        g.request_bytes(-1)


def test_lookup_is_forgiving_about_case_and_underscores():
    assert get_geometry("DeepSeek_V3") is GEOMETRIES["deepseek-v3"]
    assert get_geometry(" kimi-k2 ") is GEOMETRIES["kimi-k2"]


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_geometry("llama-3")
    msg = str(e.value)
    assert "llama-3" in msg and all(n in msg for n in geometry_names())
    with pytest.raises(TypeError, match="name"):
        get_geometry(61)


def test_mixed_test_geometry_and_frozen():
    g = get_geometry("tiny-mixed")
    assert len(set(g.kv_item_lens)) > 1 and g.row_bytes == sum(g.kv_item_lens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.num_layers = 2


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(num_layers=0, kv_item_lens=()), "num_layers"),
        (dict(num_layers=2, kv_item_lens=(8,)), "kv_item_lens"),
        (dict(num_layers=2, kv_item_lens=(8, 0)), "kv_item_len"),
    ],
)
def test_bad_geometry(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        ModelGeometry(name="bad", dtype="uint8", **kwargs)
