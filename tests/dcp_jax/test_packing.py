"""Pack buffer size, per-rank regions, layer-major offsets, slices and the strategy choice."""

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.packing import (
    PackRegionTooSmallError,
    choose_pack_strategy,
    choose_pack_strategy_for_rows,
    layer_offsets,
    pack_buffer_size,
    pack_bytes,
    pack_region,
    pack_slices,
    rows_per_region,
)


def test_pack_buffer_size_hand_computed():
    # DeepSeek-V3: 61 x 1152 B rows, 32k-token chunks, 8 ranks: 4096 rows per region.
    assert pack_buffer_size(32768, 8, [1152] * 61) == 8 * 4096 * 61 * 1152
    # ceil: 10 tokens over 4 ranks -> 3 rows per region.
    assert pack_buffer_size(10, 4, [2, 6]) == 4 * 3 * 8
    assert pack_buffer_size(0, 4, [2, 6]) == 0
    assert pack_buffer_size(5, 1, 7) == 35


def test_pack_bytes_is_the_one_size_formula():
    assert pack_bytes(4096, [1152] * 61) == 4096 * 61 * 1152 == 287_834_112
    assert pack_bytes(0, [3, 5]) == 0 and pack_bytes(7, 9) == 63
    # The other sizes go through it: a buffer is N regions of pack_bytes(ceil(max/N)) bytes,
    # and a region of pack_bytes(k) bytes holds exactly k rows.
    assert pack_buffer_size(10, 4, [2, 6]) == 4 * pack_bytes(3, [2, 6])
    assert rows_per_region(pack_bytes(17, [2, 6]), [2, 6]) == 17
    assert rows_per_region(pack_bytes(17, [2, 6]) - 1, [2, 6]) == 16
    # The layer-major pack of n rows ends exactly at pack_bytes(n).
    assert layer_offsets(5, [4, 8, 2])[-1] + 5 * 2 == pack_bytes(5, [4, 8, 2])
    for bad, exc in ((-1, ValueError), (1.0, TypeError)):
        with pytest.raises(exc, match="num_rows"):
            pack_bytes(bad, [4])
    with pytest.raises(ValueError, match="item_lens"):
        pack_bytes(1, [4, 0])


def test_choose_pack_strategy_for_rows(caplog):
    with caplog.at_level(logging.WARNING, logger="dcp_jax.packing"):
        assert choose_pack_strategy_for_rows(10, 10) == "packed"
        assert choose_pack_strategy_for_rows(0, 1) == "packed"
        assert choose_pack_strategy_for_rows(11, 10) == "sliced"
        assert not caplog.records
        assert choose_pack_strategy_for_rows(5, 0) == "per_row"
    assert len(caplog.records) == 1 and "per-row" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="region_rows"):
        choose_pack_strategy_for_rows(5, -1)
    with pytest.raises(ValueError, match="num_rows"):
        choose_pack_strategy_for_rows(-5, 3)


def test_pack_region_hand_computed():
    assert pack_region(0, 100, 4) == (0, 25)
    assert pack_region(3, 100, 4) == (75, 25)
    assert pack_region(2, 103, 4) == (50, 25)  # the 3 tail bytes belong to nobody


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    max_tokens=st.integers(0, 5000),
    n=st.integers(1, 8),
    item_lens=st.lists(st.integers(1, 2000), min_size=1, max_size=6),
)
def test_regions_tile_the_buffer_and_fit_the_largest_share(max_tokens, n, item_lens):
    size = pack_buffer_size(max_tokens, n, item_lens)
    regions = [pack_region(r, size, n) for r in range(n)]
    # Disjoint, in order, inside the buffer.
    for (o1, s1), (o2, _) in zip(regions, regions[1:]):
        assert o1 + s1 == o2
    assert regions[-1][0] + regions[-1][1] <= size
    # Token round-robin's largest share, ceil(max_tokens / N), fits every region.
    for r in range(n):
        assert rows_per_region(regions[r][1], item_lens) == -(-max_tokens // n)
        assert pack_slices(-(-max_tokens // n), regions[r][1], item_lens) in ([], [(0, -(-max_tokens // n))])


def test_layer_offsets():
    assert layer_offsets(3, [4, 8, 2]).tolist() == [0, 12, 36]
    assert layer_offsets(0, [4, 8]).tolist() == [0, 0]
    assert layer_offsets(4096, [1152] * 61)[-1] == 60 * 4096 * 1152
    assert layer_offsets(5, 9).tolist() == [0]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(num_rows=st.integers(0, 500), region=st.integers(1, 10_000), item_lens=st.lists(st.integers(1, 64), min_size=1, max_size=4))
def test_pack_slices_cover_rows_and_fit(num_rows, region, item_lens):
    per = region // sum(item_lens)
    if per == 0 and num_rows:
        with pytest.raises(PackRegionTooSmallError, match="region_size"):
            pack_slices(num_rows, region, item_lens)
        return
    slices = pack_slices(num_rows, region, item_lens)
    covered = [i for a, b in slices for i in range(a, b)]
    assert covered == list(range(num_rows))
    for a, b in slices:
        # Layer-major pack of (b - a) rows ends inside the region.
        assert 0 < b - a <= per
        assert layer_offsets(b - a, item_lens)[-1] + (b - a) * item_lens[-1] <= region


def test_choose_pack_strategy(caplog):
    lens = [1152] * 61
    region = 4096 * sum(lens)
    with caplog.at_level(logging.WARNING, logger="dcp_jax.packing"):
        assert choose_pack_strategy(4096, region, lens) == "packed"
        assert choose_pack_strategy(0, region, lens) == "packed"
        assert choose_pack_strategy(4097, region, lens) == "sliced"
        assert not caplog.records
        assert choose_pack_strategy(10, 100, lens) == "per_row"
        assert choose_pack_strategy(10, None, lens) == "per_row"
    assert len(caplog.records) == 2 and "per-row" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: pack_buffer_size(-1, 2, [4]), ValueError, "max_tokens"),
        (lambda: pack_buffer_size(10, 0, [4]), ValueError, "dcp_size"),
        (lambda: pack_buffer_size(10, 2, []), ValueError, "item_lens"),
        (lambda: pack_buffer_size(10, 2, [4, 0]), ValueError, "item_lens"),
        (lambda: pack_buffer_size(10, 2, [4.0]), TypeError, "item_lens"),
        (lambda: pack_buffer_size(10.0, 2, [4]), TypeError, "max_tokens"),
        (lambda: pack_region(4, 100, 4), ValueError, "dcp_rank"),
        (lambda: pack_region(-1, 100, 4), ValueError, "dcp_rank"),
        (lambda: pack_region(0, -5, 4), ValueError, "buffer_size"),
        (lambda: layer_offsets(-1, [4]), ValueError, "num_rows"),
        (lambda: rows_per_region(-1, [4]), ValueError, "region_size"),
        (lambda: pack_slices(-2, 10, [4]), ValueError, "num_rows"),
        (lambda: pack_slices(3, 3, [4]), PackRegionTooSmallError, "needs 4 bytes"),
    ],
)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_region_too_small_is_a_value_error():
    assert issubclass(PackRegionTooSmallError, ValueError)
    assert np.int64(5) == rows_per_region(np.int64(40), np.array([4, 4]))
