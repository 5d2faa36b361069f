"""Prefill DCP-M -> decode DCP-N plans against a brute-force reference, and their special cases."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.packing import pack_buffer_size, pack_region, pack_slices
from dcp_jax.plan import (
    build_descriptors,
    build_mxn_transfer_plans,
    build_packed_descriptors,
    build_token_transfer_plan,
    prefix_alignment,
    split_windows,
)

ITEM_LENS = np.array([12, 5, 8])  # three layer entries of different row sizes (bytes)


def mxn_reference(src_tables, dst_tables, P, Pp, M, Ip, N, I, prefix, chunk_start, n):
    """Loop over tokens of the send range: owners by definition, local indices by counting."""
    seen_src = [0] * M
    seen_dst = [0] * N
    out = {}
    for t in range(prefix, chunk_start + n):
        s, d = (t // Ip) % M, (t // I) % N
        js, jd = seen_src[s], seen_dst[d]
        seen_src[s] += 1
        seen_dst[d] += 1
        if t >= chunk_start:
            rows = out.setdefault((s, d), ([], []))
            rows[0].append(src_tables[s][js // Pp] * Pp + js % Pp)
            rows[1].append(dst_tables[d][jd // P] * P + jd % P)
    return out, seen_src, seen_dst


def _tables(rng, rows_needed, page_size, extra):
    """Per-rank page tables from one shuffled free list (as an allocator leaves them)."""
    counts = [-(-r // page_size) + extra for r in rows_needed]
    pool = rng.permutation(sum(counts) + 16)
    cuts = np.cumsum([0] + counts)
    return [pool[a:b] for a, b in zip(cuts[:-1], cuts[1:])], int(pool.size)


def _expand(descs, bases, item_len, ndx):
    """Rows named by descriptors (column ``ndx``: 0 source, 1 destination) of one layer entry."""
    starts = (descs[:, ndx] - bases) // item_len
    lens = descs[:, 2] // item_len
    if descs.shape[0] == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(a, a + k) for a, k in zip(starts, lens)])


def _region_check(descs, col, bases, region_bytes):
    """Every descriptor of entry l lies inside [bases[l], bases[l] + region_bytes[l])."""
    per = descs.reshape(len(bases), -1, 3)
    lo = per[:, :, col] >= np.asarray(bases)[:, None]
    hi = per[:, :, col] + per[:, :, 2] <= (np.asarray(bases) + np.asarray(region_bytes))[:, None]
    return bool(lo.all() and hi.all())


@st.composite
def mxn_configs(draw):
    M = draw(st.integers(1, 8))
    N = draw(st.integers(1, 8))
    P = draw(st.one_of(st.sampled_from([1, 2, 4, 16, 64, 128]), st.integers(1, 128)))
    Pp = draw(st.one_of(st.just(P), st.integers(1, 128)))
    I = draw(st.sampled_from([1, 2, 4, P, 2 * P]))
    Ip = draw(st.sampled_from([1, 2, 4, Pp, 2 * Pp]))
    prefix = prefix_alignment(P, N, I) * draw(st.integers(0, 2))
    chunk_off = draw(st.one_of(st.integers(0, 300), st.sampled_from([0, P, 2 * P])))
    n = draw(st.one_of(st.integers(0, 300), st.sampled_from([0, 1, P, 2 * P + 1])))
    extra = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**32 - 1))
    return M, N, P, Pp, I, Ip, prefix, chunk_off, n, extra, seed


@settings(max_examples=2000, deadline=None, derandomize=True)
@given(mxn_configs())
def test_mxn_plans_match_brute_force(cfg):
    M, N, P, Pp, I, Ip, prefix, chunk_off, n, extra, seed = cfg
    rng = np.random.default_rng(seed)
    chunk_start = prefix + chunk_off
    end = chunk_start + n
    # Rows each rank holds of the send range up to the chunk's end: that is what its table covers.
    src_need = [sum(1 for t in range(prefix, end) if (t // Ip) % M == s) for s in range(M)]
    dst_need = [sum(1 for t in range(prefix, end) if (t // I) % N == d) for d in range(N)]
    src_tables, src_pool = _tables(rng, src_need, Pp, extra)
    dst_tables, dst_pool = _tables(rng, dst_need, P, extra)

    plans = build_mxn_transfer_plans(
        src_tables, dst_tables, page_size=P, prefill_page_size=Pp, prefill_dcp_size=M,
        prefill_interleave_size=Ip, dcp_size=N, interleave_size=I, decode_prefix_len=prefix,
        chunk_start=chunk_start, num_kv_tokens=n,
    )
    want, _, _ = mxn_reference(
        [t.tolist() for t in src_tables], [t.tolist() for t in dst_tables], P, Pp, M, Ip, N, I, prefix,
        chunk_start, n,
    )
    assert set(plans) == set(want)
    for (s, d), plan in plans.items():
        assert (plan.src_rank, plan.dst_rank) == (s, d)
        assert plan.src_token_indices.tolist() == want[(s, d)][0]
        assert plan.dst_token_indices.tolist() == want[(s, d)][1]

    # Every token of the chunk delivered exactly once (no destination row written twice).
    assert sum(p.num_rows for p in plans.values()) == n
    for d in range(N):
        rows = np.concatenate([p.dst_token_indices for (_, dd), p in plans.items() if dd == d] or [[]])
        assert np.unique(rows).size == rows.size

    # Descriptors built from the plans never reach past a registered region. Each side
    # registers one KV buffer per layer entry covering its whole page pool.
    src_bases = np.array([1 << 30, 2 << 30, 3 << 30])
    dst_bases = np.array([5 << 30, 6 << 30, 7 << 30])
    src_bytes = src_pool * Pp * ITEM_LENS
    dst_bytes = dst_pool * P * ITEM_LENS
    pack_size = pack_buffer_size(n, N, ITEM_LENS)
    pack_addr = 9 << 30
    for plan in plans.values():
        descs = build_descriptors(plan.runs, src_bases, dst_bases, ITEM_LENS)
        assert descs.shape == (3 * plan.runs.shape[0], 3)
        assert _region_check(descs, 0, src_bases, src_bytes)
        assert _region_check(descs, 1, dst_bases, dst_bytes)
        per = descs.reshape(3, -1, 3)
        for l in range(3):
            np.testing.assert_array_equal(_expand(per[l], src_bases[l], ITEM_LENS[l], 0), plan.src_token_indices)
            np.testing.assert_array_equal(_expand(per[l], dst_bases[l], ITEM_LENS[l], 1), plan.dst_token_indices)
        # Packed: the rank's rows go through its region of the pack buffer, in slices if needed.
        off, size = pack_region(plan.dst_rank, pack_size, N)
        if size == 0:
            continue
        sent = []
        for a, b in pack_slices(plan.num_rows, size, ITEM_LENS):
            win = plan.window(a, b)
            pdescs = build_packed_descriptors(win, pack_addr + off, dst_bases, ITEM_LENS)
            assert (pdescs[:, 0] >= pack_addr + off).all()
            assert (pdescs[:, 0] + pdescs[:, 2] <= pack_addr + off + size).all()
            assert _region_check(pdescs, 1, dst_bases, dst_bytes)
            sent.append(_expand(pdescs.reshape(3, -1, 3)[0], dst_bases[0], ITEM_LENS[0], 1))
        np.testing.assert_array_equal(np.concatenate(sent), plan.dst_token_indices)

    # M = 1 with a page-aligned chunk is the spec's DCP1 API over every destination rank.
    if M == 1 and Pp == P and chunk_off % P == 0:
        off_pages = chunk_off // P
        for d in range(N):
            one = build_token_transfer_plan(
                src_tables[0][off_pages:], dst_tables[d], page_size=P, dcp_size=N, dcp_rank=d,
                interleave_size=I, src_page_offset=off_pages, decode_prefix_len=prefix, num_kv_tokens=n,
            )
            if (0, d) in plans:
                np.testing.assert_array_equal(one.src_token_indices, plans[(0, d)].src_token_indices)
                np.testing.assert_array_equal(one.dst_token_indices, plans[(0, d)].dst_token_indices)
            else:
                assert one.num_rows == 0


@pytest.mark.parametrize("N, I_pages", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 3)])
def test_equal_layouts_move_whole_pages_rank_to_rank(N, I_pages):
    P = 16
    I = I_pages * P
    rng = np.random.default_rng(N * 10 + I_pages)
    prefix = prefix_alignment(P, N, I)
    total = 37 * P + 5  # partial last page
    need = [sum(1 for t in range(prefix, prefix + total) if (t // I) % N == r) for r in range(N)]
    src_tables, _ = _tables(rng, need, P, 0)
    dst_tables, _ = _tables(rng, need, P, 0)
    plans = build_mxn_transfer_plans(
        src_tables, dst_tables, page_size=P, prefill_dcp_size=N, prefill_interleave_size=I,
        dcp_size=N, interleave_size=I, decode_prefix_len=prefix, num_kv_tokens=total,
    )
    assert set(plans) == {(r, r) for r in range(N)}
    for (r, _), plan in plans.items():
        runs = plan.runs
        # Whole pages: every run starts on a page boundary on both sides; all but the one
        # holding the partial last page are whole multiples of P.
        assert (runs[:, 0] % P == 0).all() and (runs[:, 1] % P == 0).all()
        assert (runs[:-1, 2] % P == 0).all()
        # Page i of the source table lands in page i of the destination table.
        n_pages = -(-plan.num_rows // P)
        np.testing.assert_array_equal(plan.src_token_indices[::P] // P, src_tables[r][:n_pages])
        np.testing.assert_array_equal(plan.dst_token_indices[::P] // P, dst_tables[r][:n_pages])
        assert runs.shape[0] <= n_pages


def test_token_rr_equal_layouts_also_whole_pages():
    # I = 1 on both sides with M = N: rank r's tokens stay dense on both sides, so pages map 1:1.
    P, N = 8, 4
    rng = np.random.default_rng(3)
    total = 10 * P * N
    src_tables, _ = _tables(rng, [total // N] * N, P, 0)
    dst_tables, _ = _tables(rng, [total // N] * N, P, 0)
    plans = build_mxn_transfer_plans(src_tables, dst_tables, page_size=P, prefill_dcp_size=N, dcp_size=N,
                                     num_kv_tokens=total)
    assert set(plans) == {(r, r) for r in range(N)}
    assert all((p.runs[:, 2] % P == 0).all() for p in plans.values())


def test_dcp2_to_dcp4_hand_computed():
    # P=2, M=2 (I_p=1), N=4 (I=1), tokens 0..7. Prefill rank s holds t % 2 == s densely.
    src = [[3, 0], [5, 1]]  # prefill rank 0 pages, rank 1 pages
    dst = [[7], [8], [9], [4]]
    plans = build_mxn_transfer_plans(src, dst, page_size=2, prefill_dcp_size=2, dcp_size=4, num_kv_tokens=8)
    # t=0: s0 j0 -> row 6; d0 j0 -> row 14. t=4: s0 j2 -> row 0; d0 j1 -> 15.
    assert plans[(0, 0)].src_token_indices.tolist() == [6, 0]
    assert plans[(0, 0)].dst_token_indices.tolist() == [14, 15]
    # t=1: s1 j0 -> 10; d1 j0 -> 16. t=5: s1 j2 -> 2; d1 j1 -> 17.
    assert plans[(1, 1)].src_token_indices.tolist() == [10, 2]
    assert plans[(1, 1)].dst_token_indices.tolist() == [16, 17]
    assert set(plans) == {(0, 0), (1, 1), (0, 2), (1, 3)}


def test_mxn_chunks_tile_the_request():
    # Sending the request in chunks of any size delivers the same rows as one big chunk.
    P, M, N, Ip, I = 8, 3, 4, 2, 8
    total = 301
    rng = np.random.default_rng(11)
    src_tables, _ = _tables(rng, [-(-total // M) + Ip] * M, P, 0)
    dst_tables, _ = _tables(rng, [-(-total // N) + I] * N, P, 0)
    kw = dict(page_size=P, prefill_dcp_size=M, prefill_interleave_size=Ip, dcp_size=N, interleave_size=I)
    whole = build_mxn_transfer_plans(src_tables, dst_tables, num_kv_tokens=total, **kw)
    parts: dict = {}
    for start in range(0, total, 37):
        for key, p in build_mxn_transfer_plans(
            src_tables, dst_tables, chunk_start=start, num_kv_tokens=min(37, total - start), **kw
        ).items():
            parts.setdefault(key, []).append(p)
    assert set(parts) == set(whole)
    for key, ps in parts.items():
        np.testing.assert_array_equal(np.concatenate([p.src_token_indices for p in ps]), whole[key].src_token_indices)
        np.testing.assert_array_equal(np.concatenate([p.dst_token_indices for p in ps]), whole[key].dst_token_indices)
    # Windows of a pair plan re-tile it too.
    wins = split_windows(whole[(0, 0)], 5)
    assert sum(w.num_rows for w in wins) == whole[(0, 0)].num_rows


BASE = dict(
    src_page_tables=[[1, 2], [3, 4]], dst_page_tables=[[5, 6]], page_size=4, prefill_dcp_size=2,
    dcp_size=1, num_kv_tokens=8,
)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(src_page_tables=[[1, 2]]), r"src_page_tables.*prefill_dcp_size=2"),
        (dict(dst_page_tables=[[5], [6]]), r"dst_page_tables.*dcp_size=1"),
        (dict(src_page_tables=[[1, 2], [3, -4]]), r"src_page_tables\[1\]"),
        (dict(dst_page_tables=[[]]), r"dst_page_tables\[0\]: 2 pages"),
        (dict(src_page_tables=[[1], []]), r"src_page_tables\[1\]: 1 page of 4 tokens is required"),
        (dict(decode_prefix_len=2), r"decode_prefix_len.*= 4 tokens"),
        (dict(decode_prefix_len=8, chunk_start=4), "chunk_start"),
        (dict(num_kv_tokens=-1), "num_kv_tokens"),
        (dict(prefill_dcp_size=0), "prefill_dcp_size"),
        (dict(prefill_interleave_size=0), "prefill_interleave_size"),
        (dict(interleave_size=0), "interleave_size"),
        (dict(prefill_page_size=0), "prefill_page_size"),
    ],
)
def test_mxn_errors_name_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        build_mxn_transfer_plans(**{**BASE, **change})


def test_mxn_empty_chunk():
    assert build_mxn_transfer_plans(**{**BASE, "num_kv_tokens": 0}) == {}


def test_lcm_alignment_example():
    assert prefix_alignment(64, 8, 64) == 512 and math.lcm(64 * 8, 128 * 8) == prefix_alignment(64, 8, 128)
