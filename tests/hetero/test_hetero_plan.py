"""The heterogeneous plan: hand cases, errors, the plan against a brute-force per-token reference
(2,000 random pairs), the plan executed by the numpy mover against a per-token reference mover
(byte-exact, 200 pairs), and the homogeneous-TP case against the connector's M x N plan.

CPU cost: ~25 s of CPU on this machine for the directory (the 2,000-pair property is most of it)."""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dcp_jax.hetero import (HeteroPlanError, HeteroSide, build_hetero_plan, cache_shape, descriptor_counts,
                            execute_plan, head_pieces, tp_head_range)
from dcp_jax.layout import local_len_np
from dcp_jax.plan import build_mxn_transfer_plans, build_token_transfer_plan

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hetero_reference import reference_move, reference_rows  # noqa: E402

PAGE_SIZES = (1, 16, 32, 64, 128, 256)


# ---------------------------------------------------------------------------- hand cases


def test_runs_split_at_the_smaller_page_boundary():
    # 128 tokens, DCP 1 -> 1, identity page tables: runs follow the smaller pages (16, then 32).
    plan = build_hetero_plan(HeteroSide(16), HeteroSide(64), 0, 128, [np.arange(8)], [np.arange(2)])
    assert plan.runs()[:, 1].tolist() == [16] * 8
    assert plan.runs(packed=True)[:, 1].tolist() == [64, 64]
    plan = build_hetero_plan(HeteroSide(128), HeteroSide(32), 0, 128, [[5]], [[3, 0, 2, 1]])
    assert plan.runs()[:, 1].tolist() == [32] * 4
    assert plan.dst_page[[0, 32, 64, 96]].tolist() == [3, 0, 2, 1]
    assert plan.src_page.tolist() == [5] * 128 and plan.src_slot.tolist() == list(range(128))
    assert descriptor_counts(plan, 61) == {(0, 0): 4 * 61}
    assert descriptor_counts(plan, 61, cross_layer=True) == {(0, 0): 4}


def test_descriptor_counts_gqa_tp2_to_dcp2_tp4_hnd():
    # The package docstring's example: Llama-3.1-8B-like (8 KV heads), 256 tokens, prefill TP 2
    # page 16 -> decode DCP 2 (token round-robin) x TP 4, page 64, HND, 32 layers.
    p = HeteroSide(page_size=16, tp_size=2, layout="nhd", num_kv_heads=8, head_dim=128)
    d = HeteroSide(page_size=64, dcp_size=2, tp_size=4, layout="hnd", num_kv_heads=8, head_dim=128)
    plan = build_hetero_plan(p, d, 0, 256, [range(16)], [range(2), range(2)])
    # Each decode rank: 128 tokens in 2 pages, 2 heads: HND with 2 heads lands one (token, head,
    # K/V) per descriptor: 2 * 2 * 128 per layer; cross-layer pages: one per full page.
    assert descriptor_counts(plan, 32) == {(r, t): 2 * 2 * 128 * 32 for r in range(2) for t in range(4)}
    assert descriptor_counts(plan, 32, cross_layer=True) == {(r, t): 2 for r in range(2) for t in range(4)}
    # Per prefill rank: each sends to 2 decode TP ranks x 2 DCP ranks.
    assert descriptor_counts(plan, 32, by="src") == {(0, 0): 4 * 16384, (0, 1): 4 * 16384}
    # NHD on the decode side: all heads of a token row are adjacent, 2 descriptors per page run.
    d_nhd = HeteroSide(page_size=64, dcp_size=2, tp_size=4, layout="nhd", num_kv_heads=8, head_dim=128)
    plan = build_hetero_plan(p, d_nhd, 0, 256, [range(16)], [range(2), range(2)])
    assert descriptor_counts(plan, 32) == {(r, t): 2 * 2 * 32 for r in range(2) for t in range(4)}


def test_spec_example_dcp1_to_dcp2():
    # spec section 4: P=4, N=2, I=1, src pages [10, 11], dst [30]: rank 0 gets tokens 0, 2, 4, 6.
    plan = build_hetero_plan(HeteroSide(4), HeteroSide(4, dcp_size=2), 0, 8, [[10, 11]], [[30], [30]])
    r0 = plan.dst_dcp == 0
    assert (plan.src_page[r0] * 4 + plan.src_slot[r0]).tolist() == [40, 42, 44, 46]
    assert (plan.dst_page[r0] * 4 + plan.dst_slot[r0]).tolist() == [120, 121, 122, 123]
    assert (plan.src_page[~r0] * 4 + plan.src_slot[~r0]).tolist() == [41, 43, 45, 47]


def test_tp_head_split_and_replication():
    assert [tp_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [tp_head_range(2, 8, r) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4
    gqa = dict(layout="nhd", num_kv_heads=8, head_dim=4)
    # prefill TP 2 (4 heads each) -> decode TP 4 (2 heads each): one piece per decode rank.
    pieces = head_pieces(HeteroSide(16, tp_size=2, **gqa), HeteroSide(16, tp_size=4, **gqa))
    assert pieces.tolist() == [[0, 0, 0, 0, 2], [0, 1, 2, 0, 2], [1, 2, 0, 0, 2], [1, 3, 2, 0, 2]]
    # prefill TP 4 -> decode TP 1: the decode rank gets four pieces, one from each prefill rank.
    pieces = head_pieces(HeteroSide(16, tp_size=4, **gqa), HeteroSide(16, tp_size=1, **gqa))
    assert pieces.tolist() == [[s, 0, 0, 2 * s, 2] for s in range(4)]
    # 2 KV heads replicated over prefill TP 4: only ranks 0 and 2 send.
    two = dict(layout="hnd", num_kv_heads=2, head_dim=4)
    pieces = head_pieces(HeteroSide(16, tp_size=4, **two), HeteroSide(16, tp_size=2, **two))
    assert pieces.tolist() == [[0, 0, 0, 0, 1], [2, 1, 0, 0, 1]]


def test_mla_latent_sent_once_from_the_chosen_rank():
    p, d = HeteroSide(16, tp_size=4), HeteroSide(32, tp_size=2, layout="tpu_mla")
    assert head_pieces(p, d, mla_source_tp_rank=3).tolist() == [[3, 0, 0, 0, 1], [3, 1, 0, 0, 1]]
    plan = build_hetero_plan(p, d, 0, 20, [range(2)], [range(1)], mla_source_tp_rank=3)
    assert set(plan.src_tp.tolist()) == {3} and len(plan) == 40
    with pytest.raises(ValueError, match="mla_source_tp_rank"):
        head_pieces(p, d, mla_source_tp_rank=4)


@pytest.mark.parametrize("field, kw", [("dtype", dict(dtype="float8_e4m3fn")), ("head_dim", dict(head_dim=512)),
                                       ("kind", dict(layout="nhd"))])
def test_mismatch_refused(field, kw):
    with pytest.raises(HeteroPlanError, match=field) as e:
        build_hetero_plan(HeteroSide(16), HeteroSide(16, **kw), 0, 1, [[0]], [[0]])
    assert e.value.field == field


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="one must divide"):
        HeteroSide(16, tp_size=3, layout="nhd", num_kv_heads=8)
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        HeteroSide(16, num_kv_heads=2)
    with pytest.raises(ValueError, match="layout"):
        HeteroSide(16, layout="paged")
    with pytest.raises(ValueError, match="dtype"):
        HeteroSide(16, dtype="float64")
    with pytest.raises(ValueError, match="dcp_size"):
        HeteroSide(16, dcp_size=0)
    with pytest.raises(ValueError, match="page_size=1 must be a multiple of 2"):
        HeteroSide(1, layout="tpu_mla")
    with pytest.raises(ValueError, match=r"dst_page_tables\[1\] has 0 pages, 1 required"):
        build_hetero_plan(HeteroSide(4), HeteroSide(4, dcp_size=2), 0, 8, [[0, 1]], [[0], []])
    with pytest.raises(ValueError, match="src_page_tables must hold one page table per DCP rank"):
        build_hetero_plan(HeteroSide(4, dcp_size=2), HeteroSide(4), 0, 8, [[0]], [[0, 1]])
    with pytest.raises(ValueError, match="stop must be >= start"):
        build_hetero_plan(HeteroSide(4), HeteroSide(4), 5, 4, [[0]], [[0]])
    with pytest.raises(ValueError, match="page ids >= 0"):
        build_hetero_plan(HeteroSide(4), HeteroSide(4), 0, 4, [[-1]], [[0]])
    with pytest.raises(ValueError, match="by must be"):
        descriptor_counts(build_hetero_plan(HeteroSide(4), HeteroSide(4), 0, 0, [[]], [[]]), 1, by="x")


@pytest.mark.parametrize("arg, src, dst, dup, where", [
    ("dst_page_tables[0]", [[0, 1]], [[5, 5]], 5, "[0, 1]"),       # tokens 0-3 and 4-7 into page 5
    ("src_page_tables[1]", [[0], [3, 2, 3]], [[0, 1]], 3, "[0, 2]"),
    ("dst_page_tables[1]", [[0, 1]], [[7], [4, 4]], 4, "[0, 1]"),  # rank 1's table, not rank 0's
])
def test_build_hetero_plan_refuses_repeated_page_ids_like_the_dcp_plans(arg, src, dst, dup, where):
    p = HeteroSide(4, dcp_size=len(src))
    d = HeteroSide(4, dcp_size=len(dst))
    with pytest.raises(ValueError) as e:
        build_hetero_plan(p, d, 0, 8, src, dst)
    assert str(e.value) == f"{arg} holds page id {dup} twice (at {where}); a page table must not repeat pages"
    # The DCP planner words the same table the same way (one check, shared).
    with pytest.raises(ValueError, match="must not repeat pages"):
        build_token_transfer_plan([0, 1], [5, 5], page_size=4, dcp_size=1, dcp_rank=0)


def test_build_hetero_plan_same_page_id_on_two_ranks_is_fine():
    # Page ids are per rank (each rank has its own cache): rank 0 and rank 1 may both use page 5.
    plan = build_hetero_plan(HeteroSide(4), HeteroSide(4, dcp_size=2), 0, 8, [[0, 1]], [[5], [5]])
    assert sorted(zip(plan.token.tolist(), plan.dst_dcp.tolist(), plan.dst_page.tolist(), plan.dst_slot.tolist())) == [
        (t, t % 2, 5, t // 2) for t in range(8)]


# ---------------------------------------------------------------------------- the property


@st.composite
def sides(draw):
    mla = draw(st.booleans())
    dtype = draw(st.sampled_from(("bfloat16", "float8_e4m3fn"))) if mla else "bfloat16"
    heads, head_dim = (1, draw(st.sampled_from((4, 8)))) if mla else (draw(st.integers(1, 8)), 2)

    def side():
        layout = draw(st.sampled_from(("sglang_mla", "tpu_mla") if mla else ("nhd", "hnd", "tpu_gqa")))
        k = (4 if dtype == "float8_e4m3fn" else 2) if layout == "tpu_mla" else 1
        page = draw(st.sampled_from([p for p in PAGE_SIZES if p % k == 0]))
        dcp = draw(st.integers(1, 16))
        inter = draw(st.sampled_from((1, 2, 3, page)))
        tps = [t for t in range(1, 9) if mla or heads % t == 0 or t % heads == 0]
        return HeteroSide(page, dcp, inter, draw(st.sampled_from(tps)), layout, heads, head_dim, dtype)

    return side(), side()


def _caches(rng, side: HeteroSide, stop: int, num_layers: int, fill: bool):
    """Random page tables (a permutation with a spare page) and caches per rank: ``fill`` gives
    each element a distinct value (a ramp from a random offset, cheap for large caches), else 0."""
    tables, caches = [], {}
    for r in range(side.dcp_size):
        j = (stop // (side.interleave_size * side.dcp_size)) * side.interleave_size + min(
            max(stop % (side.interleave_size * side.dcp_size) - r * side.interleave_size, 0), side.interleave_size)
        need = -(-j // side.page_size)
        num_pages = need + 1
        tables.append(rng.permutation(num_pages)[:need])
        for t in range(side.tp_size):
            shape = cache_shape(side.geometry(t, num_pages))
            dtype = np.uint16 if side.dtype == "bfloat16" else np.uint8
            size = int(np.prod(shape))
            caches[(r, t)] = [((np.arange(size, dtype=np.int64) + int(rng.integers(1 << 16))) % (np.iinfo(dtype).max - 4))
                              .astype(dtype).reshape(shape) if fill else np.zeros(shape, dtype) for _ in range(num_layers)]
    return tables, caches


def _tables_only(rng, side: HeteroSide, stop: int):
    tables = []
    for r in range(side.dcp_size):
        need = -(-int(local_len_np(stop, side.dcp_size, r, side.interleave_size)) // side.page_size)
        tables.append(rng.permutation(need + 1)[:need])
    return tables


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pair=sides(), start=st.integers(0, 300), length=st.integers(0, 40), seed=st.integers(0, 2**32 - 1),
       mla_src=st.integers(0, 7))
def test_plan_rows_equal_per_token_reference(pair, start, length, seed, mla_src):
    """Plan only, 2,000 pairs: every (token, head, decode TP rank) planned exactly once, where
    the brute-force per-token reference puts it."""
    p, d = pair
    rng = np.random.default_rng(seed)
    src_tables, dst_tables = _tables_only(rng, p, start + length), _tables_only(rng, d, start + length)
    mla_src %= p.tp_size
    plan = build_hetero_plan(p, d, start, start + length, src_tables, dst_tables, mla_source_tp_rank=mla_src)
    n = plan.num_heads
    k = np.concatenate([np.arange(x) for x in n.tolist()]) if len(plan) else np.zeros(0, np.int64)
    rows = [np.repeat(getattr(plan, f), n) for f in ("token", "src_dcp", "src_tp", "src_page", "src_slot")]
    rows += [np.repeat(plan.src_head, n) + k]
    rows += [np.repeat(getattr(plan, f), n) for f in ("dst_dcp", "dst_tp", "dst_page", "dst_slot")]
    rows += [np.repeat(plan.dst_head, n) + k]
    got = sorted(map(tuple, np.stack(rows, axis=1).tolist())) if len(plan) else []
    assert got == reference_rows(p, d, start, start + length, src_tables, dst_tables, mla_src)
    # Runs tile the plan in order, and never cross a page of either side.
    runs = plan.runs()
    assert runs[:, 1].sum() == len(plan) and (np.diff(runs[:, 0]) == runs[:-1, 1]).all()
    assert (plan.src_slot[runs[:, 0]] + runs[:, 1] <= p.page_size).all()
    assert (plan.dst_slot[runs[:, 0]] + runs[:, 1] <= d.page_size).all()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pair=sides(), start=st.integers(0, 40), length=st.integers(0, 24), num_layers=st.integers(1, 2),
       seed=st.integers(0, 2**32 - 1), mla_src=st.integers(0, 7))
def test_plan_mover_equals_per_token_reference(pair, start, length, num_layers, seed, mla_src):
    """Byte-exact, 200 pairs: the plan run by `execute_plan` lands what the per-token mover lands."""
    p, d = pair
    rng = np.random.default_rng(seed)
    stop = start + length
    src_tables, src = _caches(rng, p, stop, num_layers, True)
    dst_tables, dst = _caches(rng, d, stop, num_layers, False)
    ref = {k: [a.copy() for a in v] for k, v in dst.items()}
    mla_src %= p.tp_size
    plan = build_hetero_plan(p, d, start, stop, src_tables, dst_tables, mla_source_tp_rank=mla_src)
    moved = execute_plan(plan, src, dst, num_layers)
    reference_move(p, d, start, stop, src_tables, dst_tables, src, ref, num_layers, mla_source_tp_rank=mla_src)
    bad = [k for k in dst if not all(np.array_equal(a, b) for a, b in zip(dst[k], ref[k]))]
    assert not bad, f"decode ranks {bad} differ from the per-token reference"
    # Every decode TP rank gets every token of the range with all of its heads, once.
    held = sum(d.heads(t)[1] for t in range(d.tp_size))
    assert int(plan.num_heads.sum()) == length * held
    item = p.head_dim * (2 if p.dtype == "bfloat16" else 1) * (1 if p.kind == "mla" else 2)
    assert moved == length * held * item * num_layers
    counts = descriptor_counts(plan, num_layers)
    assert sum(counts.values()) == sum(descriptor_counts(plan, num_layers, by="src").values())
    assert sum(descriptor_counts(plan, num_layers, cross_layer=True).values()) <= sum(counts.values())


@settings(max_examples=100, deadline=None)
@given(m=st.integers(1, 8), n=st.integers(1, 8), ip=st.sampled_from((1, 2, 16)), i=st.sampled_from((1, 3, 16)),
       pp=st.sampled_from(PAGE_SIZES), pd=st.sampled_from(PAGE_SIZES), length=st.integers(0, 300),
       seed=st.integers(0, 2**32 - 1))
def test_homogeneous_tp_matches_the_mxn_plan(m, n, ip, i, pp, pd, length, seed):
    """TP 1, MLA: the rows equal `dcp_jax.plan.build_mxn_transfer_plans` (the connector's plan)."""
    p, d = HeteroSide(pp, m, ip), HeteroSide(pd, n, i)
    rng = np.random.default_rng(seed)
    src_tables, dst_tables = _tables_only(rng, p, length), _tables_only(rng, d, length)
    plan = build_hetero_plan(p, d, 0, length, src_tables, dst_tables)
    mxn = build_mxn_transfer_plans(src_tables, dst_tables, page_size=pd, prefill_page_size=pp, prefill_dcp_size=m,
                                   dcp_size=n, num_kv_tokens=length, prefill_interleave_size=ip, interleave_size=i)
    groups = plan.groups()
    assert sorted((k[0], k[2]) for k, _ in groups) == sorted(mxn)
    for (sd, _, dd, _, _, _, _), rows in groups:
        assert (plan.src_page[rows] * pp + plan.src_slot[rows]).tolist() == mxn[(sd, dd)].src_token_indices.tolist()
        assert (plan.dst_page[rows] * pd + plan.dst_slot[rows]).tolist() == mxn[(sd, dd)].dst_token_indices.tolist()


def test_build_hetero_plan_huge_stop_fails_on_the_tables_before_allocating():
    # stop = 2**40 tokens: the tables cover 8, so the check names stop before any per-token array
    # (2**40 int64 rows) is made; tracemalloc sees no large allocation on the way.
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"src_page_tables\[0\] has 2 pages, \d+ required for tokens up to "
                                             r"stop=1099511627776"):
            build_hetero_plan(HeteroSide(4), HeteroSide(4), 0, 2**40, [[0, 1]], [[0, 1]])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
