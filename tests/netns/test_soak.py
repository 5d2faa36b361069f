"""The CI soak: ``dcp-jax load --netns`` for a bounded time with random link flaps, stopped
receivers and a stopped sender (longer than the peer timeout: the late-write case); NIXL. The
long NIXL and Mooncake runs are in benchmarks/results/soak_*."""
import json

import pytest

from dcp_jax.loadgen import LoadConfig, load_command


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_across_two_hosts_with_faults(tmp_path, nixl_only):
    # duration_s bounds the run, not requests: 3,000 requests ended at ~16 s on a quiet machine
    # (182 requests/s), before the third fault.
    cfg = LoadConfig(engine=nixl_only, netns=True, requests=100_000, duration_s=30.0, concurrency=16,
                     max_tokens=128, warmup=8, faults="link_flap,pause,sender_pause", fault_every_s=4.0, timeout_s=2.0,
                     peer_timeout_s=5.0, seed=7)  # seed 7: all three kinds of fault in 30 s
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    rc = load_command(cfg, out, progress=False, plot_path=png)
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["ok"], rep["failures"]
    assert len(rep["faults"]) >= 3 and {f["kind"] for f in rep["faults"]} == {"link_flap", "pause", "sender_pause"}
    assert rep["issued"] == rep["finished"] > 50 and rep["lost"] == 0
    assert rep["succeeded"] > 0 and rep["succeeded"] + rep["failed"] + rep["aborted"] == rep["finished"]
    assert rep["misattributed_messages"] == 0 and rep["sentinel_violations"] == 0
    assert rep["succeeded_wrong_bytes"] == 0 and rep["source_rows_corrupted"] == 0
    assert rep["bytes_verified"] > 0
    assert rep["registered_bytes_after_close"] == rep["registered_bytes_before"] == 0
    assert rep["rss_growth_bytes"] < 100 << 20
    samples = rep["samples"]
    assert set(samples) == {"orchestrator", "sender", "receiver0", "receiver1"}
    assert all(len(v) >= 10 for v in samples.values())
    assert all(reg > 0 for _, _, reg in samples["sender"][2:-2])  # registered while the run lives
    assert png.stat().st_size > 10_000
