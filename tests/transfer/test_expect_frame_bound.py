"""One ``expect`` carries a rank's whole page table in one control frame of at most 16 MiB.

A fresh-user trial (2026-12-06) found three faults at that bound: a table past it raised from
`KVReceiver.expect` only after the request and its pages were held (the id then refused, the
request FAILED after ``timeout_s``); a table of exactly 16 MiB passed the field check but the frame
(table + envelope) did not, so the sender refused it and both sides waited out their timeouts;
and the job took such sizes and failed only after starting its processes. Now the field bound
leaves room for the envelope (`MAX_FIELD_BYTES`), `encode` refuses any frame the peer would,
`expect` checks the pages (`MAX_EXPECT_PAGES`) before holding anything, and the job refuses the
sizes up front.
"""
import msgpack
import numpy as np
import pytest

from conftest import Cluster
from dcp_jax.job.config import JobConfig
from dcp_jax.transfer import TransferStatus
from dcp_jax.transfer import protocol as proto

LONGEST_RID = "r" * proto.MAX_REQUEST_ID


def _expect(rid, table_bytes):
    return proto.encode("expect", rid, (1 << 62), num_tokens=1 << 40, prefix_tokens=1 << 39,
                        page_table=table_bytes, dcp_rank=1 << 20)


def test_the_largest_page_table_with_the_longest_id_makes_a_frame_the_peer_takes():
    frame = _expect(LONGEST_RID, b"\x01" * proto.MAX_FIELD_BYTES)
    assert len(frame) <= proto.MAX_CONTROL_BYTES
    assert len(proto.decode(frame)["page_table"]) == proto.MAX_FIELD_BYTES
    assert proto.MAX_EXPECT_PAGES == (16 * 2**20 - 4096) // 8 == 2_096_640


def test_a_page_table_past_the_field_bound_is_refused_in_bytes_on_both_sides():
    big = b"\x01" * (proto.MAX_FIELD_BYTES + 8)
    want = rf"^expect\.page_table has {proto.MAX_FIELD_BYTES + 8} bytes, at most {proto.MAX_FIELD_BYTES}$"
    with pytest.raises(proto.ProtocolError, match=want):
        _expect("a", big)
    # The same from a peer: refused by the schema, within the frame limit.
    raw = msgpack.packb({"v": proto.PROTOCOL_VERSION, "k": "expect", "rid": "a", "inc": 1, "num_tokens": 1,
                         "prefix_tokens": 0, "page_table": big, "dcp_rank": 0}, use_bin_type=True)
    assert len(raw) <= proto.MAX_CONTROL_BYTES
    with pytest.raises(proto.ProtocolError, match=want):
        proto.decode(raw)


def test_encode_refuses_a_frame_longer_than_the_peer_accepts(monkeypatch):
    monkeypatch.setattr(proto, "MAX_CONTROL_BYTES", 1000)
    with pytest.raises(proto.ProtocolError, match=r"^expect: message of \d+ bytes exceeds the limit of 1000$"):
        _expect("a", b"\x01" * 2000)


@pytest.mark.parametrize("page_size", [1, 64])
def test_check_expect_pages_at_the_bound(page_size):
    most = proto.MAX_EXPECT_PAGES * page_size
    proto.check_expect_pages(most, page_size, most)  # exactly the bound: fine
    with pytest.raises(ValueError, match=rf"^num_tokens={most + 1:,}: a decode rank's {most + 1:,} local rows "
                                         rf"fill {proto.MAX_EXPECT_PAGES + 1:,} pages of page_size={page_size}, "
                                         rf"and one expect announces at most {proto.MAX_EXPECT_PAGES:,}"):
        proto.check_expect_pages(most + 1, page_size, most + 1)


def test_an_expect_past_the_bound_holds_nothing_and_the_id_stays_free():
    c = Cluster("nixl", dcp_size=1, item_lens=(8,), page_size=1, pages=64, seed=12)
    try:
        rv = c.receivers[0]
        n = proto.MAX_EXPECT_PAGES + 1
        before = rv.stats
        with pytest.raises(ValueError, match=rf"^num_tokens={n:,}: .* at most {proto.MAX_EXPECT_PAGES:,} "):
            rv.expect("h", np.arange(n), n)
        after = rv.stats
        assert (after["requests"], after["live_requests"]) == (before["requests"], before["live_requests"])
        with pytest.raises(KeyError, match="not known"):
            rv.poll("h")
        # The id and the pages are free: the same id goes through, byte-exact.
        c.round_trip("h", 10)
    finally:
        c.close()


@pytest.mark.parametrize("tokens, page_size, dcp_size, ok", [
    (2_096_640, 1, 1, True), (2_096_641, 1, 1, False), (2_200_000, 1, 2, True), (4_194_304, 1, 2, False),
    (4_194_304, 2, 1, False), (4_194_304, 4, 1, True)])
def test_the_job_refuses_a_size_no_expect_can_announce_before_starting(tokens, page_size, dcp_size, ok):
    kw = dict(model="tiny", prompt_tokens=tokens, page_size=page_size, dcp_size=dcp_size)
    if ok:
        JobConfig(**kw)
        return
    with pytest.raises(ValueError, match=r"^prompt_tokens=[\d,]+: .* \(--prompt-tokens, --page-size, --dcp-size\)$"):
        JobConfig(**kw)


def test_a_direct_chunk_past_one_pull_frame_is_planned_in_windows_that_fit():
    from dcp_jax.transfer.rank_chunk import plan_rank_chunk
    from dcp_jax.transfer.schedule import SideLayout

    n, m = proto.MAX_PULL_ROWS + 5, proto.MAX_PULL_ROWS
    side = SideLayout(page_size=1, dcp_size=1, dcp_rank=0, interleave_size=1)
    table = np.arange(n)

    def windows(stop, mode="direct", **kw):
        return plan_rank_chunk(0, 0, stop, src=side, dst=side, src_page_table=table, dst_page_table=table,
                               mode=mode, check_tables=False, **kw).windows

    assert windows(n) == ((0, m), (m, n))
    assert windows(n, max_batch_indices=10**7) == ((0, m), (m, n))
    assert windows(100, max_batch_indices=30) == ((0, 30), (30, 60), (60, 90), (90, 100))
    assert windows(n, mode="packed") == ((0, n),)  # a packed pull names no rows: one window


def test_a_pull_of_more_rows_than_one_frame_names_arrives_byte_exact():
    # Before: FAILED "pull_ready.src_rows has 17600000 bytes, at most ..." (one window of 2.2M rows).
    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender

    n, page = proto.MAX_PULL_ROWS + 100_000, 4
    pages = -(-n // page)
    src = [np.random.default_rng().integers(0, 256, (pages, page, 8), dtype=np.uint8)]
    dst = [np.zeros((pages, page, 8), np.uint8)]
    with KVSender(KVCacheSpec(1, [8], page), src, engine="nixl", mode="direct", timeout_s=20) as s, \
            KVReceiver(KVCacheSpec(1, [8], page), dst, engine="nixl", direction="pull", timeout_s=20) as r:
        r.connect(s.address)
        r.expect("big", np.arange(pages), n)
        s.send("big", np.arange(pages), 0, n)
        assert r.wait("big", 60) is TransferStatus.SUCCESS, r.failure_reason("big")
        assert s.wait("big", 60) is TransferStatus.SUCCESS, s.failure_reason("big")
        assert s.request_stats("big")["ranks"][0]["batches"] == 2
        np.testing.assert_array_equal(dst[0].reshape(-1, 8)[:n], src[0].reshape(-1, 8)[:n])
