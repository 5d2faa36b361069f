"""Cost report: counts from the real plans, the spec's descriptor numbers, table, plot, command."""

import dataclasses
import io
import logging

import numpy as np
import pytest
from rich.console import Console

from dcp_jax.cost import (
    CostConfig,
    cost_report,
    cost_summary,
    job_page_tables,
    plan_command,
    plot_descriptors_vs_prompt,
    render_cost_table,
)
from dcp_jax.layout import local_len_np
from dcp_jax.packing import rows_per_region

DSV3 = dict(num_layers=61, item_lens=(1152,) * 61)


def _by(rows, mode):
    return [r for r in rows if r["mode"] == mode]


@pytest.fixture(scope="module")
def dsv3_32k():
    return {
        inter: cost_report(**DSV3, prompt_tokens=32768, page_size=64, dcp_size=8, interleave_size=inter)
        for inter in (1, 64)
    }


def test_token_round_robin_direct_is_249856_descriptors_per_rank(dsv3_32k):
    direct = _by(dsv3_32k[1], "direct")
    assert [r["descriptors"] for r in direct] == [249_856] * 8
    assert [r["rows"] for r in direct] == [4096] * 8
    assert [r["bytes"] for r in direct] == [4096 * 61 * 1152] * 8
    assert [r["engine_calls"] for r in direct] == [1] * 8  # all layers in one batch


def test_packed_is_at_least_50x_fewer(dsv3_32k):
    direct, packed = _by(dsv3_32k[1], "direct"), _by(dsv3_32k[1], "packed")
    for d, p in zip(direct, packed):
        assert p["descriptors"] * 50 <= d["descriptors"]
        # Only destination pages break runs: at most one descriptor per page per layer.
        assert p["descriptors"] <= 61 * 4096 // 64
        assert p["packs"] == 1 and p["engine_calls"] == 1
    s = cost_summary(dsv3_32k[1])
    print(f"token RR 32k: direct {s['direct']['descriptors']:,} vs packed {s['packed']['descriptors']:,}"
          f" ({s['direct']['descriptors'] / s['packed']['descriptors']:.1f}x)")


def test_block_round_robin_direct_is_at_most_1_32_of_token_rr(dsv3_32k):
    token = cost_summary(dsv3_32k[1])["direct"]
    block = cost_summary(dsv3_32k[64])["direct"]
    assert block["descriptors"] * 32 <= token["descriptors"]
    assert block["max_descriptors_per_rank"] <= 61 * 64  # one block = one page per run at most
    assert block["bytes"] == token["bytes"] == 32768 * 61 * 1152


def test_bytes_are_conserved_mxn_with_prefix_and_chunks():
    cfg = CostConfig(
        num_layers=4, item_lens=(48, 16, 96, 8), prompt_tokens=3000, decode_prefix_len=512, chunk_tokens=700,
        page_size=16, prefill_dcp_size=3, prefill_interleave_size=2, dcp_size=4, interleave_size=32, seed=7,
    )
    rows = cost_report(cfg)
    for mode in ("direct", "packed"):
        part = _by(rows, mode)
        for r in part:
            want = int(local_len_np(3000, 4, r["dst_rank"], 32) - local_len_np(512, 4, r["dst_rank"], 32))
            assert r["rows"] == want
            assert r["bytes"] == want * 168
        assert sum(r["rows"] for r in part) == 2488
    # Chunks: 2488 / 700 -> 4 chunks; every (chunk, src, dst) pair with rows is one call.
    assert cfg.chunks() == [(512, 700), (1212, 700), (1912, 700), (2612, 388)]


def test_windows_and_slices_count_engine_calls():
    base = dict(num_layers=2, item_lens=(8, 8), prompt_tokens=1000, page_size=8, dcp_size=2)
    plain = cost_summary(cost_report(**base))
    windowed = cost_report(**base, max_batch_indices=64)
    for r in _by(windowed, "direct"):
        assert r["engine_calls"] == -(-500 // 64)
        assert r["descriptors"] == 500 * 2  # token round-robin: a run per token anyway
    # A pack buffer sized for 200 tokens -> 100 rows per region -> 5 slices of the 500 rows.
    sliced = cost_report(**base, pack_max_tokens=200)
    region_rows = rows_per_region(100 * 16, (8, 8))
    assert region_rows == 100
    for r in _by(sliced, "packed"):
        assert r["packs"] == 5 and r["engine_calls"] == 5
        assert r["descriptors"] >= plain["packed"]["max_descriptors_per_rank"] // 2
        assert r["descriptors"] <= 2 * (-(-500 // 8) + 5)  # <= a run per page (+ slice cuts) per layer


def test_no_pack_region_falls_back_to_per_row_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dcp_jax.packing"):
        rows = cost_report(num_layers=3, item_lens=(4, 4, 4), prompt_tokens=64, page_size=4, dcp_size=4,
                           pack_max_tokens=0)
    direct, packed = _by(rows, "direct"), _by(rows, "packed")
    assert [r["descriptors"] for r in packed] == [r["descriptors"] for r in direct] == [16 * 3] * 4
    assert all(r["per_row_fallbacks"] == 1 and r["packs"] == 0 for r in packed)
    assert any("per-row" in rec.getMessage() for rec in caplog.records)


def test_equal_layouts_block_rr_direct_moves_whole_pages():
    rows = cost_report(num_layers=5, item_lens=(10,) * 5, prompt_tokens=64 * 40, page_size=64,
                       prefill_dcp_size=4, prefill_interleave_size=64, dcp_size=4, interleave_size=64, modes=("direct",))
    for r in rows:
        assert r["rows"] == 640 and r["descriptors"] <= 5 * 10 and r["engine_calls"] == 1


def test_job_page_tables_are_the_jobs_and_shuffled():
    from dcp_jax.kv_data import draw_page_table
    from dcp_jax.transfer_job import JobConfig, _prefill_page_table, decode_page_table, decode_pool_pages

    cfg = CostConfig(num_layers=1, item_lens=(4,), prompt_tokens=1600, decode_prefix_len=64, page_size=16,
                     prefill_dcp_size=2, dcp_size=4, interleave_size=2, seed=11)
    src, dst = job_page_tables(cfg)
    job = JobConfig(model="tiny", prompt_tokens=1600, prefix_tokens=64, page_size=16, prefill_dcp_size=2,
                    dcp_size=4, interleave_size=2, seed=11)
    pool = decode_pool_pages(job)
    for k in range(2):
        np.testing.assert_array_equal(src[k], _prefill_page_table(job, k)[2])
        assert src[k].size == 1536 // 2 // 16
    for r in range(4):
        np.testing.assert_array_equal(dst[r], decode_page_table(job, r, 4, pool))
        assert dst[r].size == 1536 // 4 // 16 and np.unique(dst[r]).size == dst[r].size
        assert dst[r].max() < pool and dst[r].tolist() != sorted(dst[r].tolist())
    # Another seed, other tables; the same seed, the same tables.
    assert any((a != b).any() for a, b in zip(dst, job_page_tables(dataclasses.replace(cfg, seed=12))[1]))
    np.testing.assert_array_equal(draw_page_table(100, 16, 20, 5, 2, 0, 0), draw_page_table(100, 16, 20, 5, 2, 0, 0))
    assert draw_page_table(100, 16, 20, 5, 2, 0, 0).size == 7 and draw_page_table(0, 16, 1, 5, 1, 0).size == 0
    with pytest.raises(ValueError, match="num_rows"):
        draw_page_table(-1, 16, 20, 0, 1, 0)
    with pytest.raises(ValueError, match="pool_pages"):
        draw_page_table(100, 16, 6, 0, 1, 0)
    with pytest.raises(ValueError, match="pool_slack"):
        CostConfig(num_layers=1, item_lens=(4,), prompt_tokens=64, pool_slack=0.5)


def test_render_table_and_plan_command():
    rows = cost_report(**DSV3, prompt_tokens=32768, modes=("direct",))
    console = Console(file=io.StringIO(), width=120)
    console.print(render_cost_table(rows, title="t"))
    text = console.file.getvalue()
    assert "249,856" in text and "1,998,848" in text
    buf = Console(file=io.StringIO(), width=120)
    got = plan_command("tiny-mixed", 500, page_size=8, dcp_size=2, console=buf)
    assert {r["mode"] for r in got} == {"direct", "packed"}
    assert sum(r["bytes"] for r in got if r["mode"] == "direct") == 500 * (48 + 16 + 96 + 8)
    assert "tiny-mixed" in buf.file.getvalue()
    explicit = plan_command("custom", 256, num_layers=2, item_lens=(3, 5), dcp_size=2, page_size=4, mode="packed",
                            console=Console(file=io.StringIO()))
    assert {r["mode"] for r in explicit} == {"packed"}


def test_plot_is_written(tmp_path):
    path = tmp_path / "d.png"
    series = plot_descriptors_vs_prompt(str(path), num_layers=3, item_lens=(8, 8, 8), page_size=8, dcp_size=4,
                                        prompt_tokens=(256, 1024, 4096))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(series) == 4
    direct = series["direct, token round-robin (I=1)"]
    assert direct == [3 * t // 4 for t in (256, 1024, 4096)]
    for values in series.values():
        assert values == sorted(values)
    with pytest.raises(ValueError, match="plot=.*cannot write"):
        plot_descriptors_vs_prompt(str(tmp_path / "missing" / "d.png"), num_layers=1, item_lens=(8,), page_size=8,
                                   dcp_size=2, prompt_tokens=(256,))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(item_lens=(4,)), "item_lens"),
        (dict(prompt_tokens=-1), "prompt_tokens"),
        (dict(decode_prefix_len=100), "decode_prefix_len"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(dcp_size=0), "dcp_size"),
        (dict(interleave_size=0), "interleave_size"),
        (dict(prefill_dcp_size=0), "prefill_dcp_size"),
        (dict(max_batch_indices=0), "max_batch_indices"),
    ],
)
def test_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        CostConfig(**{**dict(num_layers=2, item_lens=(4, 4), prompt_tokens=64), **change})


def test_bad_mode_and_model():
    with pytest.raises(ValueError, match="modes"):
        cost_report(num_layers=1, item_lens=(4,), prompt_tokens=8, modes=("bogus",))
    with pytest.raises(ValueError, match="mode"):
        plan_command("deepseek-v3", 64, mode="fast", console=Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="geometry"):
        plan_command("no-such-model", 64, console=Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="decode_prefix_len"):
        cost_report(num_layers=1, item_lens=(4,), prompt_tokens=64, decode_prefix_len=8, page_size=4, dcp_size=4)
