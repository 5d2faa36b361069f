"""The main job through the third engine and the staged path, real processes, host memory.

`--engine jax-transfer` (jax.experimental.transfer behind `bridge.jax_engine`), both modes,
chunked with a prefix and --verify; every decode rank checks every byte of its pool.
"""
import pytest

from dcp_jax.job import JobConfig, run_job
from dcp_jax.job.kv import owned_tokens

pytestmark = pytest.mark.timeout(240)

SMALL = dict(model="tiny-mixed", prompt_tokens=700, page_size=16, dcp_size=3, timeout_s=30.0)


def _check_run(run: dict, cfg: JobConfig) -> None:
    assert run["verified"], run["failures"] or run["ranks"]
    assert run["bytes"] == cfg.geometry.request_bytes(cfg.send_tokens)
    for r in run["ranks"]:
        assert r["bytes_exact"] and r["bad_rows"] == 0 and r["bad_sentinel_rows"] == 0
        assert r["rows"] == len(owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.dcp_size,
                                             r["dcp_rank"], cfg.interleave_size)[0])


def test_jax_transfer_engine_job_both_modes_chunked_prefix_verify():
    cfg = JobConfig(**SMALL, engine="jax-transfer", chunk_tokens=96, prefix_tokens=96, verify=True)
    res = run_job(cfg)
    assert res["verified"] and [r["mode"] for r in res["runs"]] == ["direct", "packed"]
    for run in res["runs"]:
        _check_run(run, cfg)
        assert run["engine"] == "jax-transfer"
        assert run["batches"] == len(cfg.chunks()) * cfg.dcp_size
        assert all(r["checksum_ok"] is True for r in run["ranks"])


def test_jax_transfer_refuses_device_memory_by_name():
    with pytest.raises(ValueError, match="engine='jax-transfer' \\(--engine\\)"):
        JobConfig(**SMALL, engine="jax-transfer", device="gpu")


def test_path_region_sends_one_descriptor_per_chunk_and_rank():
    """``--path region``: each decode rank's receive region holds its share of a chunk, so every
    (chunk, rank) goes as one descriptor; the report names the path per rank."""
    cfg = JobConfig(**SMALL, engine="nixl", modes=("region", "auto"), chunk_tokens=256)
    res = run_job(cfg)
    region, auto = res["runs"]
    for run in res["runs"]:
        _check_run(run, cfg)
    assert region["paths"] == ["region"] and all(r["path"] == "region" for r in region["ranks"])
    assert region["descriptors"] == len(cfg.chunks()) * cfg.dcp_size
    assert auto["paths"] == ["packed"]  # host receivers of an auto run offer no region
    assert region["request_seconds"] > 0


@pytest.mark.parametrize("modes, match", [(("fast",), "modes"), (("direct", "direct"), "distinct")])
def test_bad_path_names_the_option(modes, match):
    with pytest.raises(ValueError, match=match):
        JobConfig(**SMALL, modes=modes)
