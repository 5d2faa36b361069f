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
    cost_schedules,
    cost_summary,
    job_page_tables,
    page_tables,
    plan_command,
    plot_descriptors_vs_prompt,
    region_rows,
    render_cost_table,
)
from dcp_jax.kv_data import DECODE_SIDE, PREFILL_SIDE, draw_page_table, pool_pages_for
from dcp_jax.layout import local_len_np
from dcp_jax.packing import rows_per_region
from dcp_jax.plan import build_mxn_transfer_plans, group_runs

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
    # A pack buffer sized for 200 tokens holds 2 * 100 rows, and the sender's windows may fill the
    # whole shared arena: each rank's 500 rows go as 3 slices (200, 200, 100).
    sliced = cost_report(**base, pack_max_tokens=200)
    assert rows_per_region(200 * 16, (8, 8)) == 200
    for r in _by(sliced, "packed"):
        assert r["packs"] == 3 and r["engine_calls"] == 3
        assert r["descriptors"] >= plain["packed"]["max_descriptors_per_rank"] // 2
        assert r["descriptors"] <= 2 * (-(-500 // 8) + 3)  # <= a run per page (+ slice cuts) per layer


@pytest.mark.parametrize("chunk_tokens", [None, 256])
def test_region_is_one_descriptor_per_window_and_fused_none(chunk_tokens):
    # Hand-counted: 1000 tokens, I = 1, N = 2, each rank owns every other token. Region: one
    # window (one descriptor, one batch, one pack) per chunk with rows for the rank, cut into
    # region-fulls by a pack buffer of 200 tokens (200 rows a window); fused: no descriptor.
    base = dict(num_layers=2, item_lens=(8, 24), prompt_tokens=1000, page_size=8, dcp_size=2,
                chunk_tokens=chunk_tokens)
    chunks = [(a, min(a + (chunk_tokens or 1000), 1000)) for a in range(0, 1000, chunk_tokens or 1000)]
    for pack, cap in ((None, None), (200, 200)):
        rows = cost_report(**base, pack_max_tokens=pack, modes=("region", "fused", "packed"))
        for d in (0, 1):
            per_chunk = [sum(1 for t in range(a, b) if t % 2 == d) for a, b in chunks]
            windows = sum(-(-n // (cap or n)) for n in per_chunk if n)
            region = [r for r in _by(rows, "region") if r["dst_rank"] == d][0]
            assert (region["descriptors"], region["batches"], region["engine_calls"], region["packs"]) == \
                (windows,) * 4
            assert region["rows"] == 500 and region["bytes"] == 500 * 32
            fused = [r for r in _by(rows, "fused") if r["dst_rank"] == d][0]
            assert (fused["descriptors"], fused["batches"], fused["engine_calls"], fused["packs"]) == (0,) * 4
            assert fused["bytes"] == region["bytes"]
            packed = [r for r in _by(rows, "packed") if r["dst_rank"] == d][0]
            assert packed["packs"] == windows and packed["descriptors"] > region["descriptors"]
    with pytest.raises(ValueError, match="modes must be among"):
        cost_report(**base, modes=("auto",))


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


def test_job_page_tables_are_drawn_like_the_job_and_shuffled():
    cfg = CostConfig(num_layers=1, item_lens=(4,), prompt_tokens=1600, decode_prefix_len=64, page_size=16,
                     prefill_dcp_size=2, dcp_size=4, interleave_size=2, seed=11)
    src, dst = job_page_tables(cfg)
    for k in range(2):  # 768 send rows, 48 pages, each prefill rank its own pool
        np.testing.assert_array_equal(src[k], draw_page_table(768, 16, pool_pages_for(48, 1.25), 11, PREFILL_SIDE, k))
        assert src[k].size == 1536 // 2 // 16
    pool = pool_pages_for(24, 1.25)  # the largest decode share: 384 rows
    for r in range(4):
        np.testing.assert_array_equal(dst[r], draw_page_table(384, 16, pool, 11, DECODE_SIDE, r, 0))
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


def test_page_tables_count_from_token_zero():
    cfg = CostConfig(num_layers=1, item_lens=(4,), prompt_tokens=1600, decode_prefix_len=128, page_size=16,
                     prefill_dcp_size=2, dcp_size=4, interleave_size=2, seed=3)
    (js, jd), (ps, pd) = job_page_tables(cfg), page_tables(cfg)
    drawn = {int(x) for t in (*js, *jd) for x in t}
    for job_t, full, prefix_rows in [(js[k], ps[k], 64) for k in range(2)] + [(jd[d], pd[d], 32) for d in range(4)]:
        k = prefix_rows // 16  # the prefix's pages come first, with ids the draw never gives
        assert full.size == k + job_t.size and not drawn & set(full[:k].tolist())
        np.testing.assert_array_equal(full[k:], job_t)
    # M = 3, I_p = 2, prefix 512: prefill rank 0 holds 172 prefix rows (not whole pages of 16):
    # its table is drawn for all its rows from token 0.
    odd = CostConfig(num_layers=1, item_lens=(4,), prompt_tokens=3000, decode_prefix_len=512, page_size=16,
                     prefill_dcp_size=3, prefill_interleave_size=2, dcp_size=4, interleave_size=32, seed=7)
    src, _ = page_tables(odd)
    assert [int(local_len_np(512, 3, k, 2)) for k in range(3)] == [172, 170, 170]
    rows0 = int(local_len_np(3000, 3, 0, 2))
    np.testing.assert_array_equal(src[0], draw_page_table(rows0, 16, pool_pages_for(-(-rows0 // 16), 1.25), 7,
                                                          PREFILL_SIDE, 0))


def test_counts_equal_the_old_planner_on_the_jobs_tables():
    """The schedule (section-10 tables) and plan.build_mxn_transfer_plans (send-range tables)
    are two codes of one plan: with a prefix, M > 1 and chunks they count the same descriptors."""
    cfg = CostConfig(num_layers=3, item_lens=(8, 8, 4), prompt_tokens=5000, decode_prefix_len=512, chunk_tokens=1000,
                     page_size=16, prefill_dcp_size=2, prefill_interleave_size=16, dcp_size=4, interleave_size=4,
                     seed=3)
    rows = _by(cost_report(cfg), "direct")
    src, dst = job_page_tables(cfg)
    want = [0] * 4
    for start, num in cfg.chunks():
        plans = build_mxn_transfer_plans(src, dst, page_size=16, prefill_dcp_size=2, prefill_interleave_size=16,
                                         dcp_size=4, interleave_size=4, decode_prefix_len=512, chunk_start=start,
                                         num_kv_tokens=num)
        for (_, d), p in plans.items():
            want[d] += 3 * group_runs(p.src_token_indices, p.dst_token_indices).shape[0]
    assert [r["descriptors"] for r in rows] == want


def test_explicit_page_tables_and_one_counting_model():
    cfg = CostConfig(num_layers=2, item_lens=(8, 4), prompt_tokens=512, page_size=8, prefill_dcp_size=2,
                     dcp_size=4, chunk_tokens=128)
    src, dst = page_tables(cfg)
    assert cost_report(cfg, src_page_tables=src, dst_page_tables=dst) == cost_report(cfg)
    # Contiguous destination pages: packed runs are whole tables, fewer descriptors than drawn ones.
    flat = cost_report(cfg, src_page_tables=src, dst_page_tables=[np.arange(16) + 16 * d for d in range(4)],
                       modes=("packed",))
    assert sum(r["descriptors"] for r in flat) < sum(r["descriptors"] for r in _by(cost_report(cfg), "packed"))
    # The rows are the schedules' per-rank counts, summed over prefill ranks: no second model.
    scheds = cost_schedules(cfg, engine_window=3)
    moon = cost_report(cfg, engine_window=3)
    for r in moon:
        per = [s.per_rank[r["dst_rank"]] for s in scheds[r["mode"]]]
        assert r["descriptors"] == sum(c.descriptors for c in per)
        assert r["engine_calls"] == sum(c.engine_calls for c in per)
        # Prefill rank s (odd/even tokens) sends nothing to decode ranks of the other parity:
        # 4 empty (chunk, source) units per rank, one notification-only call each on Mooncake.
        assert sum(c.empty_units for c in per) == 4 and r["notifications"] == r["batches"] + 4
        assert r["engine_calls"] == sum(-(-d // 3) + 1 for s in scheds[r["mode"]] for u in s.units
                                        if u.dst_rank == r["dst_rank"] and u.strategy != "empty"
                                        for d in u.descriptors_per_window(2)) + 4
    nixl = cost_report(cfg)
    assert all(r["engine_calls"] == r["batches"] == 4 for r in nixl)  # NIXL: one per batch, none per empty unit
    with pytest.raises(ValueError, match="dst_page_tables"):
        cost_report(cfg, src_page_tables=src, dst_page_tables=dst[:3])
    with pytest.raises(ValueError, match="together"):
        cost_report(cfg, src_page_tables=src)
    with pytest.raises(ValueError, match=r"dst_page_tables\[0\] is too short"):
        cost_report(cfg, src_page_tables=src, dst_page_tables=[t[:2] for t in dst])
    with pytest.raises(ValueError, match="prefill_rank"):
        region_rows(cfg, 2)


def test_cost_does_not_import_the_demo_job():
    import ast
    import dcp_jax.cost as cost

    tree = ast.parse(open(cost.__file__).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("transfer_job" in (m or "") for m in names)


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


def test_prefill_page_size_plans_the_jobs_tables_and_counts():
    # What `dcp-jax transfer --prefill-page-size 64` reported for this request (fresh-user trial 07):
    # direct 15,616 descriptors per rank (one per token per layer: 256 x 61), packed 915 / 854.
    cfg = CostConfig(**DSV3, prompt_tokens=512, page_size=16, dcp_size=2, prefill_page_size=64)
    assert cfg.src_page_size == 64 and [s.page_size for s in cfg.layouts()[0]] == [64]
    assert [s.page_size for s in cfg.layouts()[1]] == [16, 16]
    src, dst = job_page_tables(cfg)
    assert [t.size for t in src] == [8] and [t.size for t in dst] == [16, 16]  # 512/64; 256/16 each
    assert src[0].tolist() == draw_page_table(512, 64, pool_pages_for(8, 1.25), 0, PREFILL_SIDE, 0).tolist()
    rows = cost_report(cfg)
    assert [(r["mode"], r["descriptors"]) for r in rows] == [
        ("direct", 15616), ("direct", 15616), ("packed", 915), ("packed", 854)]
    same = CostConfig(**DSV3, prompt_tokens=512, page_size=16, dcp_size=2, prefill_page_size=16)
    assert cost_report(same) == cost_report(dataclasses.replace(same, prefill_page_size=None))


@pytest.mark.parametrize("value, exc", [(0, ValueError), (2.0, TypeError)])
def test_prefill_page_size_is_checked_by_name(value, exc):
    with pytest.raises(exc, match=f"prefill_page_size.*{value}"):
        CostConfig(**DSV3, prompt_tokens=512, prefill_page_size=value)
