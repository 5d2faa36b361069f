"""The ranks of one decode group announce one request alike: the same ``num_tokens`` and
``prefix_tokens`` (a prefix-cache hit is the group's). A rank that says otherwise fails the
request at once on every side, naming both announcements; before, the rank whose tokens were
never sent, and the sender, failed only at ``timeout_s`` with "tokens [a, b) have not landed"."""
import time

from conftest import Cluster, TransferStatus, announced, wait_for

S = TransferStatus
LONG = 30.0  # far past the test's bounds: only the announcement check can end it in time


CASES = [  # (rid, each rank's num_tokens, each rank's prefix_tokens)
    ("len", (24, 24, 36), (0, 0, 0)),  # rank 2 says 36 tokens
    ("prefix", (24, 24, 24), (0, 12, 0)),  # rank 1 says it holds a 12-token prefix
]


def test_ranks_that_announce_one_request_differently_fail_it_at_once(engine):
    c = Cluster(engine, dcp_size=3, timeout_s=LONG, peer_timeout_s=LONG)
    try:
        for rid, lengths, prefixes in CASES:
            src, dst = c.tables(max(lengths))
            t0 = time.monotonic()
            for r, recv in enumerate(c.receivers):  # each rank's table as long as its own claim
                recv.expect(rid, dst[r][:-(-lengths[r] // 3 // c.page_size)], lengths[r], prefix_tokens=prefixes[r])
            assert wait_for(lambda: announced(c.sender, rid), 10)  # (poll raises KeyError before)
            assert all(s.terminal for s in c.wait(rid, 10)), c.reasons(rid)
            assert time.monotonic() - t0 < 10 < LONG
            assert c.sender.poll(rid) is S.FAILED
            reason = c.sender.failure_reason(rid)
            assert f"announced request {rid!r} differently" in reason, reason
            odd = next(r for r in range(3) if (lengths[r], prefixes[r]) != (lengths[0], prefixes[0]))
            assert f"rank {odd} num_tokens={lengths[odd]} prefix_tokens={prefixes[odd]}" in reason, reason
            for r in c.receivers:
                assert r.poll(rid) is S.FAILED and "differently" in r.failure_reason(rid), r.failure_reason(rid)
            # The group serves on: a request announced alike lands byte-exact.
            c.round_trip(f"{rid}-after", 20)
    finally:
        c.close()
