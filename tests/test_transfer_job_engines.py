"""The main job through the third engine, other paths and the staged path, real processes.

`--engine jax-transfer` (jax.experimental.transfer behind `bridge.jax_engine`), `--path region`,
`--staging host` through NIXL, Mooncake and jax-transfer (the connector's staging, given to every
KVSender / KVReceiver), and `--pack-backend NAME` forcing each registry backend that runs on the
CPU (the KVSender's option); every decode rank checks every byte its KV holds.
"""
import pytest

from dcp_jax.job import JobConfig, run_job
from dcp_jax.job.kv import owned_tokens

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real processes per test

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


def test_jax_transfer_pull_direction_chunked():
    """--direction pull: each decode rank pulls (READs) its rows from the sender's pack region and
    reports on the control plane: how tpu-inference and sglang-jax use jax.experimental.transfer."""
    cfg = JobConfig(**SMALL, engine="jax-transfer", direction="pull", chunk_tokens=96, verify=True)
    res = run_job(cfg)
    for run in res["runs"]:
        _check_run(run, cfg)
        assert all(r["checksum_ok"] is True for r in run["ranks"])


def test_jax_transfer_refuses_device_memory_unless_staged():
    with pytest.raises(ValueError, match="engine='jax-transfer' \\(--engine\\)"):
        JobConfig(**SMALL, engine="jax-transfer", device="gpu", staging="none")
    assert JobConfig(**SMALL, engine="jax-transfer", device="gpu").staged  # auto: staged


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


@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_staged_path_chunked_prefix_verify(engine):
    """--staging host: every sender and receiver stages (only its pack buffer / receive region
    registered), so the connector takes the region path (the default modes become region);
    both sides say "staged". On the CPU the device memory is host memory: no copy is timed."""
    cfg = JobConfig(**SMALL, engine=engine, staging="host", chunk_tokens=96, prefix_tokens=96, verify=True)
    assert cfg.modes == ("region",)
    res = run_job(cfg)
    for run in res["runs"]:
        _check_run(run, cfg)
        assert run["staging"] == {"prefill": "staged", "decode": "staged"} and run["paths"] == ["region"]
        assert run["stage_seconds"] == 0 and run["unstage_seconds"] == 0
        assert all(r["checksum_ok"] is True and r["staging"] == "staged" for r in run["ranks"])


def test_jax_transfer_region_path_staged():
    cfg = JobConfig(**SMALL, engine="jax-transfer", staging="host", modes=("region",))
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert run["paths"] == ["region"] and run["descriptors"] == cfg.dcp_size
    assert run["staging"] == {"prefill": "staged", "decode": "staged"}


def test_staged_path_prefill_dcp2_block_interleave():
    """Two prefill ranks (interleave 16) to three decode ranks, chunked: each prefill rank stages
    the pages of its own local rows per chunk."""
    cfg = JobConfig(**dict(SMALL, prompt_tokens=900), engine="nixl", staging="host", prefill_dcp_size=2,
                    prefill_interleave_size=16, interleave_size=16, chunk_tokens=128, verify=True)
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert run["staging"] == {"prefill": "staged", "decode": "staged"}


def test_auto_staging_on_the_cpu_is_direct():
    cfg = JobConfig(**SMALL, engine="nixl", modes=("packed",))
    assert not cfg.staged
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert run["staging"] == {"prefill": "direct", "decode": "direct"} and run["stage_seconds"] == 0


# The interpret kernels compile for seconds per job here: staged only; xla and host both ways.
@pytest.mark.parametrize("backend, engine, stagings", [
    ("xla", "nixl", ("host", "none")), ("host", "jax-transfer", ("host", "none")),
    ("tpu-interpret", "nixl", ("host",)), ("gpu-triton-interpret", "mooncake", ("host",))])
def test_pack_backend_forced_verifies(backend, engine, stagings):
    """--pack-backend NAME is the KVSender's pack backend, staged (region path) or direct
    (packed path); the report names it."""
    for staging in stagings:
        path = "region" if staging == "host" else "packed"
        cfg = JobConfig(**SMALL, engine=engine, staging=staging, pack_backend=backend, modes=(path,))
        run = run_job(cfg)["runs"][0]
        _check_run(run, cfg)
        assert run["pack_backend"] == backend and run["paths"] == [path]
        assert run["staging"]["prefill"] == ("staged" if staging == "host" else "direct")


def test_gpu_mosaic_interpret_through_the_job_on_128_byte_rows():
    """The Mosaic GPU kernel copies rows of 128-B multiples: the `tiny-128` geometry is the small
    one it takes (tiny-mixed is refused, see below); staged region path, byte-exact."""
    cfg = JobConfig(**dict(SMALL, model="tiny-128", prompt_tokens=500, dcp_size=2), engine="nixl",
                    staging="host", pack_backend="gpu-mosaic-interpret", modes=("region",))
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert run["pack_backend"] == "gpu-mosaic-interpret" and run["staging"]["prefill"] == "staged"


def test_the_job_and_the_connector_name_the_same_stagings_and_region_notifies():
    from dcp_jax.job.config import STAGINGS
    from dcp_jax.transfer.staging import STAGINGS as CONNECTOR

    assert STAGINGS == CONNECTOR
    from dcp_jax.job.config import REGION_NOTIFIES
    from dcp_jax.transfer._sender_region import REGION_NOTIFY

    assert REGION_NOTIFIES == ("auto", *REGION_NOTIFY)


@pytest.mark.parametrize("kwargs, match", [
    (dict(staging="host", modes=("packed",)), "only the region path reaches it"),
    (dict(pack_backend="nope", staging="host"), "pack_backend='nope' \\(--pack-backend\\)"),
    (dict(pack_backend="gpu-mosaic-interpret", staging="host"), "not multiples of 128 B"),
    (dict(staging="disk"), "staging='disk' \\(--staging\\)"),
    (dict(direction="sideways"), "direction='sideways' \\(--direction\\)"),
])
def test_bad_staging_and_pack_backend_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JobConfig(**SMALL, **kwargs)


def test_host_memory_estimate_counts_the_staging_copies():
    from dcp_jax.job.kv import estimate_host_bytes

    direct = estimate_host_bytes(JobConfig(**SMALL, staging="none"))
    staged = estimate_host_bytes(JobConfig(**SMALL, staging="host"))
    assert staged > 1.5 * direct


@pytest.mark.parametrize("engine, prefill_page, page, extra", [
    ("nixl", 4, 16, dict(chunk_tokens=96, verify=True)),
    ("mooncake", 64, 16, dict(chunk_tokens=128, prefix_tokens=96)),
    ("nixl", 32, 8, dict(staging="host", interleave_size=8)),
])
def test_prefill_and_decode_page_sizes_differ(engine, prefill_page, page, extra):
    """--prefill-page-size: the prefill side's pages are smaller or larger than the decode side's;
    every decode rank still holds its rows byte for byte (issue 15)."""
    cfg = JobConfig(**dict(SMALL, page_size=page), engine=engine, prefill_page_size=prefill_page, **extra)
    assert cfg.src_page_size == prefill_page
    for run in run_job(cfg)["runs"]:
        _check_run(run, cfg)


def test_bad_prefill_page_size_names_the_option():
    with pytest.raises(ValueError, match=r"prefill_page_size=0 \(--prefill-page-size\)"):
        JobConfig(**SMALL, prefill_page_size=0)
    with pytest.raises(ValueError, match="must be a multiple of prefill_page_size=64"):
        JobConfig(**SMALL, prefill_page_size=64, chunk_tokens=96)
