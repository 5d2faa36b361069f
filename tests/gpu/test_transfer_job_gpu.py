"""GPU: the main job with device memory on both sides through NIXL (``--device gpu``).

Prefill KV and pack buffer are CuPy allocations registered as VRAM, packing is the Pallas gather
writing in place into the registered pack buffer, decode pools are CuPy allocations registered as
VRAM; every decode rank copies its pool back and checks it byte for byte against the pattern.
The plans are the CPU job's: descriptor, byte and engine-call counts must equal a host-memory run.

Set ``DCP_GPU_OUT`` to a folder to also get the 32k-token table as Markdown there.
"""

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from bridge.nixl import nixl_available  # noqa: E402
from dcp_jax.geometry import get_geometry  # noqa: E402
from dcp_jax.job import JobConfig, check_device, run_job  # noqa: E402

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="needs the CUDA NIXL wheel (nixl-cu13): "
                                                             "scripts/gpu_suite.sh installs .whl/nixl_cu13-*.whl")


def _check_run(res: dict, cfg: JobConfig) -> None:
    assert res["config"]["device"] == "gpu"
    request_bytes = get_geometry(cfg.model).request_bytes(cfg.send_tokens)
    for run in res["runs"]:
        assert run["engine"] == "nixl"
        assert not run["failures"], run["failures"]
        assert run["bytes"] == request_bytes
        for r in run["ranks"]:
            assert r["bytes_exact"], (run["mode"], r)
            assert r["bad_rows"] == 0 and r["bad_sentinel_rows"] == 0
            if cfg.verify:
                assert r["checksum_ok"], (run["mode"], r)
        assert sum(r["bytes_verified"] for r in run["ranks"]) == request_bytes
        assert run["verified"]
    assert res["verified"]


def test_check_device_gpu_passes_here():
    check_device("gpu")  # CuPy and a CUDA device are present on this machine


@needs_nixl
@pytest.mark.parametrize("kw", [
    # tiny rows, chunked (pack of chunk k+1 overlaps transfer of chunk k), CRC checks on arrival
    dict(model="tiny", prompt_tokens=512, page_size=16, dcp_size=2, chunk_tokens=256, verify=True),
    # DeepSeek-V3 rows (61 x 1152 B), 4 ranks
    dict(model="deepseek-v3", prompt_tokens=2048, page_size=64, dcp_size=4, verify=True),
    # page-size interleave and a small pack buffer: sliced packing rewrites one region in place
    dict(model="tiny", prompt_tokens=1024, page_size=16, dcp_size=4, interleave_size=16, pack_tokens=128),
], ids=["tiny-dcp2-chunked", "deepseek-dcp4", "tiny-dcp4-interleave-sliced"])
def test_small_job_on_device_memory_matches_host_run(kw):
    gpu_cfg = JobConfig(**kw, engine="nixl", device="gpu", timeout_s=120)
    res = run_job(gpu_cfg)
    _check_run(res, gpu_cfg)
    # Same plans, descriptors and engine calls as the host-memory job: only the buffers differ.
    host = run_job(JobConfig(**kw, engine="nixl", device="cpu", timeout_s=120))
    assert host["verified"]
    for g, h in zip(res["runs"], host["runs"]):
        assert g["mode"] == h["mode"]
        for key in ("descriptors", "bytes", "engine_calls", "batches"):
            assert g[key] == h[key], (g["mode"], key, g[key], h[key])
        assert [r["strategy"] for r in g["ranks"]] == [r["strategy"] for r in h["ranks"]]
    if kw.get("pack_tokens"):
        packed = next(r for r in res["runs"] if r["mode"] == "packed")
        assert all("sliced" in r["strategy"] for r in packed["ranks"])


@needs_nixl
def test_timed_requests_compile_no_kernel_after_the_senders_warm_up():
    # The prefill senders warm their kernels once the ranks link (`KVSender.warm_up`): a timed
    # round split differently from the warm-up request's (a rank announcing late) must find its
    # index bucket compiled (an H200 run spent 0.2 s of one 32k fused request compiling one).
    cfg = JobConfig(model="deepseek-v3", prompt_tokens=4096, page_size=64, dcp_size=8, engine="nixl",
                    device="gpu", modes=("region", "fused"), requests=4, timeout_s=120)
    res = run_job(cfg)
    _check_run(res, cfg)
    for run in res["runs"]:
        warm = run["kernel_warm_up"]
        assert warm[run["mode"] if run["mode"] == "fused" else "pack"], (run["mode"], warm)
        # region: each decode rank compiled its unpack before linking (`KVReceiver.warm_up`),
        # the bucket of its 512-row windows (4,096 tokens to 8 ranks)
        assert warm["unpack"] == ([512] if run["mode"] == "region" else []), warm
        assert [q["kernel_traces"] for q in run["repeats"]] == [0] * cfg.requests, run["repeats"]


@needs_nixl
def test_flipped_device_byte_is_caught():
    cfg = JobConfig(model="tiny", prompt_tokens=512, page_size=16, dcp_size=2, modes=("packed",),
                    engine="nixl", device="gpu", corrupt_rank=1, timeout_s=120)
    res = run_job(cfg)
    assert not res["verified"]
    ranks = res["runs"][0]["ranks"]
    assert ranks[0]["bytes_exact"] and ranks[0]["verified"]
    assert not ranks[1]["bytes_exact"] and ranks[1]["bad_rows"] == 1
    assert ranks[1]["first_bad"][0] == get_geometry("tiny").num_layers - 1


def _table(res: dict) -> str:
    lines = ["| mode | descriptors | bytes | engine calls | plan s | pack s | transfer s | total s | GB/s "
             "| verified |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in res["runs"]:
        lines.append(f"| {run['mode']} | {run['descriptors']:,} | {run['bytes']:,} | {run['engine_calls']:,} "
                     f"| {run['plan_seconds']:.3f} | {run['pack_seconds']:.3f} | {run['transfer_seconds']:.3f} "
                     f"| {run['total_seconds']:.3f} | {run['gbps']:.2f} | {'yes' if run['verified'] else 'NO'} |")
    c = res.get("comparison")
    if c:
        lines.append("")
        lines.append(f"packed vs direct: {c['descriptor_ratio']:.1f}x fewer descriptors, "
                     f"{c['total_seconds_ratio']:.2f}x faster end to end")
    return "\n".join(lines)


@needs_nixl
def test_deepseek_32k_dcp8_on_device_memory():
    cfg = JobConfig(model="deepseek-v3", prompt_tokens=32768, page_size=64, dcp_size=8, engine="nixl",
                    device="gpu", timeout_s=240)
    res = run_job(cfg)
    table = ("## main job on device memory: deepseek-v3, 32,768 tokens, page 64, DCP1 -> DCP8, NIXL, VRAM\n\n"
             + _table(res) + "\n")
    print("\n" + table)
    out = os.environ.get("DCP_GPU_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "transfer_gpu_test_32k.md").write_text(table)
    _check_run(res, cfg)
    by = {r["mode"]: r for r in res["runs"]}
    # DCP8 token round-robin: 4,096 rows per rank, one descriptor per token per layer when direct.
    assert by["direct"]["descriptors"] == 32768 * 61
    assert by["packed"]["descriptors"] < by["direct"]["descriptors"] // 10
    assert all(r["rows"] == 4096 and r["strategy"] == "packed" for r in by["packed"]["ranks"])
    assert by["packed"]["pack_seconds"] > 0


@needs_nixl
def test_job_under_its_own_mps_daemon_is_byte_exact_and_every_process_connected():
    """``--mps``: the job starts a private CUDA MPS daemon, its processes are its clients (the
    control log counts one connection a process at least), every rank byte-exact, and the
    daemon's directories are gone afterwards."""
    import shutil

    from dcp_jax.job.mps import CONTROL

    if shutil.which(CONTROL) is None:
        pytest.skip(f"{CONTROL} is not on PATH here")
    cfg = JobConfig(model="deepseek-v3", prompt_tokens=2048, page_size=64, dcp_size=4, engine="nixl", device="gpu",
                    modes=("region",), timeout_s=120, mps=True)
    res = run_job(cfg)
    _check_run(res, cfg)
    assert res["mps"]["clients"] >= 1 + cfg.dcp_size, res["mps"]
