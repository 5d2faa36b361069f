"""The main job with real processes and real engines (host memory, loopback), on small geometries.

Every run is checked by the decode ranks byte for byte (received rows hold their token's pattern,
every other row of the pool its sentinel); descriptor counts are recomputed here from the planner
and the same allocator-drawn page tables.
"""
import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from dcp_jax import plan as planmod
from dcp_jax.transfer_job import (
    DecodeTarget,
    JobConfig,
    PrefillServer,
    RequestFailed,
    _prefill_page_table,
    decode_owned_tokens,
    decode_page_table,
    decode_pool_pages,
    run_job,
    start_decode_processes,
)

pytestmark = pytest.mark.timeout(120)

SMALL = dict(model="tiny-mixed", prompt_tokens=700, page_size=16, dcp_size=3, timeout_s=20.0)


def _expected_descriptors(cfg: JobConfig) -> dict[str, int]:
    """Direct and packed descriptor totals from dcp_jax.plan on the job's own page tables (M = 1)."""
    _, _, src_pages, _ = _prefill_page_table(cfg, 0)
    pool = decode_pool_pages(cfg)
    layers = cfg.geometry.num_layers
    out = {"direct": 0, "packed": 0}
    for r in range(cfg.dcp_size):
        dst_pages = decode_page_table(cfg, r, cfg.dcp_size, pool)
        for start, length in cfg.chunks():
            off = (start - cfg.prefix_tokens) // cfg.page_size
            tp = planmod.build_token_transfer_plan(
                src_pages[off: off + -(-length // cfg.page_size)], dst_pages, page_size=cfg.page_size,
                dcp_size=cfg.dcp_size, dcp_rank=r, interleave_size=cfg.interleave_size, src_page_offset=off,
                decode_prefix_len=cfg.prefix_tokens, num_kv_tokens=length)
            out["direct"] += layers * len(planmod.group_runs(tp.src_token_indices, tp.dst_token_indices))
            n = len(tp.src_token_indices)
            out["packed"] += layers * len(planmod.group_runs(np.arange(n), tp.dst_token_indices))
    return out


def _check_run(run: dict, cfg: JobConfig) -> None:
    assert run["verified"], run["failures"] or run["ranks"]
    assert run["bytes"] == cfg.geometry.request_bytes(cfg.send_tokens)
    assert sum(r["bytes"] for r in run["ranks"]) == run["bytes"]
    for r in run["ranks"]:
        assert r["bytes_exact"] and r["bad_rows"] == 0 and r["bad_sentinel_rows"] == 0
        assert r["rows"] == len(decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.dcp_size,
                                                    r["dcp_rank"], cfg.interleave_size)[0])


def test_small_job_both_modes_nixl_matches_plan():
    cfg = JobConfig(**SMALL, engine="nixl")
    res = run_job(cfg)
    assert res["verified"] and [r["mode"] for r in res["runs"]] == ["direct", "packed"]
    assert res["warmup_seconds"] > 0  # untimed warm-up ran before the timed modes (and is not counted)
    want = _expected_descriptors(cfg)
    for run in res["runs"]:
        _check_run(run, cfg)
        assert run["engine"] == "nixl"
        assert run["descriptors"] == want[run["mode"]]
        # One engine call per (chunk, rank): all layer entries in one batch.
        assert run["batches"] == run["engine_calls"] == cfg.dcp_size
        assert all(r["batches"] == r["engine_calls"] == 1 for r in run["ranks"])
    d, p = res["runs"]
    assert p["descriptors"] < d["descriptors"]
    assert res["comparison"]["descriptor_ratio"] == pytest.approx(d["descriptors"] / p["descriptors"])


def test_chunked_prefix_verify_mooncake_matches_plan():
    cfg = JobConfig(**SMALL, engine="mooncake", chunk_tokens=96, prefix_tokens=96, verify=True)
    res = run_job(cfg)
    want = _expected_descriptors(cfg)
    chunks = len(cfg.chunks())
    assert chunks == 7
    for run in res["runs"]:
        _check_run(run, cfg)
        assert run["engine"] == "mooncake" and run["descriptors"] == want[run["mode"]]
        assert run["batches"] == chunks * cfg.dcp_size
        # Per-rank engine calls (Mooncake: one per 1024-descriptor window) add up to the engine's counter.
        assert sum(r["engine_calls"] for r in run["ranks"]) == run["engine_calls"] >= run["batches"]
        assert all(r["checksum_ok"] is True and r["chunks"] == chunks for r in run["ranks"])


def test_mooncake_engine_calls_per_rank_count_1024_descriptor_windows():
    # 4096 rows x 3 layer entries of token round-robin = 12,288 descriptors per rank in ONE batch,
    # which Mooncake submits as 12 windows of 1024: batches 1, engine calls 12 per rank.
    cfg = JobConfig(model="tiny", prompt_tokens=8192, page_size=16, dcp_size=2, engine="mooncake",
                    modes=("direct",), timeout_s=20.0)
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert [(r["batches"], r["engine_calls"]) for r in run["ranks"]] == [(1, 12), (1, 12)]
    assert run["batches"] == 2 and run["engine_calls"] == 24


@pytest.mark.parametrize("m, n, ip, i", [(2, 4, 1, 1), (4, 2, 8, 16)], ids=lambda v: str(v))
def test_prefill_dcp_m_to_decode_dcp_n(m, n, ip, i):
    cfg = JobConfig(model="tiny", prompt_tokens=600, page_size=16, dcp_size=n, prefill_dcp_size=m,
                    interleave_size=i, prefill_interleave_size=ip, chunk_tokens=256 if m == 2 else None,
                    timeout_s=20.0)
    res = run_job(cfg)
    # (chunk, source, destination) triples with rows, brute force from the ownership formulas.
    pairs = set()
    for k in range(m):
        toks, _ = decode_owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, m, k, ip)
        for ci, (start, length) in enumerate(cfg.chunks()):
            t = toks[(toks >= start) & (toks < start + length)]
            pairs.update((ci, k, int(d)) for d in np.unique((t // i) % n))
    assert len(pairs) < len(cfg.chunks()) * m * n  # some pairs are empty: they must not count
    for run in res["runs"]:
        _check_run(run, cfg)
        assert run["batches"] == run["engine_calls"] == len(pairs)
        for r in run["ranks"]:
            assert r["batches"] == sum(1 for p in pairs if p[2] == r["dcp_rank"])
            assert r["strategy"] == run["mode"]  # the default pack buffer never slices
            assert sorted(x["prefill_rank"] for x in r["sources"]) == sorted({p[1] for p in pairs
                                                                             if p[2] == r["dcp_rank"]})
            assert all(x["strategy"] == run["mode"] and x["rows"] > 0 for x in r["sources"])


@pytest.mark.parametrize("m, n", [(2, 4), (4, 2)])
def test_mxn_default_pack_never_slices_and_pack_tokens_still_slices(m, n):
    # Whole-request send: one decode rank gets all of a prefill rank's rows for some pairs, more
    # than shard / N; the pack region must still hold them.
    cfg = JobConfig(model="tiny", prompt_tokens=2048, page_size=16, dcp_size=n, prefill_dcp_size=m,
                    modes=("packed",), timeout_s=20.0)
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert all(r["strategy"] == "packed" for r in run["ranks"])
    with_rows = sum(len(r["sources"]) for r in run["ranks"])
    assert run["batches"] == with_rows == max(m, n)  # I = I_p = 1: each source feeds N/M or M/N ranks
    forced = dataclasses.replace(cfg, pack_tokens=256)
    run = run_job(forced)["runs"][0]
    _check_run(run, forced)
    assert all(r["strategy"] == "sliced" for r in run["ranks"])
    assert run["batches"] > with_rows


def test_block_round_robin_sliced_pack_and_windows():
    # I = P: direct needs no packing, and uses at most 1/P of token round-robin's descriptors.
    base = dict(SMALL, model="tiny", prompt_tokens=1024, modes=("direct",))
    tok = run_job(JobConfig(**base))["runs"][0]
    blk = run_job(JobConfig(**base, interleave_size=16))["runs"][0]
    assert tok["verified"] and blk["verified"]
    assert blk["descriptors"] * 16 <= tok["descriptors"]
    # A pack buffer for 120 tokens (40 rows per rank region) forces gather/send/wait slices, and
    # windows of 25 rows split every batch; both still byte-exact.
    cfg = JobConfig(**dict(SMALL, modes=("packed",)), pack_tokens=120, max_batch_indices=25)
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert all(r["strategy"] == "sliced" for r in run["ranks"])
    # Slices of 40 rows (the region), each split into windows of at most 25 rows.
    assert run["batches"] == sum(-(-min(40, r["rows"] - s) // 25)
                                 for r in run["ranks"] for s in range(0, r["rows"], 40))


def test_corrupted_byte_is_caught_by_checksum_and_full_verification():
    cfg = JobConfig(**dict(SMALL, modes=("packed",)), verify=True, corrupt_rank=1)
    res = run_job(cfg)
    assert not res["verified"]
    ranks = res["runs"][0]["ranks"]
    assert [r["verified"] for r in ranks] == [True, False, True]
    assert ranks[1]["checksum_ok"] is False and ranks[1]["bad_rows"] == 1
    assert ranks[1]["bad_checksums"] == [[0, cfg.geometry.num_layers - 1]] or \
        ranks[1]["bad_checksums"] == [(0, cfg.geometry.num_layers - 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_decode_killed_mid_request_then_next_request_to_survivors(engine):
    """A decode rank SIGKILLed after its first chunk: the prefill fails fast, cleans up, serves the rest."""
    cfg = JobConfig(model="tiny", prompt_tokens=2048, page_size=16, dcp_size=3, chunk_tokens=256,
                    engine=engine, timeout_s=8.0, modes=("packed",))
    decodes = start_decode_processes(cfg, min_dcp_size=2)
    server = PrefillServer(cfg, 0)
    try:
        peers = [server.connect(d.peer_info) for d in decodes]

        def start(group, seq):
            for r, d in enumerate(group):
                d.ctrl.send(("request", dict(dcp_rank=r, dcp_size=len(group), seq=seq)))
            ready = [d.recv(10, "ready") for d in group]
            return [DecodeTarget(r, peers[decodes.index(d)], np.asarray(rd["layer_bases"]),
                                 np.asarray(rd["dst_pages"]), d.src_conns[0])
                    for r, (d, rd) in enumerate(zip(group, ready))]

        victim = decodes[1]
        targets = start(decodes, 0)

        def kill_after_first(_):
            if victim.process.is_alive():
                os.kill(victim.process.pid, signal.SIGKILL)
                victim.process.join(5)

        t0 = time.monotonic()
        with pytest.raises(RequestFailed) as err:
            server.send_request("packed", targets, dcp_size=3, progress=kill_after_first)
        elapsed = time.monotonic() - t0
        assert elapsed < cfg.timeout_s + 5, elapsed
        assert err.value.dcp_rank == 1 and err.value.chunk is not None and err.value.chunk >= 0
        assert "dcp_rank=1" in str(err.value)
        # Nothing left in flight, no pack region held.
        assert server.engine.outstanding == 0 and server.busy_regions == 0
        # The survivors learn the request failed (no hang), and report it as not verified.
        for d in (decodes[0], decodes[2]):
            res = d.recv(cfg.timeout_s + 5, "result")
            assert not res["verified"] and res["errors"]
        # Next request: the two survivors as a DCP-2 group, byte-exact.
        server.disconnect(peers[1])
        survivors = [decodes[0], decodes[2]]
        targets = start(survivors, 1)
        stats = server.send_request("packed", targets, dcp_size=2)
        results = [d.recv(cfg.timeout_s + 5, "result") for d in survivors]
        assert all(r["verified"] for r in results), results
        assert stats["bytes"] == cfg.geometry.request_bytes(cfg.send_tokens)
        assert server.engine.outstanding == 0 and server.busy_regions == 0
    finally:
        server.close()
        for d in decodes:
            d.stop(5)


def test_job_level_death_reports_failure_without_hanging():
    cfg = JobConfig(**dict(SMALL, modes=("packed",), timeout_s=8.0), chunk_tokens=64, die_rank=2,
                    die_after_chunks=2)
    t0 = time.monotonic()
    res = run_job(cfg)
    assert time.monotonic() - t0 < 60
    run = res["runs"][0]
    assert not res["verified"] and not run["verified"] and run["failures"]
    assert run["ranks"][2]["verified"] is False


def test_death_in_first_mode_fails_the_next_mode_with_a_message():
    # Decode rank 2 dies in the direct mode; the packed mode must not crash on the dead pipe
    # (it used to raise BrokenPipeError, which the CLI turned into a silent exit 1).
    # The survivors must not wait out timeout_s for messages that will never come.
    cfg = JobConfig(**dict(SMALL, modes=("direct", "packed"), timeout_s=120.0), chunk_tokens=64,
                    die_rank=2, die_after_chunks=2)
    t0 = time.monotonic()
    res = run_job(cfg)
    assert time.monotonic() - t0 < 60
    direct, packed = res["runs"]
    assert not direct["verified"] and direct["failures"]
    assert not packed["verified"] and packed["failures"][0].startswith("mode not started")
    assert "decode process 2" in packed["failures"][0] or "exited" in packed["failures"][0]
    assert "comparison" not in res and not res["verified"]


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(model="llama"), "deepseek-v3"),
        (dict(prompt_tokens=0), "prompt_tokens"),
        (dict(page_size=-64), "page_size"),
        (dict(dcp_size=0), "dcp_size"),
        (dict(interleave_size=0), "interleave_size"),
        (dict(prefix_tokens=64), "prefix_tokens=64 must be a multiple of 512"),
        (dict(prefix_tokens=32768), "prefix_tokens"),
        (dict(chunk_tokens=100), "chunk_tokens=100 must be a multiple of page_size=64"),
        (dict(modes=("fast",)), "modes"),
        (dict(engine="ucx"), "engine"),
        (dict(max_batch_indices=0), "max_batch_indices"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(timeout_s=float("nan")), "timeout_s"),
        (dict(timeout_s=1e7), "timeout_s"),
        (dict(dcp_size=65), "dcp_size=65 must be <= 64"),
        (dict(prefill_dcp_size=65), "prefill_dcp_size=65 must be <= 64"),
        (dict(corrupt_rank=8), "corrupt_rank"),
    ],
)
def test_bad_config_names_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        JobConfig(**kwargs)


def test_host_memory_estimate_covers_the_buffers_and_refuses_the_impossible():
    from dcp_jax.transfer_job import check_host_memory, decode_pool_pages, estimate_host_bytes

    cfg = JobConfig(**SMALL)
    row = cfg.geometry.row_bytes
    # At least the whole request on each side (prefill pool + pack, the decode pools).
    assert estimate_host_bytes(cfg) >= 2 * cfg.send_tokens * row
    assert estimate_host_bytes(cfg) >= 3 * decode_pool_pages(cfg) * cfg.page_size * row
    check_host_memory(cfg)  # a small job fits
    # 2**31-token pages of 168 B rows: terabytes for a 512-token request.
    with pytest.raises(ValueError, match="GiB of host memory.*page_size=2147483648"):
        check_host_memory(JobConfig(**dict(SMALL, page_size=2**31, prompt_tokens=512)))


def test_decode_owned_tokens_matches_layout_reference():
    from dcp_jax.layout import local_index_np, local_len_np, owner_np

    for n, i, start in [(3, 1, 0), (4, 16, 128), (2, 5, 20)]:
        for r in range(n):
            t, j = decode_owned_tokens(start, 300, n, r, i)
            ref = np.arange(start, 300)
            ref = ref[owner_np(ref, n, i) == r]
            np.testing.assert_array_equal(t, ref)
            np.testing.assert_array_equal(j, local_index_np(ref, n, i) - local_len_np(start, n, r, i))


def test_send_request_rejects_mismatched_targets_before_sending():
    cfg = JobConfig(model="tiny", prompt_tokens=64, page_size=16, dcp_size=2, timeout_s=5.0)
    server = PrefillServer(cfg, 0)
    try:
        pages = np.arange(2)
        with pytest.raises(ValueError, match="layer_bases has 2 layer entries"):
            server.send_request("packed", [DecodeTarget(0, "x", np.zeros(2, np.int64), pages, None)], dcp_size=2)
        with pytest.raises(ValueError, match="not connected"):
            server.send_request("direct", [DecodeTarget(0, "nobody", np.zeros(3, np.int64), pages, None)],
                                dcp_size=2)
        with pytest.raises(ValueError, match="dcp_rank"):
            server.send_request("direct", [DecodeTarget(2, "x", np.zeros(3, np.int64), pages, None)], dcp_size=2)
        with pytest.raises(ValueError, match="mode"):
            server.send_request("sideways", [], dcp_size=2)
        with pytest.raises(ValueError, match="dcp_rank=0: peer 'nobody' not connected"):
            server.warm_up([(0, "nobody", np.zeros(3, np.int64))], dcp_size=2)
        assert server.engine.counters.batches == 0
    finally:
        server.close()
