"""`dcp-jax plan` for heterogeneous pairs: per-rank descriptors, per-layer and cross-layer."""
import pytest
from typer.testing import CliRunner

from dcp_jax.cli import app
from dcp_jax.hetero.cost import hetero_counts

runner = CliRunner()


def _side(page, dcp=1, inter=1, tp=1, layout=None):
    return dict(page_size=page, dcp_size=dcp, interleave_size=inter, tp_size=tp, layout=layout)


def test_mla_block_round_robin_counts_by_hand():
    """DeepSeek-V3 (61 layers), 1,024 tokens, prefill page 128 -> decode page 32, DCP4, I=32: each
    decode rank gets 8 whole pages; per-layer caches cost 1 descriptor per page run per layer
    (runs split at the prefill's 128-token pages too), cross-layer pages 1 per page."""
    rows = hetero_counts("deepseek-v3", 1024, _side(128), _side(32, 4, 32))
    assert [r["rows"] for r in rows] == [256] * 4
    assert all(r["cross_layer"] == 8 for r in rows)
    assert all(r["descriptors"] == 8 * 61 for r in rows)


def test_gqa_tp_split_every_decode_rank_gets_its_heads():
    rows = hetero_counts("llama-3.1-8b", 256, _side(16, tp=2), _side(64, 2, tp=4, layout="hnd"))
    assert len(rows) == 8 and all(r["rows"] == 128 * 2 for r in rows)  # 128 tokens x 2 of 8 heads
    assert all(r["cross_layer"] <= r["descriptors"] for r in rows)
    # Direct, NHD -> HND, 2 heads per decode rank: one descriptor per (token, head, K/V, layer).
    assert [r["direct"] for r in rows] == [128 * 2 * 2 * 32] * 8


def test_direct_counts_by_hand_where_rows_move_whole():
    """MLA, equal layouts, no TP, prefill page 128 -> decode page 32, DCP4, I=32: a decode rank's
    8 pages each take one descriptor per layer (a 32-token block is contiguous on both sides:
    inside one prefill page and one decode page)."""
    rows = hetero_counts("deepseek-v3", 1024, _side(128), _side(32, 4, 32))
    assert all(r["direct"] == 8 * 61 == r["descriptors"] for r in rows)


def test_cli_prints_both_columns_and_refuses_bad_input():
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--prompt-tokens", "512", "--prefill-page-size",
                              "16", "--page-size", "64", "--prefill-tp-size", "2", "--tp-size", "4", "--dcp-size",
                              "2", "--decode-layout", "hnd"])
    assert res.exit_code == 0, res.output
    assert "cross-layer" in res.output and "per-layer" in res.output and "posts" in res.output
    for args, text in [(["--model", "gpt-9", "--tp-size", "2"], "model='gpt-9'"), (["--decode-layout", "csr"], "csr"),
                       (["--model", "llama-3.1-8b", "--tp-size", "3"], "num_kv_heads=8 and tp_size=3"),
                       # which side's option, and what transfer refuses (plan ran minutes, or out of memory)
                       (["--model", "llama-3.1-8b", "--prefill-tp-size", "3", "--tp-size", "2"],
                        "the prefill side (--prefill-tp-size=3"),
                       (["--model", "llama-3.1-8b", "--page-size", "0", "--tp-size", "2"], "--page-size=0 must be"),
                       (["--model", "llama-3.1-8b", "--tp-size", "2", "--dcp-size", "100"], "at most 64 a side")]:
        res = runner.invoke(app, ["plan", "--prompt-tokens", "256", *args])
        assert res.exit_code == 2, res.output
        assert text in " ".join(res.output.replace("│", " ").split()), res.output


def test_side_from_a_connector_spec():
    from dcp_jax.hetero import HeteroSide
    from dcp_jax.transfer import KVCacheSpec

    mla = HeteroSide.from_spec(KVCacheSpec(61, [1152] * 61, 64, 8, 3, 16))
    assert (mla.layout, mla.head_dim, mla.page_size, mla.dcp_size, mla.interleave_size) == ("sglang_mla", 576, 64, 8, 16)
    gqa = HeteroSide.from_spec(KVCacheSpec(32, [4096] * 32, 16, layout="hnd", tp_size=2, num_kv_heads=8, head_dim=128))
    assert (gqa.layout, gqa.tp_size, gqa.num_kv_heads, gqa.head_dim) == ("hnd", 2, 8, 128)
    with pytest.raises(ValueError, match="head_dim must be given"):
        HeteroSide.from_spec(KVCacheSpec(32, [4096] * 32, 16, layout="nhd", num_kv_heads=8))
