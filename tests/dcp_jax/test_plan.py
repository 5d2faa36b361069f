"""DCP1 -> DCP-N plans (spec section 4), runs and descriptors (section 5), windows, virtual pages."""

import math
import time

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.plan import (
    TokenTransferPlan,
    build_descriptors,
    build_packed_descriptors,
    build_token_transfer_plan,
    group_runs,
    packed_src_bases,
    prefix_alignment,
    rows_from_page_table,
    sglang_virtual_dst_pages,
    split_windows,
    virtual_page_rows,
)

# --------------------------------------------------------------------------------------------
# Spec public examples (P=4, N=2, I=1).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, rank, want_src, want_dst",
    [
        ([10, 11], [30], 0, [40, 42, 44, 46], [120, 121, 122, 123]),
        ([10, 11], [30], 1, [41, 43, 45, 47], [120, 121, 122, 123]),
        (
            [10, 11, 12, 13],
            [30, 47],
            1,
            [41, 43, 45, 47, 49, 51, 53, 55],
            [120, 121, 122, 123, 188, 189, 190, 191],
        ),
    ],
)
def test_spec_examples(src, dst, rank, want_src, want_dst):
    for as_array in (list, np.array, jnp.array):
        plan = build_token_transfer_plan(as_array(src), as_array(dst), page_size=4, dcp_size=2, dcp_rank=rank)
        assert plan.src_token_indices.dtype == np.int64
        assert plan.dst_token_indices.dtype == np.int64
        assert plan.src_token_indices.tolist() == want_src
        assert plan.dst_token_indices.tolist() == want_dst
        assert plan.dst_rank == rank and plan.src_rank == 0


def test_hand_computed_prefix_offset_partial_page_block_rr():
    # P=4, N=2, I=2, prefix 8 (lcm(8, 4) = 8): decode holds tokens 0..7 (4 per rank).
    # Chunk at src_page_offset=1 -> chunk_start = 8 + 4 = 12, 6 valid tokens: 12..17.
    # owner = (t // 2) % 2: 12,13 -> 0; 14,15 -> 1; 16,17 -> 0.
    # rank 0: offsets 0,1,4,5; local_index(12)=6, base=local_len(8,0)=4 -> j=2,3,4,5.
    plan = build_token_transfer_plan(
        [7, 3], [9, 5], page_size=4, dcp_size=2, dcp_rank=0, interleave_size=2,
        src_page_offset=1, decode_prefix_len=8, num_kv_tokens=6,
    )
    assert plan.src_token_indices.tolist() == [28, 29, 12, 13]
    assert plan.dst_token_indices.tolist() == [38, 39, 20, 21]
    plan1 = build_token_transfer_plan(
        [7, 3], [9], page_size=4, dcp_size=2, dcp_rank=1, interleave_size=2,
        src_page_offset=1, decode_prefix_len=8, num_kv_tokens=6,
    )
    # rank 1: tokens 14, 15 -> offsets 2, 3; local_index(14)=6, base 4 -> j = 2, 3.
    assert plan1.src_token_indices.tolist() == [30, 31]
    assert plan1.dst_token_indices.tolist() == [38, 39]


def test_empty_chunk_gives_two_empty_arrays():
    for kwargs in (dict(src_pages=[], dst_pages=[]), dict(src_pages=[3, 4], dst_pages=[], num_kv_tokens=0)):
        plan = build_token_transfer_plan(**kwargs, page_size=4, dcp_size=2, dcp_rank=1)
        assert plan.src_token_indices.shape == (0,) and plan.dst_token_indices.shape == (0,)
        assert plan.src_token_indices.dtype == np.int64 == plan.dst_token_indices.dtype
        assert plan.runs.shape == (0, 3)
        assert split_windows(plan, 4) == []
    # A rank that owns nothing of a short chunk also gets empty arrays.
    plan = build_token_transfer_plan([5], [], page_size=4, dcp_size=8, dcp_rank=7, num_kv_tokens=3)
    assert plan.num_rows == 0


def test_partial_last_page_only_valid_tokens():
    plan = build_token_transfer_plan([2, 9], [4], page_size=4, dcp_size=2, dcp_rank=0, num_kv_tokens=5)
    assert plan.src_token_indices.tolist() == [8, 10, 36]
    assert plan.dst_token_indices.tolist() == [16, 17, 18]


# --------------------------------------------------------------------------------------------
# Errors of spec section 4, each naming its argument.
# --------------------------------------------------------------------------------------------

BASE = dict(src_pages=[1, 2], dst_pages=[3, 4], page_size=4, dcp_size=2, dcp_rank=0)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(decode_prefix_len=4), r"decode_prefix_len.*multiple of .* = 8"),
        (dict(decode_prefix_len=8, interleave_size=8), r"decode_prefix_len.*= 16 tokens"),
        (dict(num_kv_tokens=-1), "num_kv_tokens"),
        (dict(num_kv_tokens=9), r"num_kv_tokens must be <= .* = 8"),
        (dict(dst_pages=[]), r"dst_pages.*1 page .* is required"),
        (dict(src_pages=[1, 2, 3, 4, 5], dst_pages=[1, 2]), r"dst_pages: 3 pages .* required"),
        (dict(src_pages=[1, -2]), r"src_pages.*src_pages\[1\]=-2"),
        (dict(dst_pages=[-3, 4]), r"dst_pages"),
        (dict(dst_pages=[30, 30]), r"dst_pages holds page id 30 twice"),
        (dict(src_pages=[7, 1, 7]), r"src_pages holds page id 7 twice"),
        (dict(src_pages=[2**62, 1]), r"src_pages .* overflow int64 with page_size=4"),
        (dict(page_size=0), "page_size"),
        (dict(dcp_size=0), "dcp_size"),
        (dict(dcp_rank=2), "dcp_rank"),
        (dict(interleave_size=0), "interleave_size"),
        (dict(src_page_offset=-1), "src_page_offset"),
        (dict(decode_prefix_len=-8), "decode_prefix_len"),
    ],
)
def test_errors_name_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        build_token_transfer_plan(**{**BASE, **change})


def test_type_errors():
    with pytest.raises(TypeError, match="src_pages"):
        build_token_transfer_plan(**{**BASE, "src_pages": [1.5, 2.0]})
    with pytest.raises(TypeError, match="page_size"):
        build_token_transfer_plan(**{**BASE, "page_size": 4.0})


def test_prefix_alignment_is_lcm():
    assert prefix_alignment(64, 8, 1) == 512
    assert prefix_alignment(64, 8, 128) == 1024
    assert prefix_alignment(4, 2, 6) == math.lcm(8, 12)


# --------------------------------------------------------------------------------------------
# Brute-force reference for the DCP1 API.
# --------------------------------------------------------------------------------------------


def dcp1_reference(src_pages, dst_pages, P, N, r, I, off, prefix, n):
    """Loop over tokens: owner by definition, decode-local index by counting from the prefix."""
    src_rows, dst_rows = [], []
    chunk_start = prefix + off * P
    j = 0
    for t in range(prefix, chunk_start + n):
        if (t // I) % N != r:
            continue
        if t >= chunk_start:
            o = t - chunk_start
            src_rows.append(src_pages[o // P] * P + o % P)
            dst_rows.append(dst_pages[j // P] * P + j % P)
        j += 1
    return src_rows, dst_rows


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    n_ranks=st.integers(1, 8),
    page_size=st.integers(1, 128),
    i_choice=st.sampled_from(["1", "2", "4", "page", "2page"]),
    prefix_mult=st.integers(0, 2),
    off=st.integers(0, 4),
    n_src_pages=st.integers(0, 6),
    trim=st.integers(0, 127),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_dcp1_matches_brute_force(n_ranks, page_size, i_choice, prefix_mult, off, n_src_pages, trim, seed, data):
    P, N = page_size, n_ranks
    I = {"1": 1, "2": 2, "4": 4, "page": P, "2page": 2 * P}[i_choice]
    prefix = prefix_mult * prefix_alignment(P, N, I)
    n = max(0, n_src_pages * P - min(trim, P - 1))  # partial last page
    rank = data.draw(st.integers(0, N - 1))
    rng = np.random.default_rng(seed)
    src_pages = rng.permutation(4 * n_src_pages + 8)[:n_src_pages]
    need = -(-sum(1 for t in range(prefix, prefix + off * P + n) if (t // I) % N == rank) // P)
    dst_pages = rng.permutation(4 * need + 8)[:need]
    plan = build_token_transfer_plan(
        src_pages, dst_pages, page_size=P, dcp_size=N, dcp_rank=rank, interleave_size=I,
        src_page_offset=off, decode_prefix_len=prefix, num_kv_tokens=n,
    )
    want_src, want_dst = dcp1_reference(src_pages.tolist(), dst_pages.tolist(), P, N, rank, I, off, prefix, n)
    assert plan.src_token_indices.tolist() == want_src
    assert plan.dst_token_indices.tolist() == want_dst


def test_plan_32k_tokens_8_ranks_is_fast():
    rng = np.random.default_rng(0)
    src = rng.permutation(1 << 14)[:512]
    dst = [rng.permutation(1 << 14)[:64] for _ in range(8)]
    t0 = time.perf_counter()
    plans = [
        build_token_transfer_plan(src, dst[r], page_size=64, dcp_size=8, dcp_rank=r) for r in range(8)
    ]
    elapsed = time.perf_counter() - t0
    assert [p.num_rows for p in plans] == [4096] * 8
    assert [p.runs.shape[0] for p in plans] == [4096] * 8  # strided source: one run per token
    assert plans[3].num_descriptors(61) == 249_856
    print(f"32k tokens x 8 ranks planned in {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0  # milliseconds in practice; generous bound for a shared 2-core box


# --------------------------------------------------------------------------------------------
# Runs.
# --------------------------------------------------------------------------------------------


def runs_reference(src, dst):
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def test_group_runs_hand_computed():
    assert group_runs([0, 1, 2, 5, 6], [10, 11, 20, 21, 22]).tolist() == [[0, 10, 2], [2, 20, 1], [5, 21, 2]]
    assert group_runs([], []).shape == (0, 3)
    assert group_runs([7], [3]).tolist() == [[7, 3, 1]]
    # Descending steps break runs even when contiguous in the other direction.
    assert group_runs([3, 2, 1], [0, 1, 2]).tolist() == [[3, 0, 1], [2, 1, 1], [1, 2, 1]]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=60), st.integers(0, 2**31))
def test_group_runs_matches_reference(steps, seed):
    rng = np.random.default_rng(seed)
    src = np.cumsum([0] + [s for s, _ in steps]) + rng.integers(0, 100)
    dst = np.cumsum([0] + [d for _, d in steps]) + rng.integers(0, 100)
    runs = group_runs(src, dst)
    assert runs.dtype == np.int64
    assert runs.tolist() == runs_reference(src.tolist(), dst.tolist())
    assert runs[:, 2].sum() == src.size


def test_group_runs_errors():
    with pytest.raises(ValueError, match="equal length"):
        group_runs([1, 2], [1])
    with pytest.raises(TypeError, match="src_indices"):
        group_runs([1.0], [1])
    with pytest.raises(ValueError, match=r"src_indices\[0\]=-2"):
        group_runs([-2, -1], [5, 6])
    with pytest.raises(ValueError, match="dst_indices"):
        group_runs([0, 1], [3, -1])


# --------------------------------------------------------------------------------------------
# Descriptors.
# --------------------------------------------------------------------------------------------


def test_build_descriptors_hand_computed_layer_major():
    runs = np.array([[0, 10, 2], [5, 20, 1]])
    descs = build_descriptors(runs, src_bases=[1000, 5000], dst_bases=[2000, 9000], item_lens=[8, 3])
    assert descs.dtype == np.int64
    assert descs.tolist() == [
        [1000, 2080, 16],
        [1040, 2160, 8],
        [5000, 9030, 6],
        [5015, 9060, 3],
    ]
    # A single item_len broadcasts over entries.
    same = build_descriptors(runs, [0, 100], [0, 100], 4)
    assert same[:, 2].tolist() == [8, 4, 8, 4]


def test_build_descriptors_errors():
    runs = np.array([[0, 0, 1]])
    with pytest.raises(ValueError, match="runs"):
        build_descriptors(np.array([[0, 1]]), [0], [0], [1])
    with pytest.raises(ValueError, match="one entry per layer"):
        build_descriptors(runs, [0, 1], [0], [4, 4])
    with pytest.raises(ValueError, match="item_lens"):
        build_descriptors(runs, [0], [0], [0])
    with pytest.raises(ValueError, match="bases"):
        build_descriptors(runs, [-1], [0], [4])


def test_packed_descriptors_stay_in_region_and_match_dst_rows():
    rng = np.random.default_rng(5)
    item_lens = np.array([1152, 576, 1152])
    plan = build_token_transfer_plan(
        rng.permutation(200)[:16], rng.permutation(300)[:3], page_size=16, dcp_size=8, dcp_rank=2,
    )
    region_addr = 1 << 20
    bases = packed_src_bases(region_addr, plan.num_rows, item_lens)
    assert bases.tolist() == [region_addr, region_addr + 32 * 1152, region_addr + 32 * 1152 + 32 * 576]
    dst_bases = np.array([10, 20, 30]) << 24
    descs = build_packed_descriptors(plan, region_addr, dst_bases, item_lens).reshape(3, -1, 3)
    region_end = region_addr + plan.num_rows * item_lens.sum()
    assert (descs[:, :, 0] >= region_addr).all() and (descs[:, :, 0] + descs[:, :, 2] <= region_end).all()
    for l in range(3):
        # Each layer's pack is contiguous: the runs tile [off_l, off_l + n*item_len).
        assert descs[l, 0, 0] == bases[l] and descs[l, :, 2].sum() == plan.num_rows * item_lens[l]
        rows = np.concatenate(
            [np.arange(d0, d0 + n) for d0, n in zip((descs[l, :, 1] - dst_bases[l]) // item_lens[l],
                                                    descs[l, :, 2] // item_lens[l])]
        )
        np.testing.assert_array_equal(rows, plan.dst_token_indices)
    assert descs.shape[1] <= 3  # three destination pages, shuffled


# --------------------------------------------------------------------------------------------
# The plan object and windows.
# --------------------------------------------------------------------------------------------


def test_plan_object_is_frozen_and_readonly():
    src = np.array([4, 5, 9])
    plan = TokenTransferPlan(src, [1, 2, 3], src_rank=1, dst_rank=2)
    src[0] = 99  # the plan owns its copy
    assert plan.src_token_indices.tolist() == [4, 5, 9]
    with pytest.raises(ValueError):
        plan.src_token_indices[0] = 7
    with pytest.raises(AttributeError):
        plan.dst_rank = 3
    assert plan.runs.tolist() == [[4, 1, 2], [9, 3, 1]]
    assert plan.packed_runs.tolist() == [[0, 1, 3]]
    assert plan.num_descriptors(61) == 122 and plan.num_descriptors(61, packed=True) == 61
    assert repr(plan) == "TokenTransferPlan(src_rank=1, dst_rank=2, rows=3, runs=2, packed_runs=1)"
    with pytest.raises(ValueError, match="equal length"):
        TokenTransferPlan([1, 2], [3])
    # Before: taken, and repr() or num_descriptors() raised later naming "src_indices".
    with pytest.raises(ValueError, match=r"^src_token_indices must hold rows >= 0, got src_token_indices\[1\]=-1"):
        TokenTransferPlan([0, -1], [2, 3])
    with pytest.raises(ValueError, match=r"^dst_token_indices must hold rows >= 0"):
        TokenTransferPlan([0, 1], [-2, 3])


def test_split_windows():
    rng = np.random.default_rng(2)
    plan = TokenTransferPlan(rng.permutation(50), rng.permutation(50), 0, 3)
    wins = split_windows(plan, 16)
    assert [w.num_rows for w in wins] == [16, 16, 16, 2]
    assert all(w.dst_rank == 3 for w in wins)
    np.testing.assert_array_equal(np.concatenate([w.src_token_indices for w in wins]), plan.src_token_indices)
    np.testing.assert_array_equal(np.concatenate([w.dst_token_indices for w in wins]), plan.dst_token_indices)
    assert [w.num_rows for w in split_windows(plan, None)] == [50]
    assert [w.num_rows for w in split_windows(plan, 50)] == [50]
    pairs = split_windows((np.arange(5), np.arange(5) + 7), 2)
    assert [(s.tolist(), d.tolist()) for s, d in pairs] == [([0, 1], [7, 8]), ([2, 3], [9, 10]), ([4], [11])]
    with pytest.raises(ValueError, match="max_batch_indices"):
        split_windows(plan, 0)
    with pytest.raises(ValueError, match="equal length"):
        split_windows(([1, 2], [1]), 4)


# --------------------------------------------------------------------------------------------
# sglang's virtual pages and general page tables (spec section 3).
# --------------------------------------------------------------------------------------------


def test_virtual_page_rows_spec_text():
    # I = 1: virtual slot q*P*N + i -> rank i % N, physical row q*P + i // N.
    P, N = 4, 3
    q = np.repeat([0, 5, 11], P * N)
    i = np.tile(np.arange(P * N), 3)
    ranks, rows = virtual_page_rows(q * P * N + i, page_size=P, dcp_size=N)
    np.testing.assert_array_equal(ranks, i % N)
    np.testing.assert_array_equal(rows, q * P + i // N)


@pytest.mark.parametrize("P, N, I", [(4, 2, 1), (8, 4, 2), (16, 8, 16), (6, 3, 3)])
def test_sglang_virtual_pages_agree_with_plans(P, N, I):
    rng = np.random.default_rng(P * N + I)
    prefix = P * N  # one virtual page already held by decode
    total = prefix + 5 * P * N - 3  # partial last virtual page
    vtable = rng.permutation(100)[: -(-total // (P * N))]
    src_pages = rng.permutation(100)[: -(-(total - prefix) // P)] + 200
    for r in range(N):
        dst = sglang_virtual_dst_pages(vtable, page_size=P, dcp_size=N, dcp_rank=r, interleave_size=I,
                                       decode_prefix_len=prefix)
        np.testing.assert_array_equal(dst, vtable[1:])
        plan = build_token_transfer_plan(
            src_pages, dst, page_size=P, dcp_size=N, dcp_rank=r, interleave_size=I,
            decode_prefix_len=prefix, num_kv_tokens=total - prefix,
        )
        t = np.arange(prefix, total)
        slots = vtable[t // (P * N)] * P * N + t % (P * N)
        ranks, rows = virtual_page_rows(slots, page_size=P, dcp_size=N, interleave_size=I)
        np.testing.assert_array_equal(plan.dst_token_indices, rows[ranks == r])
        np.testing.assert_array_equal(ranks, (t // I) % N)


def test_virtual_page_errors():
    with pytest.raises(ValueError, match="interleave_size"):
        virtual_page_rows([1], page_size=4, dcp_size=2, interleave_size=3)
    with pytest.raises(ValueError, match="virtual_slots"):
        virtual_page_rows([-1], page_size=4, dcp_size=2)
    with pytest.raises(ValueError, match="decode_prefix_len"):
        sglang_virtual_dst_pages([1, 2], page_size=4, dcp_size=2, dcp_rank=0, decode_prefix_len=4)
    with pytest.raises(ValueError, match="virtual_pages"):
        sglang_virtual_dst_pages([1, -2], page_size=4, dcp_size=2, dcp_rank=0)
    with pytest.raises(ValueError, match="dcp_rank"):
        sglang_virtual_dst_pages([1], page_size=4, dcp_size=2, dcp_rank=2)


def test_rows_from_page_table():
    assert rows_from_page_table([0, 3, 4, 9], [7, 2, 5], 4).tolist() == [28, 31, 8, 21]
    with pytest.raises(ValueError, match="3 pages"):
        rows_from_page_table([9], [7, 2], 4)
    # validated=True (a table checked once by the caller): same rows, only the length checked.
    assert rows_from_page_table([0, 3, 4, 9], [7, 2, 5], 4, validated=True).tolist() == [28, 31, 8, 21]
    with pytest.raises(ValueError, match="3 pages"):
        rows_from_page_table([9], [7, 2], 4, validated=True)
    with pytest.raises(ValueError, match="page id 2 twice"):
        rows_from_page_table([0], [2, 2], 4)


def test_send_rows_per_rank():
    from dcp_jax.plan import send_rows_per_rank

    # N=2, I=4: local_len(9) = [5, 4], local_len(0) = [0, 0].
    assert send_rows_per_rank(9, dcp_size=2, interleave_size=4) == [5, 4]
    # Prefix 16 (aligned): each rank already holds 8.
    assert send_rows_per_rank(25, dcp_size=2, interleave_size=4, decode_prefix_len=16) == [5, 4]
    assert sum(send_rows_per_rank(1001, dcp_size=7, interleave_size=3, decode_prefix_len=42)) == 959
    with pytest.raises(ValueError, match="decode_prefix_len"):
        send_rows_per_rank(8, dcp_size=2, decode_prefix_len=16)
    with pytest.raises(ValueError, match="total_tokens"):
        send_rows_per_rank(-1, dcp_size=2)
