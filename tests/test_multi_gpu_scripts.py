"""Issue 18's scripts on CPU: the merge across a mesh (8 CPU devices), --peer parsing, the placement
rule of scripts/multi_gpu.sh, and both summaries on a sample output folder."""
import importlib.util
import json
import math
import os

import jax
import pytest

from dcp_jax.job.gpus import host_placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(rel: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(rel)[:-3], os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _module("benchmarks/multi_gpu_merge.py")
d2d = _module("benchmarks/d2d_ceiling.py")
mg_summary = _module("scripts/multi_gpu_summary.py")
suite_summary = _module("scripts/gpu_suite_summary.py")


def test_host_placement_rule():
    assert host_placement(1, 8) == ("0", "0")  # the rehearsal: all on GPU 0
    assert host_placement(2, 8) == ("0", "1-1")
    assert host_placement(4, 8) == ("0", "1-3")
    assert host_placement(8, 8) == ("0", "0-7")  # one decode rank per GPU, GPU 0 shared with the prefill
    assert host_placement(8, 4) == ("0", "0-7")
    with pytest.raises(ValueError):
        host_placement(0, 8)


def test_mesh_size():
    assert [bench.mesh_size(g, 128) for g in (1, 2, 3, 4, 6, 7, 8)] == [1, 2, 2, 4, 4, 4, 8]
    assert bench.mesh_size(8, 12) == 6
    with pytest.raises(ValueError):
        bench.mesh_size(0, 128)


def test_merge_over_8_cpu_devices_equals_single_device():
    assert len(jax.devices()) >= 8, "tests/conftest.py gives 8 CPU devices"
    res = bench.run(8, batch=2, kv_len=200, heads=16, page_size=16, forms=("ag_rs", "ag_ar", "a2a"), iters=1, reps=1,
                    emulate=4)
    assert [r["combine"] for r in res["rows"]] == ["ag_rs", "ag_ar", "a2a"]
    assert res["all_equal"]
    for r in res["rows"]:
        assert r["devices"] == 8 and r["step_rel_err"] < 1e-5 and r["merge_rel_err"] < 1e-5 and r["step_us"] > 0
    assert res["emulated"]["step_equal"] and res["emulated"]["ranks"] == 4
    assert res["shape"]["kv_lens"] == [66, 200]


def test_merge_check_catches_a_wrong_combine(monkeypatch):
    real = bench.merge.a2a
    monkeypatch.setattr(bench.merge, "a2a", lambda out, lse, mesh: (real(out, lse, mesh=mesh)[0] * 1.001, None))
    res = bench.run(2, batch=1, kv_len=32, heads=4, page_size=8, forms=("a2a",), iters=1, reps=1)
    assert not res["all_equal"] and not res["rows"][0]["merge_equal"] and res["rows"][0]["step_equal"]


def test_parse_peer():
    assert d2d.parse_peer("0,1") == (0, [1])
    assert d2d.parse_peer("0,1,2,3") == (0, [1, 2, 3])
    assert d2d.parse_peer("0,0") == (0, [0])
    for bad in ("0", "0,x", "0,1,1", "-1,2", ""):
        with pytest.raises(ValueError, match="--peer"):
            d2d.parse_peer(bad)


def _sample(out):
    """A multi_gpu.sh output folder: 2 GPUs, NIXL packed verified, region failed, merge equal."""
    os.makedirs(out)
    with open(os.path.join(out, "mg_steps.tsv"), "w") as f:
        f.write("peer\t0\t3\njob_nixl\t1\t40\nmerge\t0\t12\n")
    with open(os.path.join(out, "mg_gpus.txt"), "w") as f:
        f.write("GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n")
    json.dump({"gpus": 2, "dcp_size": 8, "prefill_gpus": "0", "decode_gpus": "1-1", "decode_gpus_used": [1],
               "peer_access_from_0": {"1": True}, "fused_allowed": True}, open(os.path.join(out, "mg_placement.json"), "w"))
    row = {"model": "deepseek-v3", "prompt_tokens": 8192, "bytes": 1_000_000_000, "exact": True}
    json.dump({"rows": [dict(row, what="cudaMemcpyAsync, 1 stream", gbps=2000.0),
                        dict(row, what="cudaMemcpyPeerAsync GPU 0 -> GPU 1", gbps=400.0,
                             peer={"src": 0, "dst": [1], "peer_access": [True], "same_device": False})]},
              open(os.path.join(out, "mg_peer.json"), "w"))
    ranks = [{"dcp_rank": r, "gpu": 1} for r in range(8)]
    placement = [{"process": "prefill 0", "gpu": 0, "pci_bus_id": "0000:18:00.0"}] + [
        {"process": f"decode process {r}", "gpu": 1, "pci_bus_id": "0000:2A:00.0"} for r in range(8)]
    json.dump({"placement": placement,
               "runs": [{"mode": "packed", "engine": "nixl", "bytes": 1_000_000_000, "transfer_seconds": 0.01,
                         "request_seconds": 0.02, "verified": True, "failures": [], "ranks": ranks},
                        {"mode": "region", "engine": "nixl", "bytes": 0, "transfer_seconds": math.nan,
                         "request_seconds": math.nan, "verified": False, "failures": ["boom"], "ranks": ranks}]},
              open(os.path.join(out, "mg_job_nixl.json"), "w"))
    json.dump({"rows": [{"combine": "ag_rs", "devices": 2, "step_us": 150.0, "step_rel_err": 1e-7, "step_equal": True,
                         "merge_us": 20.0, "merge_rel_err": 1e-8, "merge_equal": True}],
               "emulated": {"ranks": 8, "device": "cuda:0", "step_us": 300.0, "step_rel_err": 2e-7, "step_equal": True},
               "shape": {"batch": 4, "kv_len": 8192, "heads": 128}, "meta": {"mesh_devices": 2}, "all_equal": True},
              open(os.path.join(out, "mg_merge.json"), "w"))


def test_placement_ok():
    p = [{"gpu": 0, "pci_bus_id": "A"}, {"gpu": 1, "pci_bus_id": "B"}, {"gpu": 1, "pci_bus_id": "B"}]
    assert mg_summary.placement_ok(p)
    assert not mg_summary.placement_ok(p + [{"gpu": 1, "pci_bus_id": "A"}])  # GPU 1 on two buses
    assert not mg_summary.placement_ok([{"gpu": 0, "pci_bus_id": "A"}, {"gpu": 1, "pci_bus_id": "A"}])  # not moved
    assert not mg_summary.placement_ok([{"gpu": None, "pci_bus_id": "A"}])  # not placed
    assert not mg_summary.placement_ok([])


def test_summaries_on_a_sample(tmp_path, capsys):
    out = str(tmp_path / "multi_gpu")
    _sample(out)
    vers = {"python": "3.12", "jax": "0.11.2", "device": "NVIDIA H200", "commit": "abc"}
    assert mg_summary.summarize(out, 8192, vers) == 1  # a failed step and an unverified run
    res = json.load(open(os.path.join(out, "multi_gpu.json")))
    assert res["kind"] == "2 GPUs" and res["peer_ceiling_gbps"] == 400.0
    packed, region = res["runs"]
    assert packed["transfer_gbps"] == pytest.approx(100.0) and packed["request_gbps"] == pytest.approx(50.0)
    assert packed["transfer_pct_of_peer"] == pytest.approx(25.0) and packed["rank_gpus"] == [1] * 8
    assert region["transfer_gbps"] is None and not region["verified"]
    assert res["failed"] == ["job_nixl", "nixl/region"]
    md = open(os.path.join(out, "multi_gpu.md")).read()
    assert "| nixl | packed | 1.00 | 0.0100 | 100.0 | 25.0 | 0.0200 | 50.0 | 1,1,1,1,1,1,1,1 | True |" in md
    assert "| ag_rs | 2 | 150.0 |" in md and "emulated: 8 ranks on cuda:0" in md
    # the GPU suite's summary shows the rehearsal's figures from multi_gpu/multi_gpu.json
    with open(tmp_path / "steps.tsv", "w") as f:
        f.write("multi_gpu_rehearsal\t0\t50\n")
    capsys.readouterr()
    assert suite_summary.summarize(str(tmp_path)) == 0
    text = open(tmp_path / "gpu_suite_summary.md").read()
    assert "## Several GPUs: 2 GPUs (scripts/multi_gpu.sh, 8,192 tokens)" in text
    assert "| nixl | packed | 100.0 | 25.0 | 50.0 | 1,1,1,1,1,1,1,1 | True |" in text
    assert "| ag_rs | 2 | 150.0 | 20.0 | True |" in text
    assert "Several GPUs: FAILED: job_nixl, nixl/region" in text
    assert json.load(open(tmp_path / "gpu_suite_summary.json"))["multi_gpu"]["peer_ceiling_gbps"] == 400.0
    with open(tmp_path / "steps.tsv", "w") as f:  # a suite run without the step: the old folder is not shown
        f.write("d2d_ceiling\t0\t5\n")
    assert suite_summary.summarize(str(tmp_path)) == 0
    assert "Several GPUs" not in open(tmp_path / "gpu_suite_summary.md").read()
