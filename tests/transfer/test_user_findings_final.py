"""Findings of the final fresh-user trial of 2026-12-05, each a case that failed before its fix."""
import time

import numpy as np
import pytest

from conftest import ENGINES
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus as S


@pytest.mark.parametrize("engine", ENGINES)
def test_an_abort_on_one_prefill_rank_never_ends_another_side_failed_in_pull(engine):
    """Prefill DCP 2 -> decode DCP 2, pull: a decode rank that ends a request on prefill rank 0's
    abort passes the abort on to prefill rank 1, and answers rank 1's late ``pull_ready`` with
    "request not live here". The answer left before the abort (it was sent at once, the abort
    queued to the round's end), so prefill rank 1 ended FAILED "reader: request not live here"
    (16-21 of 60 runs of the trial's loop). Every side now ends ABORTED, or SUCCESS where it had
    everything before the abort."""
    m = n = 2
    page, item_lens, pages, tokens = 4, (48, 16), 256, 64
    rng = np.random.default_rng()
    senders = [KVSender(KVCacheSpec(2, item_lens, page, m, r), [rng.integers(0, 256, (pages, page, il), np.uint8)
                                                               for il in item_lens],
                        engine=engine, mode="direct", timeout_s=10) for r in range(m)]
    recvs = [KVReceiver(KVCacheSpec(2, item_lens, page, n, r), [np.zeros((pages, page, il), np.uint8)
                                                               for il in item_lens],
                        engine=engine, direction="pull", timeout_s=10) for r in range(n)]
    try:
        for rc in recvs:
            for s in senders:
                rc.connect(s.address)
        seen = set()
        for k in range(40):
            rid = f"r{k}"
            table = np.arange(8) + (k % 30) * 8
            for rc in recvs:
                rc.expect(rid, table, tokens)
            for s in senders:
                s.send(rid, table, 0, tokens)
            aborted = senders[0].abort(rid, "my abort")  # False: its part had ended SUCCESS first
            sides = senders + recvs
            st = [x.wait(rid, 15) for x in sides]
            reasons = [x.failure_reason(rid) for x in sides]
            assert S.FAILED not in st, (rid, st, reasons)
            assert st[0] is (S.ABORTED if aborted else S.SUCCESS), (rid, st, reasons)
            assert all(x in (S.ABORTED, S.SUCCESS) for x in st), (rid, st, reasons)
            seen.add(tuple(st))
            for x in sides:
                x.release(rid)
            for rc in recvs:  # the pages come back once drained: the next use may take them
                for _ in range(2000):
                    if not rc._page_owner:
                        break
                    time.sleep(0.005)
        assert (S.ABORTED,) * 4 in seen  # the abort did cross mid-transfer at least once
    finally:
        for x in recvs + senders:
            x.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_second_decode_group_announcing_a_live_id_is_refused_at_once(engine):
    """Two decode groups on one sender announce the same request id: the first group's request is
    served byte-exact; the second's ranks were dropped with only a log line and failed after their
    own timeout_s with "no progress" (5 s here). They are now told at once why, naming the group
    that holds the id (whichever announced first), and nothing is written into their pages."""
    page, item_lens, pages, tokens = 4, (48, 16), 64, 24
    rng = np.random.default_rng()
    src = [rng.integers(0, 256, (pages, page, il), np.uint8) for il in item_lens]
    sender = KVSender(KVCacheSpec(2, item_lens, page), src, engine=engine, timeout_s=5)
    groups, kv = {}, {}
    try:
        for g in ("A", "B"):
            kv[g] = [[np.zeros((pages, page, il), np.uint8) for il in item_lens] for _ in range(2)]
            groups[g] = [KVReceiver(KVCacheSpec(2, item_lens, page, 2, r), kv[g][r], engine=engine, group=g,
                                    timeout_s=5) for r in range(2)]
            for rc in groups[g]:
                rc.connect(sender.address)
        src_table = np.arange(6) + 40
        for g in ("A", "B"):
            for r, rc in enumerate(groups[g]):
                rc.expect("x", np.arange(3) + 10 * r, tokens)
        sender.send("x", src_table, 0, tokens)
        t0 = time.monotonic()
        # Whichever group's announcement reached the sender first holds the id (two sockets race).
        st = {g: [rc.wait("x", 4) for rc in groups[g]] for g in ("A", "B")}
        won = "A" if st["A"][0] is S.SUCCESS else "B"
        lost = "B" if won == "A" else "A"
        assert st[won] == [S.SUCCESS] * 2 and st[lost] == [S.FAILED] * 2, st
        assert time.monotonic() - t0 < 3.0  # told, not its own 5 s timeout
        for rc in groups[lost]:
            assert f"taken on this prefill sender by decode group {won!r}" in rc.failure_reason("x")
            deadline = time.monotonic() + 3
            while not rc.is_drained("x") and time.monotonic() < deadline:  # "drained" follows "failed"
                time.sleep(0.005)
            assert rc.is_drained("x")
        assert sender.wait("x", 5) is S.SUCCESS
        for r in range(2):  # the holder byte-exact (token t -> rank t % 2, local row t // 2); the other untouched
            for t in range(r, tokens, 2):
                j, (sp, so) = t // 2, divmod(t, page)
                for layer in range(2):
                    np.testing.assert_array_equal(kv[won][r][layer][10 * r + j // page, j % page],
                                                  src[layer][src_table[sp], so])
            assert all((layer == 0).all() for layer in kv[lost][r])
    finally:
        for g in groups.values():
            for rc in g:
                rc.close()
        sender.close()
