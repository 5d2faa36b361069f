"""scripts/gpu_suite_summary.py on a sample output folder: the pack-backend table, the staging
column, staged beside direct (hand-computed GB/s), and failures named."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import gpu_suite_summary as summary  # noqa: E402


def _job(path, staged, seconds, verified=True):
    st = "staged" if staged else "direct"
    return {"config": {"prompt_tokens": 32768, "dcp_size": 8, "request_bytes": 2_000_000_000},
            "runs": [{"mode": path, "paths": [path], "engine": "nixl", "bytes": 2_000_000_000,
                      "descriptors": 16, "transfer_seconds": seconds / 2, "total_seconds": seconds,
                      "staging": {"prefill": st, "decode": st}, "pack_backend": "gpu-triton",
                      "verified": verified}]}


def _write(folder, backends, staged_ok=True):
    with open(folder / "steps.tsv", "w") as f:
        f.write("pack_backends\t0\t31\njob_32k_nixl\t0\t40\njob_32k_nixl_staged\t0\t22\n")
    (folder / "pack_backends.json").write_text(json.dumps({"pack": "DeepSeek-V3 rank pack", "backends": backends}))
    (folder / "job_32k_nixl.json").write_text(json.dumps(_job("region", False, 0.5)))
    (folder / "job_32k_nixl_staged.json").write_text(json.dumps(_job("region", True, 2.0, staged_ok)))


GOOD = [{"backend": "xla", "kind": "jax", "first_call_s": 2.0, "median_s": 0.004, "min_s": 0.0039,
         "gbps": 144.0, "exact": True},
        {"backend": "gpu-triton", "kind": "cupy", "first_call_s": 3.0, "median_s": 0.0002, "min_s": 0.0002,
         "gbps": 2880.0, "exact": True}]


def test_summary_tables_and_staged_beside_direct(tmp_path, capsys):
    _write(tmp_path, GOOD)
    assert summary.summarize(str(tmp_path)) == 0
    res = json.loads((tmp_path / "gpu_suite_summary.json").read_text())
    assert [b["backend"] for b in res["pack_backends"]] == ["xla", "gpu-triton"]
    (pair,) = res["staged_vs_direct"]
    # 2e9 bytes in 0.5 s direct = 4 GB/s; in 2.0 s staged = 1 GB/s
    assert pair["direct_gbps"] == pytest.approx(4.0) and pair["staged_gbps"] == pytest.approx(1.0)
    assert pair["staged_over_direct"] == pytest.approx(0.25) and pair["verified"]
    assert {r["step"]: r["staging"] for r in res["runs"]} == {"job_32k_nixl": "direct", "job_32k_nixl_staged": "staged"}
    md = (tmp_path / "gpu_suite_summary.md").read_text()
    assert "| gpu-triton | cupy | 3.000 | 0.00020 | 0.00020 | 2,880.0 | yes |" in md
    assert "| nixl | 32,768 | region | 4.0 | 1.0 | 0.25 | True |" in md
    assert "all steps passed" in md


def test_a_failed_backend_or_unverified_staged_run_fails_the_summary(tmp_path):
    _write(tmp_path, GOOD[:1] + [{"backend": "gpu-mosaic", "kind": "cupy", "error": "ValueError: boom"}],
           staged_ok=False)
    assert summary.summarize(str(tmp_path)) == 1
    res = json.loads((tmp_path / "gpu_suite_summary.json").read_text())
    assert "pack_backends/gpu-mosaic" in res["failed"] and "job_32k_nixl_staged/region" in res["failed"]
    assert "FAILED: ValueError: boom" in (tmp_path / "gpu_suite_summary.md").read_text()


def test_pack_backends_benchmark_on_a_tiny_pack(tmp_path):
    """benchmarks/pack_backends.py's backend part on the CPU (xla, host, a name that does not
    exist): exact rows measured, the bad one an error row, `failures` names it, the JSON written
    after every row and read by the summary."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import pack_backends as bench

    rows, saved = [], []
    bench.bench_backends(["xla", "host", "nope"], "cpu", rows=8, pool_rows=32, layers=3, item=64, repeats=1,
                         out=rows, saved=lambda: saved.append(len(rows)))
    assert saved == [1, 2, 3]
    assert [r["backend"] for r in rows] == ["xla", "host", "nope"]
    assert rows[0]["exact"] and rows[1]["exact"] and rows[1]["bytes"] == 8 * 3 * 64
    assert "nope" in rows[2]["error"]
    assert bench.failures({"backends": rows}) == [f"backend nope: {rows[2]['error']}"]
    (tmp_path / "pack_backends.json").write_text(json.dumps({"backends": rows}))
    assert summary.summarize(str(tmp_path)) == 1


def test_a_job_of_several_requests_shows_their_count_and_whole_range(tmp_path):
    # --requests 3: the run is the median request's; its repeats give the range of whole GB/s.
    job = _job("fused", False, 0.5)
    job["runs"][0]["repeats"] = [{"request_seconds": s, "whole_gbps": 2.0 / s, "verified": True}
                                 for s in (0.4, 0.5, 1.0)]
    (tmp_path / "steps.tsv").write_text("job_32k_nixl\t0\t40\n")
    (tmp_path / "job_32k_nixl.json").write_text(json.dumps(job))
    assert summary.summarize(str(tmp_path)) == 0
    (run,) = json.loads((tmp_path / "gpu_suite_summary.json").read_text())["runs"]
    assert run["requests"] == 3 and run["whole_gbps_range"] == pytest.approx([2.0, 5.0])
    assert "| 3 (2.0-5.0) | True |" in (tmp_path / "gpu_suite_summary.md").read_text()
