"""The connector with TP head splits and cache layouts (`dcp_jax.transfer.views`): every prefill
(DCP, TP) rank a `KVSender`, every decode (DCP, TP) rank a `KVReceiver` connected to all of them,
over NIXL and Mooncake on loopback; each decode rank's whole cache compared byte for byte with
the oracle of `dcp_jax.hetero.connector_job` (pattern per (token, layer, plane, global head,
element) placed through the layout adapters; sentinel elsewhere). Small: a few hundred tokens,
two layers, heads of 8 elements.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import ENGINES, check_region_timeline

from dcp_jax.hetero.connector_job import expected_cache, fill_side, spec_of, _sentinel, _etype
from dcp_jax.hetero.cost import rank_tables
from dcp_jax.hetero.layouts import cache_shape
from dcp_jax.hetero.plan import HeteroSide
from dcp_jax.transfer import HandshakeError, KVReceiver, KVSender, TransferStatus
from dcp_jax.transfer.spec import check_compatible
from dcp_jax.transfer.views import pair_moves, served_group_ranks, stream_view, uncovered_heads

LAYERS = 2


def _gqa(page_size, dcp_size=1, interleave_size=1, tp_size=1, layout="nhd", heads=4):
    return HeteroSide(page_size, dcp_size, interleave_size, tp_size, layout, heads, 8, "bfloat16")


def _mla(page_size, dcp_size=1, interleave_size=1, tp_size=1, layout="sglang_mla"):
    return HeteroSide(page_size, dcp_size, interleave_size, tp_size, layout, 1, 24, "bfloat16")


def _run_pair(engine, p: HeteroSide, d: HeteroSide, tokens: int, seed: int = 0, receiver_kw=None, links=None,
              chunks: int = 1, **sender_kw):
    """Every decode rank connected to every prefill rank, or where ``links((r, t), (r', t'))`` (decode
    rank, prefill rank) says so; every sender gets every one of ``chunks`` chunks (a serving loop's
    chunked prefill on each TP rank); every sender and receiver must end SUCCESS."""
    rng = np.random.default_rng(seed)
    ptables, ppages = rank_tables(p, tokens, rng)
    dtables, dpages = rank_tables(d, tokens, rng)
    senders, receivers, caches = [], [], {}
    try:
        for r in range(p.dcp_size):
            for t in range(p.tp_size):
                kv = fill_side(p, r, t, ppages[r], LAYERS, tokens, ptables[r], seed + 10 * r + t)
                # peer_timeout_s 15: building several Mooncake engines in this one process holds
                # the GIL for ~1 s each; the default 5 s stall rule fired on a loaded CI machine.
                senders.append(((r, t), KVSender(spec_of(p, r, t, LAYERS), kv, engine=engine, timeout_s=20,
                                            peer_timeout_s=15.0, **sender_kw)))
        for r in range(d.dcp_size):
            for t in range(d.tp_size):
                kv = [_sentinel(cache_shape(d.geometry(t, dpages[r])), _etype(d)) for _ in range(LAYERS)]
                caches[(r, t)] = kv
                recv = KVReceiver(spec_of(d, r, t, LAYERS), kv, engine=engine, group="views", timeout_s=20,
                                  peer_timeout_s=15.0, **(receiver_kw or {}))
                receivers.append(((r, t), recv))
                for key, s in senders:
                    if links is None or links((r, t), key):
                        recv.connect(s.address)
                recv.expect("q", dtables[r], tokens)
        bounds = np.linspace(0, tokens, chunks + 1).astype(int)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            for key, s in senders:
                s.send("q", ptables[key[0]], int(lo), int(hi))
        deadline = time.monotonic() + 30
        everyone = [s for _, s in senders] + [x for _, x in receivers]
        while not all(x.poll("q").terminal for x in everyone) and time.monotonic() < deadline:
            time.sleep(0.002)
        for k, s in senders:
            assert s.poll("q") is TransferStatus.SUCCESS, (k, s.failure_reason("q"))
        for k, recv in receivers:
            assert recv.poll("q") is TransferStatus.SUCCESS, (k, recv.failure_reason("q"))
            want = expected_cache(d, k[0], k[1], dpages[k[0]], LAYERS, tokens, dtables[k[0]])
            for layer in range(LAYERS):
                np.testing.assert_array_equal(caches[k][layer], want[layer], err_msg=f"decode rank {k} layer {layer}")
        # Both sides label a TP pair that shares no KV head "none" (nothing moves), alike.
        for k, s in senders:
            for peer in s.peers:
                key = (peer["dcp_rank"], peer["tp_rank"])
                moves = pair_moves(spec_of(p, *k, LAYERS), spec_of(d, *key, LAYERS))
                assert (peer["path"] == "none") == (not moves), (k, peer)
                link = next(x for x in dict(receivers)[key].peers if (x["dcp_rank"], x["tp_rank"]) == k)
                assert link["path"] == peer["path"], (k, key, link, peer)
        # A rank's request_stats names each sender it announced to, with the path both sides report.
        sender_stats = {k: s.request_stats("q") for k, s in senders}
        for key, recv in receivers:
            rs = recv.request_stats("q")
            assert [x["path"] for x in rs["senders"]] == rs["paths"] and len(rs["senders"]) == len(rs["staging"])
            group_rank = key[1] * d.dcp_size + key[0]
            for x in rs["senders"]:
                by_sender = sender_stats[(x["dcp_rank"], x["tp_rank"])]["ranks"][group_rank]
                assert x["path"] == by_sender["path"] != "none", (key, x, by_sender)
            announced = {(x["dcp_rank"], x["tp_rank"]) for x in rs["senders"]}
            assert announced == {k for k, s in senders if group_rank in sender_stats[k]["ranks"]}, key
        return [sender_stats[k] for k, _ in senders]
    finally:
        for _, x in receivers:
            x.close()
        for _, s in senders:
            s.close()


_CASES = [
    # TP 2 -> 4 (one head per decode rank), NHD -> HND, page 16 -> 64, DCP 1 -> 2
    (_gqa(16, tp_size=2), _gqa(64, 2, 1, tp_size=4, layout="hnd"), 150),
    # TP 1 -> 2, HND -> TPU GQA, page 128 -> 32, DCP 2 (I = 4) -> 1, odd tokens
    (_gqa(128, 2, 4, layout="hnd"), _gqa(32, tp_size=2, layout="tpu_gqa"), 131),
    # heads replicated on decode (2 KV heads over TP 4), TPU GQA -> NHD
    (_gqa(8, layout="tpu_gqa", heads=2), _gqa(4, 2, 2, tp_size=4, heads=2), 97),
    # MLA: latent replicated over TP, sglang rows -> TPU two-tokens-per-row, odd token count
    (_mla(4, tp_size=2), _mla(8, 2, 1, tp_size=3, layout="tpu_mla"), 101),
    # one layout, no TP, but NHD splits a token's row (K and V planes apart): page 16 -> 4, DCP 1 -> 2
    (_gqa(16), _gqa(4, 2, 1), 77),
    # senders that move nothing (a fresh user's regression of the day): MLA TP 2 -> TP 1 (the latent from
    # prefill tp 0 only) and 2 heads replicated over TP 4 on both sides (prefill tp 1 and 3 send none);
    # no rank announces to them, and they end SUCCESS once sent
    (_mla(4, tp_size=2), _mla(8), 45),
    (_gqa(16, tp_size=4, heads=2), _gqa(16, tp_size=4, heads=2), 40),
]
_IDS = ["tp2-nhd-p16_tp4-hnd-p64-dcp2", "dcp2-hnd-p128_tp2-tpugqa-p32", "tpugqa_tp4-replicated", "mla-tp2_tpumla-tp3",
        "nhd-p16_nhd-p4-dcp2", "mla-tp2_tp1-idle-sender", "gqa-tp4-replicated_idle-senders"]
# Every case over NIXL; over Mooncake (about 0.5 s per engine it starts) marked slow: CI runs
# Mooncake on the region test below, whose direct batches (empty pairs) and windows cover both.
_PARAMS = [pytest.param(e, c, id=f"{i}-{e}", marks=() if e == "nixl" else pytest.mark.slow)
           for e in ENGINES for c, i in zip(_CASES, _IDS)]


@pytest.mark.parametrize("engine,case", _PARAMS)
def test_views_byte_exact(engine, case):
    p, d, tokens = case
    stats = _run_pair(engine, p, d, tokens)
    # Each decode rank got its heads once: bytes over all senders = tokens x its heads x planes x dim x 2 B x layers.
    got = {}
    for st in stats:
        for key, v in st["ranks"].items():
            got[key] = got.get(key, 0) + v["bytes"]
    for r in range(d.dcp_size):
        n = sum(1 for t in range(tokens) if (t // d.interleave_size) % d.dcp_size == r)
        for t in range(d.tp_size):
            g = d.geometry(t, 1)
            assert got[t * d.dcp_size + r] == n * g.num_heads * g.planes * g.head_dim * 2 * LAYERS
    # Timelines name a decode rank by its group rank (tp_rank * dcp_size + dcp_rank): every decode
    # process apart, each posted to and completed by exactly the senders that move it bytes (a pair
    # with no head in common is not announced, so neither side waits for it).
    served = set()
    for (r, t), st in zip(((r, t) for r in range(p.dcp_size) for t in range(p.tp_size)), stats):
        want = served_group_ranks(spec_of(p, r, t, LAYERS), spec_of(d, 0, 0, LAYERS))
        served |= want
        for event in ("post", "complete"):
            assert {rank for e, rank, _ in st["timeline"] if e == event} == want
    assert served == set(range(d.dcp_size * d.tp_size))


@pytest.mark.parametrize("case", [(_mla(4, tp_size=2), _mla(8)), (_gqa(16, tp_size=4, heads=2), _gqa(16, heads=2))],
                         ids=["mla-tp2_tp1", "gqa-tp4-replicated_tp1"])
def test_a_sender_that_moves_nothing_takes_every_chunk(case):
    # Chunked prefill on every TP rank: a rank whose heads another sends (or no decode rank holds)
    # is SUCCESS after its first chunk; its later chunks are no-ops, not "release() it before
    # reusing the id" (a fresh user's regression: the serving loop's second send raised).
    _run_pair("nixl", *case, 90, chunks=3)


@pytest.mark.parametrize("engine", ENGINES)
def test_views_region_path_byte_exact(engine):
    """The region path: each pair's wire block packed on the prefill host, one descriptor per
    window into the decode rank's receive region (small: several windows), placed there through
    its layout (`StreamView.unpack`)."""
    p, d, tokens = _CASES[0][0], _CASES[0][1], 150
    if engine != "nixl":
        p, d, tokens = _CASES[1]  # fewest ranks: Mooncake starts each engine in about 0.5 s
    stats = _run_pair(engine, p, d, tokens, mode="region", receiver_kw=dict(region_bytes=4096))
    for st in stats:
        # The block is packed on the host, then asked for before the round's synchronisation, as any
        # region push: each window's ask before its packed, its post after both.
        asked = check_region_timeline(st["timeline"])
        for key, v in st["ranks"].items():
            assert v["path"] == ("region" if v["bytes"] else "none")  # a pair sharing no head: nothing moves
            if v["bytes"]:  # one descriptor per window, a window at most the region's 4,096 bytes
                assert v["descriptors"] == v["batches"] >= -(-v["bytes"] // 4096)
                assert asked[key] == v["descriptors"]


def test_view_pieces_hand_cases():
    # 8 heads, prefill TP 2 (4 each) -> decode TP 4 (2 each): decode rank 3 takes heads 2-3 of prefill rank 1.
    p, d = _gqa(16, tp_size=2, heads=8), _gqa(64, tp_size=4, heads=8, layout="hnd")
    v = stream_view(spec_of(p, 0, 1, 1), spec_of(d, 0, 3, 1), 4, 4)
    assert v.pieces.tolist() == [[2, 0, 2]]
    assert stream_view(spec_of(p, 0, 0, 1), spec_of(d, 0, 3, 1), 4, 4).pieces.tolist() == []
    # MLA over TP 2 -> 3: decode rank t takes the latent from prefill rank t % 2 only.
    pm, dm = _mla(4, tp_size=2), _mla(8, tp_size=3, layout="tpu_mla")
    assert [len(stream_view(spec_of(pm, 0, s, 1), spec_of(dm, 0, 2, 1), 4, 4).pieces) for s in (0, 1)] == [1, 0]
    # NHD -> HND: one descriptor per token, head and plane (a head's rows are strided in NHD).
    v = stream_view(spec_of(_gqa(4), 0, 0, 1), spec_of(_gqa(4, layout="hnd"), 0, 0, 1), 4, 4)
    d = v.descriptors(np.arange(3), np.arange(3), [0], [1 << 20])
    assert len(d) == 3 * 4 * 2 and set(d[:, 2].tolist()) == {16}
    # HND -> HND over TP 1 -> 2: a head's 3 tokens are contiguous on both sides: one per head and plane.
    v = stream_view(spec_of(_gqa(4, layout="hnd"), 0, 0, 1), spec_of(_gqa(4, tp_size=2, layout="hnd"), 0, 1, 1), 4, 4)
    d = v.descriptors(np.arange(3), np.arange(3), [0], [1 << 20])
    # HND byte offset of (plane k, page 0, head h, slot 0) = ((k * pages * H + h) * P) * D * 2, pages = 4.
    assert d.tolist() == [[(k * 16 + 2 + h) * 64, (1 << 20) + (k * 8 + h) * 64, 48]
                          for k in range(2) for h in range(2)]


def test_view_handshake_refusals():
    p = spec_of(_gqa(16, tp_size=2), 0, 0, 2)
    with pytest.raises(HandshakeError, match="head_dim"):
        check_compatible(p, spec_of(HeteroSide(16, 1, 1, 1, "hnd", 4, 16, "bfloat16"), 0, 0, 2))
    with pytest.raises(HandshakeError, match="dtype"):
        check_compatible(p, spec_of(HeteroSide(16, 1, 1, 1, "hnd", 4, 8, "float16"), 0, 0, 2))
    bad = spec_of(_gqa(16, layout="hnd"), 0, 0, 2)
    bad = type(bad)(**{**bad.to_dict(), "item_lens": (64, 64)})
    with pytest.raises(HandshakeError, match=r"item_lens\[0\]=64.*128 bytes per token"):
        check_compatible(p, bad)


@pytest.mark.parametrize("engine", ENGINES[:1])
def test_view_pair_refuses_pack_paths_and_pulls(engine):
    p, d = _gqa(16, tp_size=2), _gqa(16, layout="hnd")
    kv = fill_side(p, 0, 0, 2, LAYERS, 16, np.arange(1), 0)
    dkv = [_sentinel(cache_shape(d.geometry(0, 2)), np.uint16) for _ in range(LAYERS)]
    with KVSender(spec_of(p, 0, 0, LAYERS), kv, engine=engine, mode="packed") as s, \
            KVReceiver(spec_of(d, 0, 0, LAYERS), dkv, engine=engine) as r:
        with pytest.raises(HandshakeError, match="path"):
            r.connect(s.address)
    with KVSender(spec_of(p, 0, 0, LAYERS), kv, engine=engine) as s, \
            KVReceiver(spec_of(d, 0, 0, LAYERS), dkv, engine=engine, direction="pull") as r:
        with pytest.raises(HandshakeError, match="direction"):
            r.connect(s.address)


def test_uncovered_heads_hand_cases():
    def gaps(p, d, dk, pks):
        return uncovered_heads(spec_of(d, dk[0], dk[1], 1), tuple(spec_of(p, r, t, 1) for r, t in pks))

    # 4 heads, prefill TP 2 (2 each) -> decode TP 1: tp rank 0 alone leaves heads 2-3 (sent by tp rank 1).
    p, d = _gqa(16, tp_size=2), _gqa(16)
    assert gaps(p, d, (0, 0), [(0, 0)]) == ((0, 2, 4, (1,)),)
    assert gaps(p, d, (0, 0), [(0, 0), (0, 1)]) == ()
    # Equal TP, one head shard each: the 1:1 pairing covers every rank.
    assert [gaps(_gqa(16, tp_size=2), _gqa(8, tp_size=2, layout="hnd"), (0, t), [(0, t)]) for t in (0, 1)] == [(), ()]
    # 2 heads replicated over TP 4 on both sides: only the lowest prefill rank holding a head sends it,
    # so 1:1 leaves decode tp ranks 1 and 3 without their head (a SUCCESS with sentinel heads before).
    p, d = _gqa(16, tp_size=4, heads=2), _gqa(16, tp_size=4, heads=2)
    assert [gaps(p, d, (0, t), [(0, t)]) for t in range(4)] == [(), ((0, 0, 1, (0,)),), (), ((0, 1, 2, (2,)),)]
    # MLA TP 2 -> 3: the latent of decode tp rank t comes from prefill tp rank t % 2 only.
    p, d = _mla(4, tp_size=2), _mla(8, tp_size=3, layout="tpu_mla")
    assert [[gaps(p, d, (0, t), [(0, s)]) for s in (0, 1)] for t in range(3)] == [
        [(), ((0, 0, 1, (0,)),)], [((0, 0, 1, (1,)),), ()], [(), ((0, 0, 1, (0,)),)]]
    # Prefill DCP 2 x TP 2, 8 heads -> decode TP 4: decode tp rank 3 (heads 6-7) has prefill (0, 1) but
    # only (1, 0) of DCP rank 1, which holds heads 0-3: DCP rank 1's heads 6-7 are missing.
    p, d = _gqa(16, 2, 1, tp_size=2, heads=8), _gqa(16, tp_size=4, heads=8)
    assert gaps(p, d, (0, 3), [(0, 1), (1, 0)]) == ((1, 6, 8, (1,)),)
    # Rows moved whole (no TP, one layout): nothing to check beyond the DCP ranks.
    assert gaps(_mla(4), _mla(8), (0, 0), [(0, 0)]) == ()


def test_served_group_ranks_hand_cases():
    def served(p, d, t):
        return sorted(served_group_ranks(spec_of(p, 0, t, 1), spec_of(d, 0, 0, 1)))

    # Equal TP, 2 heads each: prefill tp rank t moves only to decode tp rank t.
    assert [served(_gqa(16, tp_size=2), _gqa(8, tp_size=2, layout="hnd"), t) for t in (0, 1)] == [[0], [1]]
    # 2 heads replicated over TP 4: head 0 from prefill tp 0 (decode tp 0, 1), head 1 from tp 2.
    p = d = _gqa(16, tp_size=4, heads=2)
    assert [served(p, d, t) for t in range(4)] == [[0, 1], [], [2, 3], []]
    # MLA TP 2 -> TP 3 x DCP 2 (group rank tp * 2 + dcp): the latent of decode tp t from prefill t % 2.
    p, d = _mla(4, tp_size=2), _mla(8, 2, 1, tp_size=3, layout="tpu_mla")
    assert [served(p, d, t) for t in (0, 1)] == [[0, 1, 4, 5], [2, 3]]
    # Whole rows (no TP, one layout): every decode rank.
    assert served(_mla(4), _mla(8, 4), 0) == [0, 1, 2, 3]


@pytest.mark.parametrize("engine", ENGINES)
def test_expect_refuses_a_rank_whose_heads_no_connected_sender_moves(engine):
    # A decode TP 1 rank (4 heads) connected to prefill TP rank 0 of 2 only. Before: SUCCESS with
    # heads 2-3 of every token left as sentinel bytes.
    p, d = _gqa(16, tp_size=2), _gqa(16)
    kv = [fill_side(p, 0, t, 2, LAYERS, 16, np.arange(1), t) for t in range(2)]
    dkv = [_sentinel(cache_shape(d.geometry(0, 2)), np.uint16) for _ in range(LAYERS)]
    with KVSender(spec_of(p, 0, 0, LAYERS), kv[0], engine=engine) as s0, \
            KVSender(spec_of(p, 0, 1, LAYERS), kv[1], engine=engine) as s1, \
            KVReceiver(spec_of(d, 0, 0, LAYERS), dkv, engine=engine) as r:
        r.connect(s0.address)
        with pytest.raises(RuntimeError, match=r"prefill dcp_rank 0: heads \[2, 4\) not covered \(sent by prefill "
                                               r"tp_rank\(s\) \[1\]\)"):
            r.expect("q", np.arange(1), 16)
        r.connect(s1.address)
        r.expect("q", np.arange(1), 16)  # every head connected: accepted


@pytest.mark.parametrize("engine", ENGINES[:1])
def test_one_to_one_head_shards_are_accepted_and_land(engine):
    """Decode TP rank t connected only to prefill TP rank t (equal head shards, as the vLLM adapter
    pairs them): expect() accepts it, every decode rank lands byte-exact, and every sender ends
    SUCCESS (it waits only for the ranks it moves bytes to; it used to time out waiting for the
    whole decode group)."""
    _run_pair(engine, _gqa(16, tp_size=2), _gqa(8, 2, 1, tp_size=2, layout="hnd"), 40,
              links=lambda dk, pk: dk[1] == pk[1])
