"""`Tally`: the load generator's finished requests folded into counts as each one finishes.

Why not keep the requests: the orchestrator used to hold every finished request's per-side
results (~2.3 KiB a request) until the report, so its RSS grew 237 MiB over a 10-minute NIXL soak
(103,055 requests) and the run's RSS check (meant for the connector processes) failed on the
harness's own records. What is kept per request now is one latency and one transfer time (16
bytes in two `array('d')`, for the exact percentiles) of the measured phase's succeeded
requests; the wrong ones are counted and the first `MAX_EXAMPLES` kept as examples.
"""
from __future__ import annotations

from array import array

__all__ = ["Tally", "MAX_EXAMPLES"]

#: Requests that ended wrong, kept as examples for the report (all of them are counted).
MAX_EXAMPLES = 10


class Tally:
    """Counts over finished requests. ``add(track)`` takes one finished request (its plan,
    phase, the sender's and every rank's result dicts); the attributes are what
    `dcp_jax.loadgen.report.summarize` reports. ``faulty``: faults are injected, so FAILED
    requests are allowed (counted, not wrong)."""

    def __init__(self, row_bytes: int, faulty: bool, measure_all: bool):
        self.row_bytes, self.faulty, self.measure_all = row_bytes, faulty, measure_all
        self.finished = 0
        self.counts = dict(succeeded=0, aborted=0, failed=0)
        self.bad_success = self.misattrib = self.src_bad = 0
        self.wrong: list[tuple] = []  # the first MAX_EXAMPLES
        self.wrong_count = 0
        self.by_side = {"sender": 0, "receiver": 0}
        self.main_lat = array("d")  # seconds; 8 bytes each (a list of floats took 32)
        self.main_xfer = array("d")
        self.main_n = self.main_bytes = self.expected_bytes = 0
        self.drain_max_s: float | None = None

    def _wrong(self, example: tuple) -> None:
        self.wrong_count += 1
        if len(self.wrong) < MAX_EXAMPLES:
            self.wrong.append(example)

    def add(self, t) -> None:
        """Folds in finished request ``t`` (``plan``, ``phase``, ``sender``, ``recv``)."""
        self.finished += 1
        statuses = [t.sender["status"]] + [r["status"] for r in t.recv]
        ok_all = all(s == "success" for s in statuses)
        outcome = "succeeded" if ok_all else "aborted" if all(s == "aborted" for s in statuses) else "failed"
        self.counts[outcome] += 1
        self.src_bad += t.sender.get("src_bad_rows", 0)
        bad_ranks = sum(1 for r in t.recv if r["status"] == "success" and r.get("bad_rows", 0))
        self.bad_success += bad_ranks
        self.misattrib += bad_ranks
        if t.plan.abort is not None:
            self.by_side["sender" if t.plan.abort.by < 0 else "receiver"] += 1
            self.misattrib += sum(1 for s in statuses if s == "success")
            if outcome != "aborted" and not (self.faulty and outcome == "failed"):
                self._wrong((t.plan.index, "planned abort", statuses, t.sender["reason"]))
        elif (outcome != "succeeded" and not (self.faulty and outcome == "failed")) or bad_ranks \
                or t.sender.get("src_bad_rows", 0):
            self._wrong((t.plan.index, "normal", statuses,
                         t.sender["reason"] or next((r["reason"] for r in t.recv if r["reason"]), "")))
        if not ok_all:
            drain = max([t.sender.get("drain_s", 0.0)] + [r.get("drain_s", 0.0) for r in t.recv])
            self.drain_max_s = drain if self.drain_max_s is None else max(self.drain_max_s, drain)
        # Every rank that said SUCCESS had its rows compared (under faults the sides may
        # disagree: a rank can land everything while the sender timed out waiting).
        self.expected_bytes += sum(r["rows"] * self.row_bytes for r in t.recv if r["status"] == "success")
        if t.phase == "main" or self.measure_all:
            self.main_n += 1
            if ok_all:
                self.main_bytes += t.plan.num_tokens * self.row_bytes
                lat = [r["latency_s"] for r in t.recv]
                if None not in lat:
                    self.main_lat.append(max(lat))
                if t.sender.get("transfer_s") is not None:
                    self.main_xfer.append(t.sender["transfer_s"])
