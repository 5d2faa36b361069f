"""Argument checks of the planning layer: the exception type, and a message that names the
argument and the value given (fresh-user trial findings)."""

import numpy as np
import pytest

from dcp_jax import layout
from dcp_jax.plan import build_descriptors, build_token_transfer_plan

# --------------------------------------------------------------------------------------------
# Values past int64.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["src_pages", "dst_pages"])
def test_uint64_page_id_past_int64_is_reported_as_given(arg):
    pages = {"src_pages": [0], "dst_pages": [0]}
    pages[arg] = np.array([2**63], np.uint64)  # int64 would read it as -2**63
    with pytest.raises(ValueError) as e:
        build_token_transfer_plan(pages["src_pages"], pages["dst_pages"], page_size=4, dcp_size=2, dcp_rank=0)
    assert f"{arg}[0]=9223372036854775808" in str(e.value)
    assert "-9223372036854775808" not in str(e.value)


def test_uint64_page_ids_within_int64_still_plan():
    got = build_token_transfer_plan(np.array([2], np.uint64), np.array([3], np.uint64),
                                    page_size=4, dcp_size=2, dcp_rank=0)
    assert got.src_token_indices.tolist() == [8, 10] and got.dst_token_indices.tolist() == [12, 13]


@pytest.mark.parametrize("fn", [layout.local_len_np, layout.count_np])
def test_numpy_twins_refuse_interleave_times_dcp_past_int64(fn):
    args = (5, 2**40, 0, 2**40) if fn is layout.local_len_np else (0, 5, 2**40, 0, 2**40)
    with pytest.raises(ValueError) as e:  # was numpy's bare OverflowError
        fn(*args)
    msg = str(e.value)
    assert "dcp_size=1099511627776" in msg and "interleave_size=1099511627776" in msg and str(2**80) in msg


@pytest.mark.parametrize("fn", [layout.owner_np, layout.local_index_np])
def test_position_twins_refuse_interleave_times_dcp_past_int64(fn):
    with pytest.raises(ValueError, match="does not fit int64"):
        fn(5, 2**40, 2**40)


def test_numpy_twins_at_the_int64_edge_still_compute():
    n, i = 2, 2**62 - 1  # I * N = 2**63 - 2: rank 0 holds [0, I), rank 1 [I, 2I)
    assert layout.local_len_np(np.array([5, 2**62]), n, 0, i).tolist() == [5, 2**62 - 1]
    assert layout.local_len_np(np.array([5, 2**62]), n, 1, i).tolist() == [0, 1]


# --------------------------------------------------------------------------------------------
# build_descriptors: runs and addresses.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runs, src_bases, dst_bases, item_lens, want", [
    ([[2**61, 0, 1]], [0], [0], [16], ["runs[0]=[2305843009213693952, 0, 1]", "src_bases[0]=0", "item_lens[0]=16",
                                       f"ends at byte {(2**61 + 1) * 16}"]),  # wrapped to address 0
    ([[1, 0, 1]], [2**63 - 8], [0], [16], ["src_bases[0]=9223372036854775800", f"ends at byte {2**63 - 8 + 32}"]),
    ([[0, 0, 1], [3, 2**59, 2]], [0, 0], [0, 2**63 - 40], [1, 16],
     ["runs[1]=[3, 576460752303423488, 2]", "dst_bases[1]=9223372036854775768", "item_lens[1]=16"]),
    ([[2**63 - 1, 0, 1]], [0], [0], [1], ["runs[0]=[9223372036854775807, 0, 1]", "past int64"]),
    ([[0, -1, 2]], [0], [0], [4], ["dst_start >= 0", "runs[0]=[0, -1, 2]"]),
    ([[5, 0, 1], [-2, 9, 1]], [0], [0], [4], ["src_start >= 0", "runs[1]=[-2, 9, 1]"]),
    ([[0, 0, 3], [0, 1, 0]], [0], [0], [4], ["length >= 1", "runs[1]=[0, 1, 0]"]),
    ([[0, 0, 1]], [0, 0], [5, -3], [4, 4], ["dst_bases[1]=-3"]),
    (np.array([[2**63, 0, 1]], np.uint64), [0], [0], [1], ["runs[0, 0]=9223372036854775808"]),
    # one item_lens value broadcasts: the count reported is the one given, not the broadcast one
    ([[0, 0, 1]], [0, 0, 0], [0, 0], [4], ["got 3, 2, 1"]),
    ([[0, 0, 1]], [0, 0], [0, 0], [4, 4, 4], ["got 2, 2, 3"]),
])
def test_build_descriptors_refuses_bad_runs_naming_them(runs, src_bases, dst_bases, item_lens, want):
    with pytest.raises(ValueError) as e:
        build_descriptors(runs, src_bases, dst_bases, item_lens)
    for part in want:
        assert part in str(e.value), (part, str(e.value))


def test_build_descriptors_up_to_the_int64_edge_is_exact():
    top = 2**63 - 1
    start = 2**58
    base = top - (start + 1) * 16  # base + (start + 1) * 16 == 2**63 - 1 exactly: fits
    got = build_descriptors([[start, 2**40, 1]], [base], [2**62], [16])
    assert got.tolist() == [[base + start * 16, 2**62 + 2**44, 16]]
    assert int(got[0, 0]) + int(got[0, 2]) == top
    with pytest.raises(ValueError, match="past int64"):  # one byte further does not
        build_descriptors([[start, 2**40, 1]], [base + 1], [2**62], [16])
    # The slow path (bases near the limit) accepts what fits and computes the same values.
    runs = np.array([[0, 0, 1], [10, 20, 3]])
    got = build_descriptors(runs, [2**63 - 1 - 13 * 8], [2**63 - 1 - 23 * 8], [8])
    assert got.tolist() == [[2**63 - 1 - 104, 2**63 - 1 - 184, 8], [2**63 - 1 - 24, 2**63 - 1 - 24, 24]]
