"""The send model (dcp_jax.transfer.schedule) against a brute-force token loop, and byte moves."""

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_jax.layout import local_index_np, local_len_np
from dcp_jax.transfer.schedule import (
    SideLayout,
    TransferSchedule,
    chunk_rows,
    owned_count,
    owned_rows,
    owned_tokens,
    plan_rank_chunk,
    token_rows,
)
from dcp_jax.transfer.spec import KVCacheSpec


# --------------------------------------------------------------------------------------------
# Brute force: one loop over tokens, owners by definition, local rows by counting.
# --------------------------------------------------------------------------------------------


def brute_force(L, M, Is, Ps, src_tables, N, Id, Pd, dst_tables, start):
    """{(s, d): [(token, src_row, dst_row)]} for tokens of [start, L), in token order."""
    seen_s, seen_d, out = [0] * M, [0] * N, {}
    for t in range(L):
        s, d = (t // Is) % M, (t // Id) % N
        js, jd = seen_s[s], seen_d[d]
        seen_s[s] += 1
        seen_d[d] += 1
        if t >= start:
            out.setdefault((s, d), []).append(
                (t, src_tables[s][js // Ps] * Ps + js % Ps, dst_tables[d][jd // Pd] * Pd + jd % Pd))
    return out, seen_s, seen_d


def _table(rng, rows, page_size, extra):
    need = -(-rows // page_size) + extra
    return rng.permutation(need + rng.integers(0, 4))[:need].astype(np.int64)


@st.composite
def configs(draw):
    M, N = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    Ps, Pd = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    Is = draw(st.sampled_from([1, 2, 4, Ps, 2 * Ps]))
    Id = draw(st.sampled_from([1, 2, 4, Pd, 2 * Pd]))
    L = draw(st.integers(0, 600))
    prefix = draw(st.integers(0, L))
    cuts = sorted(draw(st.lists(st.integers(prefix, L), max_size=3)))
    bounds = [prefix, *cuts, L]
    chunks = list(zip(bounds[:-1], bounds[1:]))
    seed = draw(st.integers(0, 2**32 - 1))
    mode = draw(st.sampled_from(["direct", "packed"]))
    batch = draw(st.none() | st.integers(1, 40))
    region = draw(st.none() | st.integers(0, 60)) if mode == "packed" else None
    num_layers = draw(st.integers(1, 3))
    item_lens = draw(st.lists(st.integers(1, 6), min_size=num_layers, max_size=num_layers))
    return dict(M=M, N=N, Ps=Ps, Pd=Pd, Is=Is, Id=Id, L=L, prefix=prefix, chunks=chunks, seed=seed, mode=mode,
                batch=batch, region=region, num_layers=num_layers, item_lens=item_lens)


def _setup(c):
    rng = np.random.default_rng(c["seed"])
    # Rows each rank holds of [0, L): counted, not computed.
    rows_s = [sum((t // c["Is"]) % c["M"] == s for t in range(c["L"])) for s in range(c["M"])]
    rows_d = [sum((t // c["Id"]) % c["N"] == d for t in range(c["L"])) for d in range(c["N"])]
    src_tables = [_table(rng, r, c["Ps"], int(rng.integers(0, 2))) for r in rows_s]
    dst_tables = [_table(rng, r, c["Pd"], int(rng.integers(0, 2))) for r in rows_d]
    return src_tables, dst_tables


def _schedule(c, s, src_tables, dst_tables):
    return TransferSchedule.build(
        src_spec_layout=SideLayout(c["M"], s, c["Is"], c["Ps"]),
        dst_layouts=[SideLayout(c["N"], d, c["Id"], c["Pd"]) for d in range(c["N"])],
        src_page_table=src_tables[s], dst_page_tables=dst_tables, chunks=c["chunks"],
        num_layers=c["num_layers"], item_lens=c["item_lens"], mode=c["mode"],
        max_batch_indices=c["batch"], max_region_rows=c["region"])


def _spans(starts, lengths):
    """Byte indices of the ranges [starts[k], starts[k] + lengths[k]), concatenated."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    if starts.size == 0:
        return np.zeros(0, np.int64)
    return np.repeat(starts - np.cumsum(np.r_[0, lengths[:-1]]), lengths) + np.arange(lengths.sum())


def _memcpy(mem, descs):
    """Applies (src, dst, nbytes) descriptors as memcpys (sources and destinations never overlap here)."""
    mem[_spans(descs[:, 1], descs[:, 2])] = mem[_spans(descs[:, 0], descs[:, 2])]


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_every_token_lands_once_at_the_right_rows_and_bytes(c):
    logging.disable(logging.WARNING)  # the region_rows=0 fallback warns; tested elsewhere
    try:
        _check(c)
    finally:
        logging.disable(logging.NOTSET)


def _check(c):
    src_tables, dst_tables = _setup(c)
    ref, _, _ = brute_force(c["L"], c["M"], c["Is"], c["Ps"], src_tables, c["N"], c["Id"], c["Pd"], dst_tables,
                            c["prefix"])
    lens = np.asarray(c["item_lens"], np.int64)
    nl = c["num_layers"]
    # One flat address space: per prefill rank L source layers, per decode rank L destination
    # layers, then a pack region; every layer buffer is rows x item_len bytes.
    src_rows_cap = max([int(t.max()) + 1 for t in src_tables if t.size] + [1]) * c["Ps"]
    dst_rows_cap = max([int(t.max()) + 1 for t in dst_tables if t.size] + [1]) * c["Pd"]
    region_cap = int(lens.sum()) * (c["L"] + 1)
    src_bases = np.cumsum([0, *(src_rows_cap * lens)])[:-1]
    src_span = src_rows_cap * int(lens.sum())
    dst_span = dst_rows_cap * int(lens.sum())
    dst_base0 = src_span
    region_addr = dst_base0 + c["N"] * dst_span
    rng = np.random.default_rng(c["seed"] + 1)
    seen_tokens = []
    for s in range(c["M"]):
        mem = np.zeros(region_addr + region_cap, np.uint8)
        mem[:src_span] = rng.integers(1, 256, src_span)
        sched = _schedule(c, s, src_tables, dst_tables)
        assert [(u.chunk, u.dst_rank) for u in sched.units] == \
            [(k, d) for k in range(len(c["chunks"])) for d in range(c["N"])]
        got = {}
        for u in sched.units:
            n = u.num_rows
            # Windows tile [0, n) in order and respect the limits.
            assert u.windows[0][0] == 0 and u.windows[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(u.windows, u.windows[1:]))
            if n == 0:
                assert u.strategy == "empty" and u.windows == ((0, 0),) and u.num_batches == 0
            for lo, hi in u.windows:
                if c["batch"] is not None:
                    assert hi - lo <= c["batch"]
                if u.strategy == "packed" and c["region"] is not None:
                    assert hi - lo <= c["region"]
            if c["mode"] == "packed" and n:
                assert u.strategy == ("direct" if c["region"] == 0 else "packed")
                assert u.fallback == (c["region"] == 0)
            got.setdefault(u.dst_rank, ([], []))
            got[u.dst_rank][0].extend(u.src_rows.tolist())
            got[u.dst_rank][1].extend(u.dst_rows.tolist())
            dst_bases = dst_base0 + u.dst_rank * dst_span + np.cumsum([0, *(dst_rows_cap * lens)])[:-1]
            for w, (lo, hi) in enumerate(u.windows):
                if u.strategy == "packed":  # the gather, written out: layer-major rows 0..n-1
                    off = region_addr
                    for li in range(nl):
                        rows = u.src_rows[lo:hi]
                        k = hi - lo
                        mem[_spans([off], [k * lens[li]])] = mem[_spans(src_bases[li] + rows * lens[li],
                                                                        np.full(k, lens[li]))]
                        off += k * lens[li]
                descs = u.window_descriptors(w, src_bases=src_bases, dst_bases=dst_bases, item_lens=lens,
                                             region_addr=region_addr)
                assert descs.shape[0] == u.descriptors_per_window(nl)[w]
                assert descs.shape[1] == 3 and int(descs[:, 2].sum()) == u.window_bytes(w, lens)
                _memcpy(mem, descs)
            assert u.num_descriptors(nl) == sum(u.descriptors_per_window(nl))
        # Rows: exactly the brute force's, in token order, per destination rank.
        for d in range(c["N"]):
            want = ref.get((s, d), [])
            assert got[d][0] == [x[1] for x in want] and got[d][1] == [x[2] for x in want]
            seen_tokens += [x[0] for x in want]
            # Bytes: every received row equals its source row; every other row is untouched.
            expect = np.zeros(dst_span, np.uint8)
            sr = np.array([x[1] for x in want], np.int64)
            dr = np.array([x[2] for x in want], np.int64)
            layer0 = np.cumsum([0, *(dst_rows_cap * lens)])[:-1]
            for li in range(nl):
                one = np.full(sr.size, lens[li])
                expect[_spans(layer0[li] + dr * lens[li], one)] = mem[_spans(src_bases[li] + sr * lens[li], one)]
            lo = dst_base0 + d * dst_span
            np.testing.assert_array_equal(mem[lo:lo + dst_span], expect)
        t = sched.total
        assert t.rows == sum(len(ref.get((s, d), [])) for d in range(c["N"]))
        assert t.bytes == t.rows * int(lens.sum())
        assert t.notifications == t.batches + t.empty_units
    assert sorted(seen_tokens) == list(range(c["prefix"], c["L"]))  # every token exactly once


@settings(max_examples=200, deadline=None, derandomize=True)
@given(n=st.integers(1, 8), r=st.integers(0, 7), i=st.integers(1, 20), m=st.integers(1, 8), rs=st.integers(0, 7),
       ip=st.integers(1, 20), start=st.integers(0, 400), length=st.integers(0, 400))
def test_owned_tokens_is_the_filter_of_the_range(n, r, i, m, rs, ip, start, length):
    dst, src = SideLayout(n, r % n, i, 1), SideLayout(m, rs % m, ip, 1)
    ts = range(start, start + length)
    mine = owned_tokens(start, start + length, dst=dst)
    assert mine.tolist() == [t for t in ts if (t // i) % n == r % n]
    # The enumeration inverts local_index: the owned tokens' local indices are dense.
    first = sum((t // i) % n == r % n for t in range(start))
    assert local_index_np(mine, n, i).tolist() == list(range(first, first + mine.size))
    assert owned_tokens(start, start + length, dst=dst, src=src).tolist() == \
        [t for t in ts if (t // i) % n == r % n and (t // ip) % m == rs % m]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 8), r=st.integers(0, 7), i=st.integers(1, 20), m=st.integers(1, 8), rs=st.integers(0, 7),
       ip=st.integers(1, 20), start=st.integers(0, 400), length=st.integers(0, 400))
def test_owned_count_counts_the_filter_of_the_range(n, r, i, m, rs, ip, start, length):
    dst, src = SideLayout(n, r % n, i, 1), SideLayout(m, rs % m, ip, 1)
    ts = range(start, start + length)
    assert owned_count(start, start + length, dst=dst) == sum((t // i) % n == r % n for t in ts)
    assert owned_count(start, start + length, dst=dst, src=SideLayout(1, 0, ip, 1)) == \
        sum((t // i) % n == r % n for t in ts)
    assert owned_count(start, start + length, dst=dst, src=src) == \
        sum((t // i) % n == r % n and (t // ip) % m == rs % m for t in ts)


def test_owned_count_is_a_formula_far_out():
    # 10**9 tokens near 10**15: counted without listing them (listing would take gigabytes).
    far = 10**15
    assert owned_count(far, far + 10**9, dst=SideLayout(8, 3, 64, 64)) == 10**9 // 8
    with pytest.raises(ValueError):
        owned_count(5, 4, dst=SideLayout(2, 0, 1, 1))


def test_owned_tokens_does_not_scan_the_range():
    # Tokens near 10**15 with N = 10**6: a scan from token 0 (or of the range) would not finish.
    far = 10**15
    got = owned_tokens(far, far + 4 * 10**6, dst=SideLayout(10**6, 3, 4, 64))
    assert got.tolist() == [t for t in range(far, far + 16) if (t // 4) % 10**6 == 3]
    got = owned_tokens(far, far + 10**9, dst=SideLayout(10**6, 5, 1, 64), src=SideLayout(10**6 + 1, 7, 1, 1))
    assert all(t % 10**6 == 5 and t % (10**6 + 1) == 7 for t in got.tolist()) and got.size <= 1000


def test_spec_section_4_examples():
    src, r0, r1 = SideLayout(1, 0, 1, 4), SideLayout(2, 0, 1, 4), SideLayout(2, 1, 1, 4)
    s, d = chunk_rows(0, 8, src=src, dst=r0, src_page_table=[10, 11], dst_page_table=[30])
    assert s.tolist() == [40, 42, 44, 46] and d.tolist() == [120, 121, 122, 123]
    s, d = chunk_rows(0, 8, src=src, dst=r1, src_page_table=[10, 11], dst_page_table=[30])
    assert s.tolist() == [41, 43, 45, 47] and d.tolist() == [120, 121, 122, 123]
    s, d = chunk_rows(0, 16, src=src, dst=r1, src_page_table=[10, 11, 12, 13], dst_page_table=[30, 47])
    assert s.tolist() == list(range(41, 56, 2)) and d.tolist() == [120, 121, 122, 123, 188, 189, 190, 191]


def test_receiver_table_counts_from_token_zero():
    # Prefix 8 of P=4, N=2: rank 1 already holds local rows 0..3 (page 30); tokens 9, 11, ... go to page 47.
    src, r1 = SideLayout(1, 0, 1, 4), SideLayout(2, 1, 1, 4)
    s, d = chunk_rows(8, 16, src=src, dst=r1, src_page_table=[10, 11, 12, 13], dst_page_table=[30, 47])
    assert s.tolist() == [49, 51, 53, 55] and d.tolist() == [188, 189, 190, 191]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 8), r=st.integers(0, 7), i=st.integers(1, 6), m=st.integers(1, 4), rs=st.integers(0, 3),
       ip=st.integers(1, 6), ps=st.integers(1, 8), pd=st.integers(1, 8), start=st.integers(0, 200),
       length=st.integers(0, 200), mode=st.sampled_from(["direct", "packed", "region", "fused"]),
       seed=st.integers(0, 2**32 - 1))
def test_a_plan_from_tables_validated_once_equals_the_checked_plan(n, r, i, m, rs, ip, ps, pd, start, length,
                                                                    mode, seed):
    # The sender plans every chunk with check_tables=False (its tables were checked at send /
    # expect): only their lengths are checked then; rows must be those of the checked plan.
    rng = np.random.default_rng(seed)
    dst, src = SideLayout(n, r % n, i, pd), SideLayout(m, rs % m, ip, ps)
    stop = start + length
    src_table = rng.permutation(stop // ps + 3)
    dst_table = rng.permutation(stop // pd + 3)
    a, b = (plan_rank_chunk(0, start, stop, src=src, dst=dst, src_page_table=src_table, dst_page_table=dst_table,
                            mode=mode, check_tables=c) for c in (True, False))
    assert a.src_rows.tolist() == b.src_rows.tolist() and a.dst_rows.tolist() == b.dst_rows.tolist()
    assert (a.strategy, a.windows) == (b.strategy, b.windows)
    # Brute force: each owned token's rows through the tables.
    toks = [t for t in range(start, stop) if (t // i) % n == r % n and (t // ip) % m == rs % m]
    sl = [(t // (ip * m)) * ip + t % ip for t in toks]
    dl = [(t // (i * n)) * i + t % i for t in toks]
    assert b.src_rows.tolist() == [int(src_table[j // ps]) * ps + j % ps for j in sl]
    assert b.dst_rows.tolist() == [int(dst_table[j // pd]) * pd + j % pd for j in dl]
    if b.num_rows:  # a table one page short is still refused, named
        short = dst_table[:int(dl[-1]) // pd]
        with pytest.raises(ValueError, match="dst_page_table is too short"):
            plan_rank_chunk(0, start, stop, src=src, dst=dst, src_page_table=src_table, dst_page_table=short,
                            mode=mode, check_tables=False)


def test_token_rows_errors():
    side = SideLayout(2, 1, 1, 4)
    with pytest.raises(ValueError, match=r"page_table is too short: 2 pages of 4 tokens are required"):
        token_rows([1, 9], side, [3])
    with pytest.raises(ValueError, match="page_table"):
        token_rows([1], side, [-1, 2])
    with pytest.raises(ValueError, match="page_table"):
        token_rows([1], side, [2, 2])
    with pytest.raises(ValueError, match="tokens holds token 2"):
        token_rows([2], side, [0])
    with pytest.raises(TypeError, match="tokens"):
        token_rows([1.0], side, [0])
    assert token_rows([], side, [0]).tolist() == []
    assert token_rows([1, 3, 5, 7, 9], side, [5, 1]).tolist() == [20, 21, 22, 23, 4]
    with pytest.raises(ValueError, match="dst_page_table is too short"):
        chunk_rows(0, 40, src=SideLayout(1, 0, 1, 4), dst=side, src_page_table=range(10), dst_page_table=[0])
    with pytest.raises(ValueError, match="stop"):
        owned_tokens(5, 4, dst=side)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), i=st.sampled_from([1, 2, 4, 16]), p=st.sampled_from([1, 4, 16]),
       m=st.integers(1, 3), data=st.data())
def test_token_rows_validated_matches_the_checked_lookup(n, i, p, m, data):
    """The receiver's grant path skips the table checks (`validated=True`) for tokens
    `owned_tokens` lists: the rows must be the ones the checked lookup and the formula give."""
    rank = data.draw(st.integers(0, n - 1))
    dst, src = SideLayout(n, rank, i, p), SideLayout(m, data.draw(st.integers(0, m - 1)), 1, p)
    start = data.draw(st.integers(0, 200))
    stop = data.draw(st.integers(start, start + 300))
    toks = owned_tokens(start, stop, dst=dst, src=src)
    pages = -(-int(local_len_np(stop, n, rank, i)) // p)  # the rank's pages for tokens [0, stop)
    table = np.random.default_rng(data.draw(st.integers(0, 2**31))).permutation(pages + 5)[:pages].astype(np.int64)
    fast = token_rows(toks, dst, table, check_table=False, validated=True)
    assert fast.tolist() == token_rows(toks, dst, table).tolist()
    j = local_index_np(toks, n, i)
    assert fast.tolist() == (table[j // p] * p + j % p).tolist()


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 8), i=st.sampled_from([1, 2, 3, 16]), p=st.sampled_from([1, 4, 5, 16]),
       m=st.integers(1, 3), data=st.data())
def test_owned_rows_are_the_rows_of_the_owned_tokens(n, i, p, m, data):
    """A receiver's grant lists its rows with `owned_rows`: the page-by-page form for a one-rank
    source must give what the token list through the checked lookup and the formula give."""
    rank = data.draw(st.integers(0, n - 1))
    dst = SideLayout(n, rank, i, p)
    src = data.draw(st.sampled_from([None, SideLayout(1, 0, 7, 1), SideLayout(m, data.draw(st.integers(0, m - 1)),
                                                                               data.draw(st.integers(1, 5)), 1)]))
    start = data.draw(st.integers(0, 200))
    stop = data.draw(st.integers(start, start + 300))
    pages = -(-int(local_len_np(stop, n, rank, i)) // p)
    table = np.random.default_rng(data.draw(st.integers(0, 2**31))).permutation(pages + 5)[:pages]
    table = table.astype(data.draw(st.sampled_from([np.int64, np.int32])))
    toks = owned_tokens(start, stop, dst=dst, src=src)
    got = owned_rows(start, stop, dst=dst, page_table=table, src=src)
    assert got.dtype == np.int64
    assert got.tolist() == token_rows(toks, dst, table).tolist()
    j = [sum((u // i) % n == rank for u in range(t)) for t in toks.tolist()]  # brute-force local index
    assert got.tolist() == [int(table[x // p]) * p + x % p for x in j]


def test_owned_rows_hand_case_and_errors():
    side = SideLayout(2, 1, 1, 4)  # rank 1 of 2 owns the odd tokens; local index = t // 2
    # Tokens 3..9 -> local 1..4 -> pages [5, 1]: rows 21, 22, 23, then page 1's row 4.
    assert owned_rows(3, 10, dst=side, page_table=[5, 1]).tolist() == [21, 22, 23, 4]
    assert owned_rows(4, 4, dst=side, page_table=[]).tolist() == []
    assert owned_rows(0, 1, dst=side, page_table=[]).tolist() == []  # token 0 is rank 0's
    with pytest.raises(ValueError, match=r"page_table is too short: 2 pages of 4 tokens are required"):
        owned_rows(0, 10, dst=side, page_table=[3])
    with pytest.raises(ValueError, match="stop"):
        owned_rows(5, 4, dst=side, page_table=[0])
    with pytest.raises(ValueError, match="start"):
        owned_rows(-1, 4, dst=side, page_table=[0])
    with pytest.raises(ValueError, match="page_table is too short"):  # a multi-rank source: the token path
        owned_rows(0, 10, dst=side, page_table=[3], src=SideLayout(2, 1, 1, 4))


@pytest.mark.parametrize("src", [None, SideLayout(2, 1, 1, 4)], ids=["one-rank source", "two-rank source"])
@pytest.mark.parametrize("table, exc, says", [
    (np.array([0.0, 1.7]), TypeError, "page_table must be integers, got dtype float64"),
    (np.array([True, False]), TypeError, "page_table must be integers, got dtype bool"),
    (np.array(["a", "b"]), TypeError, "page_table must be integers"),
    (None, TypeError, "page_table must be integers, got dtype object"),
    (np.arange(4).reshape(2, 2), ValueError, r"page_table must be 1-D, got shape \(2, 2\)"),
    (np.int64(3), ValueError, r"page_table must be 1-D, got shape \(\)"),
    (np.array([2**63 + 5, 1], np.uint64), ValueError, "page_table must hold values <= 2\\*\\*63 - 1"),
])
def test_owned_rows_and_the_validated_lookup_refuse_a_bad_table_alike(src, table, exc, says):
    """Validated means the ids were checked once, not the table's type: both forms refuse it."""
    side = SideLayout(2, 1, 1, 4)
    with pytest.raises(exc, match=says):
        owned_rows(0, 10, dst=side, page_table=table, src=src)
    with pytest.raises(exc, match=says):
        token_rows(owned_tokens(0, 10, dst=side, src=src), side, table, check_table=False, validated=True)


def test_a_layout_that_is_not_a_side_layout_is_named():
    side = SideLayout(2, 1, 1, 4)
    with pytest.raises(TypeError, match="dst must be a SideLayout, got tuple"):
        owned_rows(0, 4, dst=(2, 1, 1, 4), page_table=[0])
    with pytest.raises(TypeError, match="dst must be a SideLayout, got tuple"):
        owned_tokens(0, 4, dst=(2, 1, 1, 4))
    with pytest.raises(TypeError, match="src must be a SideLayout, got int"):
        owned_tokens(0, 4, dst=side, src=3)
    with pytest.raises(TypeError, match="side must be a SideLayout, got tuple"):
        token_rows([1], (2, 1, 1, 4), [0])


def test_side_layout_checks_and_of_spec():
    spec = KVCacheSpec(num_layers=2, item_lens=(4, 8), page_size=16, dcp_size=4, dcp_rank=3, interleave_size=2)
    assert SideLayout.of(spec) == SideLayout(4, 3, 2, 16)
    for args, name in (((0, 0, 1, 1), "dcp_size"), ((2, 2, 1, 1), "dcp_rank"), ((2, 0, 0, 1), "interleave_size"),
                       ((2, 0, 1, 0), "page_size")):
        with pytest.raises(ValueError, match=name):
            SideLayout(*args)
    with pytest.raises(TypeError, match="page_size"):
        SideLayout(2, 0, 1, 4.0)


def _build(**kw):
    base = dict(src_spec_layout=SideLayout(2, 0, 1, 4), dst_layouts=[SideLayout(4, d, 1, 4) for d in range(4)],
                src_page_table=list(range(8)), dst_page_tables=[list(range(4))] * 4, chunks=[(0, 16), (16, 32)],
                num_layers=3, item_lens=[4, 4, 8], mode="direct")
    return TransferSchedule.build(**{**base, **kw})


def test_empty_units_and_engine_calls():
    # Prefill rank 0 of M=2 (even tokens) has nothing for decode ranks 1 and 3 of N=4.
    nixl, moon = _build(), _build(engine_window=5)
    assert [u.strategy for u in nixl.units] == ["direct", "empty", "direct", "empty"] * 2
    empty = nixl.units[1]
    assert empty.windows == ((0, 0),) and empty.num_batches == 0 and empty.num_descriptors(3) == 0
    assert empty.window_descriptors(0, src_bases=[0] * 3, dst_bases=[0] * 3, item_lens=[4, 4, 8]).shape == (0, 3)
    # NIXL: one call per batch, an empty unit's completion is a bare notification (no call).
    assert nixl.per_rank[1].engine_calls == 0 and nixl.per_rank[1].notifications == 2
    assert nixl.per_rank[0].engine_calls == nixl.per_rank[0].batches == 2
    # Mooncake: ceil(descriptors / 5) + 1 notification call per batch; 1 per empty unit.
    assert nixl.per_rank[0].descriptors == 2 * 4 * 3  # tokens 0, 4, 8, 12 are not contiguous rows
    assert moon.per_rank[0].engine_calls == 2 * (-(-12 // 5) + 1)
    assert moon.per_rank[1].engine_calls == 2 and moon.per_rank[1].batches == 0
    assert moon.total.empty_units == 4 and moon.engine_calls == 2 * 2 * 4 + 4
    assert "empty=4" in repr(moon) and "mooncake(window=5)" in repr(moon)
    assert "strategy='empty'" in repr(empty) and "rows=0" in repr(empty)


def test_packed_windows_follow_batch_and_region_limits(caplog):
    side, dst = SideLayout(1, 0, 1, 4), SideLayout(2, 0, 1, 4)
    u = plan_rank_chunk(0, 0, 40, src=side, dst=dst, src_page_table=range(10), dst_page_table=[4, 2, 0, 3, 1],
                        mode="packed", max_batch_indices=7, max_region_rows=5)
    assert u.strategy == "packed" and u.windows == ((0, 5), (5, 10), (10, 15), (15, 20))
    # Packed: rows 0..n-1 of the pack, runs broken only by destination pages (4 rows each).
    assert u.descriptors_per_window(1) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="region_addr"):
        u.window_descriptors(0, src_bases=[0], dst_bases=[0], item_lens=[4])
    with caplog.at_level(logging.WARNING, logger="dcp_jax.packing"):
        f = plan_rank_chunk(0, 0, 40, src=side, dst=dst, src_page_table=range(10), dst_page_table=range(5),
                            mode="packed", max_batch_indices=7, max_region_rows=0)
    assert f.strategy == "direct" and f.fallback and f.windows == ((0, 7), (7, 14), (14, 20))
    assert any("per-row" in r.getMessage() for r in caplog.records)
    assert "fallback" in repr(f)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(mode="fast"), ValueError, "mode"),
    (dict(chunks=[(0, 16), (8, 32)]), ValueError, "chunks"),
    (dict(chunks=[(4, 2)]), ValueError, "stop"),
    (dict(dst_page_tables=[[0]] * 3), ValueError, "dst_page_tables"),
    (dict(dst_page_tables=[[0, -1]] * 4), ValueError, r"dst_page_tables\[0\]"),
    (dict(dst_page_tables=[range(4), range(4), [0], range(4)]), ValueError,
     r"dst_page_tables\[2\] is too short: 2 pages of 4 tokens are required"),
    (dict(src_page_table=[0, 0]), ValueError, "src_page_table"),
    (dict(dst_layouts=[SideLayout(4, 0, 1, 4)] * 4), ValueError, "dst_layouts"),
    (dict(item_lens=[4, 4]), ValueError, "item_lens"),
    (dict(max_batch_indices=0), ValueError, "max_batch_indices"),
    (dict(mode="packed", max_region_rows=-1), ValueError, "max_region_rows"),
    (dict(engine_window=0), ValueError, "engine_window"),
    (dict(num_layers=0), ValueError, "num_layers"),
])
def test_build_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        _build(**kw)
    if "mode" in kw or "max_" in str(kw) or "engine" in str(kw):  # checked without any chunk, too
        with pytest.raises(exc, match=match):
            _build(**{**kw, "chunks": []})


def test_empty_schedule():
    s = _build(chunks=[])
    assert s.units == () and s.per_rank == {} and s.total.descriptors == 0 and "units=0" in repr(s)


def test_owned_count_refusals_name_the_argument():
    d = SideLayout(8, 3, 64, 64)
    with pytest.raises(ValueError, match="stop=9223372036854775808 must be <= 2\\*\\*62"):
        owned_count(0, 2**63, dst=d)
    with pytest.raises(ValueError, match="start="):
        owned_count(np.uint64(2**63), 2**63 + 1, dst=d)
    with pytest.raises(TypeError, match="dst must be a SideLayout"):
        owned_count(0, 10, dst=None)
    with pytest.raises(TypeError, match="src must be a SideLayout"):
        owned_count(0, 10, dst=d, src=(2, 1, 64, 64))
    with pytest.raises(TypeError, match="start must be an int"):
        owned_count(True, 10, dst=d)
