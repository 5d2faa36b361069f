"""`Tally` (dcp_jax.loadgen.tally): finished requests folded into the report's counts as they
finish, hand-computed, and nothing per request kept but the measured latencies."""
from types import SimpleNamespace

from dcp_jax.loadgen.config import AbortPlan, RequestPlan
from dcp_jax.loadgen.tally import MAX_EXAMPLES, Tally

ROW = 100  # bytes per token


def _track(index, statuses, *, abort=None, phase="main", rows=(4, 3), lat=(0.010, 0.030), drain=0.0,
           bad_rows=0, reason=""):
    plan = RequestPlan(index=index, rid=f"r{index}", num_tokens=sum(rows), chunks=((0, sum(rows)),),
                       seed=index, abort=abort)
    sender = dict(status=statuses[0], reason=reason, transfer_s=0.005, drain_s=drain)
    recv = [dict(status=s, reason="", rows=n, latency_s=l, bad_rows=bad_rows, drain_s=drain / 2)
            for s, n, l in zip(statuses[1:], rows, lat)]
    return SimpleNamespace(plan=plan, phase=phase, sender=sender, recv=recv)


def test_counts_bytes_and_latencies_hand_computed():
    t = Tally(ROW, faulty=False, measure_all=False)
    t.add(_track(0, ["success"] * 3))
    t.add(_track(1, ["success"] * 3, phase="warmup", lat=(0.5, 0.5)))  # counted, not measured
    t.add(_track(2, ["aborted"] * 3, abort=AbortPlan(by=-1, point="before_send"), drain=0.004))
    t.add(_track(3, ["aborted"] * 3, abort=AbortPlan(by=1, point="before_send"), drain=0.002))
    assert t.finished == 4 and t.counts == dict(succeeded=2, aborted=2, failed=0)
    assert t.by_side == {"sender": 1, "receiver": 1}
    assert t.expected_bytes == 2 * 7 * ROW  # two succeeded requests, 4 + 3 rows each
    assert t.main_n == 3 and t.main_bytes == 7 * ROW  # the warm-up one is not measured
    assert list(t.main_lat) == [0.030] and list(t.main_xfer) == [0.005]  # the slowest rank's latency
    assert t.drain_max_s == 0.004
    assert t.wrong_count == 0 and t.misattrib == 0


def test_wrong_requests_are_counted_and_only_the_first_examples_kept():
    t = Tally(ROW, faulty=False, measure_all=True)
    n = MAX_EXAMPLES + 5
    for i in range(n):
        t.add(_track(i, ["failed", "success", "failed"], reason=f"why {i}"))
    assert t.counts["failed"] == n and t.wrong_count == n and len(t.wrong) == MAX_EXAMPLES
    assert t.wrong[0] == (0, "normal", ["failed", "success", "failed"], "why 0")
    # under faults a FAILED request is allowed; a SUCCESS rank with wrong bytes never is
    f = Tally(ROW, faulty=True, measure_all=False)
    f.add(_track(0, ["failed", "success", "failed"]))
    assert f.wrong_count == 0 and f.expected_bytes == 4 * ROW  # the SUCCESS rank's rows were checked
    f.add(_track(1, ["success"] * 3, bad_rows=2))
    assert f.wrong_count == 1 and f.bad_success == 2 and f.misattrib == 2
    # a planned abort that a side reported SUCCESS for is misattributed (under faults its
    # mixed outcome counts as failed, allowed; the misattribution check catches it)
    f.add(_track(2, ["aborted", "success", "aborted"], abort=AbortPlan(by=0, point="before_send")))
    assert f.misattrib == 3 and f.wrong_count == 1 and f.counts["failed"] == 2
