"""Ownership functions: spec examples, JAX/numpy agreement, section-2 invariants, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax import layout
from dcp_jax.layout import (
    count,
    count_np,
    local_index,
    local_index_np,
    local_len,
    local_len_np,
    owner,
    owner_np,
)

# Spec section 2, public examples: local_len per L as [rank0, rank1].
SPEC_N2_I1 = {1: [1, 0], 2: [1, 1], 128: [64, 64], 129: [65, 64], 256: [128, 128], 257: [129, 128]}
SPEC_N2_I4 = {1: [1, 0], 4: [4, 0], 5: [4, 1], 8: [4, 4], 9: [5, 4]}


@pytest.mark.parametrize(
    "interleave_size, table", [(1, SPEC_N2_I1), (4, SPEC_N2_I4)], ids=lambda p: f"I={p}" if isinstance(p, int) else ""
)
def test_spec_local_len_examples(interleave_size, table):
    for length, expected in table.items():
        got_jax = [int(local_len(length, 2, r, interleave_size)) for r in range(2)]
        got_np = [int(local_len_np(length, 2, r, interleave_size)) for r in range(2)]
        assert got_jax == expected, length
        assert got_np == expected, length
    # Vectorised over lengths in one call.
    lengths = np.array(list(table))
    for r in range(2):
        np.testing.assert_array_equal(
            np.asarray(local_len(lengths, 2, r, interleave_size)), [v[r] for v in table.values()]
        )


def test_hand_computed_owner_and_local_index():
    t = np.arange(12)
    # N=3, I=2: blocks [0,1]->0 [2,3]->1 [4,5]->2 [6,7]->0 ...
    assert owner_np(t, 3, 2).tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    assert local_index_np(t, 3, 2).tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    assert np.asarray(owner(t, 3, 2)).tolist() == owner_np(t, 3, 2).tolist()
    assert np.asarray(local_index(t, 3, 2)).tolist() == local_index_np(t, 3, 2).tolist()
    # count(3, 5): tokens 3..7 with N=2, I=1 -> rank 0 holds 4, 6; rank 1 holds 3, 5, 7.
    assert [int(count(3, 5, 2, r)) for r in range(2)] == [2, 3]


def test_python_ints_return_scalars():
    assert int(owner(7, 4)) == 3
    assert int(local_index(7, 4)) == 1
    assert owner(7, 4).shape == ()
    assert int(count(0, 10, 4, 1, 2)) == int(local_len(10, 4, 1, 2))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize(
    "n, i", [(1, 1), (2, 1), (3, 2), (8, 1), (8, 4), (5, 64), (7, 3), (8, 128)], ids=lambda v: str(v)
)
def test_jax_matches_numpy(n, i, dtype):
    rng = np.random.default_rng(n * 1000 + i)
    t = rng.integers(0, 1 << 20, size=513).astype(dtype)
    np.testing.assert_array_equal(np.asarray(owner(t, n, i)), owner_np(t, n, i))
    np.testing.assert_array_equal(np.asarray(local_index(t, n, i)), local_index_np(t, n, i))
    np.testing.assert_array_equal(np.asarray(owner(jnp.asarray(t), n, i)), owner_np(t, n, i))
    starts = rng.integers(0, 1 << 19, size=513).astype(dtype)
    for r in {0, n - 1, n // 2}:
        np.testing.assert_array_equal(np.asarray(local_len(t, n, r, i)), local_len_np(t, n, r, i))
        np.testing.assert_array_equal(np.asarray(count(starts, t, n, r, i)), count_np(starts, t, n, r, i))


def test_token_round_robin_closed_forms():
    t = np.arange(1000)
    for n in range(1, 9):
        np.testing.assert_array_equal(owner_np(t, n), t % n)
        np.testing.assert_array_equal(local_index_np(t, n), t // n)
        for r in range(n):
            np.testing.assert_array_equal(local_len_np(t, n, r), t // n + (r < t % n))


def test_local_len_vectorised_over_ranks():
    ranks = np.arange(8)
    got = local_len_np(1000, 8, ranks, 4)
    assert got.tolist() == [int(local_len_np(1000, 8, r, 4)) for r in range(8)]
    assert int(got.sum()) == 1000


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 8),
    i=st.sampled_from([1, 2, 3, 4, 16, 64, 128]),
    length=st.integers(0, 3000),
    start=st.integers(0, 3000),
)
def test_section2_invariants(n, i, length, start):
    t = np.arange(length)
    own = owner_np(t, n, i)
    loc = local_index_np(t, n, i)
    # Brute force: owner by definition, dense local index by counting in token order.
    assert sum(int(local_len_np(length, n, r, i)) for r in range(n)) == length
    for r in range(n):
        mine = own == r
        assert own[mine].size == int(local_len_np(length, n, r, i))
        np.testing.assert_array_equal(loc[mine], np.arange(mine.sum()))  # dense, in token order
        owned_in_range = np.count_nonzero(owner_np(np.arange(start, start + length), n, i) == r)
        assert int(count_np(start, length, n, r, i)) == owned_in_range
    if length:
        assert (loc < local_len_np(t + 1, n, own, i)).all()
        np.testing.assert_array_equal(own, (t // i) % n)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: owner(3, 0), "dcp_size"),
        (lambda: owner(3, -2), "dcp_size"),
        (lambda: local_index(3, 2, 0), "interleave_size"),
        (lambda: local_len(3, 2, 2), "dcp_rank"),
        (lambda: local_len(3, 2, -1), "dcp_rank"),
        (lambda: count(0, 3, 4, 4, 2), "dcp_rank"),
        (lambda: owner_np([1], 0), "dcp_size"),
        (lambda: local_len_np(3, 2, 5), "dcp_rank"),
        (lambda: local_len_np(3, 2, np.array([0, 2])), "dcp_rank"),
        (lambda: owner_np([1, -3], 2), "t"),
        (lambda: count_np(-1, 3, 2, 0), "start"),
        (lambda: local_len_np(-5, 2, 0), "length"),
        # the JAX forms check concrete inputs too
        (lambda: local_len(-3, 2, 1), "length"),
        (lambda: count(10, -5, 2, 0), "length"),
        (lambda: count(-1, 5, 2, 0), "start"),
        (lambda: owner([0, -1], 2), "t"),
        (lambda: local_index(np.array([2**33 + 3]), 2), "t=8589934595 does not fit int32"),
        # each fits int32, their sum (the range end) does not: it used to wrap to a negative count
        (lambda: count(2**31 - 10, 100, 2, 0), "start \\+ length = 2147483738"),
        (lambda: count([5, 2**31 - 1], [1, 1], 2, 0), "start \\+ length"),
        (lambda: count_np([2**62, 0], [2**62, 1], 2, 0), "start \\+ length passes int64"),
        (lambda: owner([3], 65536, 65536), "dcp_size \\* interleave_size"),
        (lambda: local_len(3, 65536, 0, 65536), "does not fit int32"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_count_np_checks_each_range_end_not_the_largest_start_plus_the_largest_length():
    # Before: max(start) + max(length) > int64 refused these; each range end fits.
    got = count_np([2**62, 0], [0, 2**62 + 5], 2, 0)
    assert got.tolist() == [0, 2**61 + 3]  # rank 0 of 2 owns the even tokens of [0, 2**62 + 5)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="dcp_size"):
        owner(3, 2.0)
    with pytest.raises(TypeError, match="interleave_size"):
        owner(3, 2, True)
    with pytest.raises(TypeError, match="integers"):
        owner(np.array([1.5]), 2)
    with pytest.raises(TypeError, match="t must be integers"):
        owner("3", 2)
    with pytest.raises(TypeError, match="t must be integers"):
        owner_np(np.array([1.5]), 2)


def test_empty_positions_give_empty_results():
    assert owner([], 2).shape == (0,)
    assert owner_np([], 2).shape == (0,)


def test_check_layout_args_returns_python_ints():
    assert layout.check_layout_args(np.int64(4), np.int32(2), np.int16(3)) == (4, 2, 3)


def test_composes_with_jit_and_vmap():
    import jax

    t = jnp.arange(40, dtype=jnp.int32)
    jitted = jax.jit(lambda x: owner(x, 4, 2) * 1000 + local_index(x, 4, 2))
    np.testing.assert_array_equal(np.asarray(jitted(t)), owner_np(np.arange(40), 4, 2) * 1000 + local_index_np(np.arange(40), 4, 2))
    lengths = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    got = jax.vmap(lambda row: local_len(row, 3, 1, 2))(lengths)
    np.testing.assert_array_equal(np.asarray(got), local_len_np(np.arange(12).reshape(3, 4), 3, 1, 2))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 9), st.integers(1, 70), st.data())
def test_count_int_is_count_np_and_brute_force(start, length, n, i, data):
    from dcp_jax.layout import count_int

    r = data.draw(st.integers(0, n - 1))
    got = count_int(start, length, n, r, i)
    assert type(got) is int
    assert got == int(count_np(start, length, n, r, i)) == sum(1 for t in range(start, start + length) if (t // i) % n == r)


def test_count_int_exact_past_int64_and_bad_args_named():
    from dcp_jax.layout import count_int

    assert count_int(2**70, 2**64, 8, 3, 16) == 2**61  # whole cycles of 128 tokens: 16 of each rank's
    for bad, name in [(dict(start=-1), "start"), (dict(length=-5), "length")]:
        with pytest.raises(ValueError, match=name):
            count_int(**{**dict(start=0, length=10, dcp_size=2, dcp_rank=0), **bad})
    for bad, name in [(dict(start=1.5), "start"), (dict(length=True), "length"), (dict(dcp_rank=None), "dcp_rank")]:
        with pytest.raises(TypeError, match=name):
            count_int(**{**dict(start=0, length=10, dcp_size=2, dcp_rank=0), **bad})
    with pytest.raises(ValueError, match="dcp_rank"):
        count_int(0, 10, 2, 2)


def test_count_np_refuses_ends_past_int64_instead_of_wrapping():
    from dcp_jax.layout import count_int

    with pytest.raises(ValueError, match="int64"):
        count_np(2**62, 2**62, 7, 3, 64)
    assert count_int(2**62, 2**62, 7, 3, 64) == 658812288346769664
    assert int(count_np(2**62, 2**62 - 1, 7, 3, 64)) == count_int(2**62, 2**62 - 1, 7, 3, 64)
