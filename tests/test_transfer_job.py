"""The main job (dcp_jax.job) with real processes, real connectors and real engines (host memory,
loopback), on small geometries.

Every run is checked by the decode ranks byte for byte (received rows hold their token's pattern,
every other row of the pool, prefix pages included, its sentinel); descriptor counts are
recomputed here from dcp_jax.plan (not the connector's schedule) on the same allocator-drawn
page tables.
"""
import dataclasses
import time
import uuid

import numpy as np
import pytest

from dcp_jax import plan as planmod
from dcp_jax.job import JobConfig, run_job
from dcp_jax.job.kv import (
    PACK_ALIGN,
    decode_page_table,
    decode_pool_pages,
    decode_pools,
    owned_tokens,
    pack_bytes,
    prefill_page_table,
    request_page_tables,
)
from dcp_jax.job.processes import start_processes, stop_all
from dcp_jax.job.run import run_mode

pytestmark = pytest.mark.timeout(180)

SMALL = dict(model="tiny-mixed", prompt_tokens=700, page_size=16, dcp_size=3, timeout_s=20.0)


def _expected_descriptors(cfg: JobConfig) -> dict[str, int]:
    """Direct and packed descriptor totals from dcp_jax.plan on the job's own page tables (M = 1).

    Both tables map local rows from token 0 (spec section 10): the chunk's prefill pages start at
    page ``start // P``, the decode rank's send-range pages after its prefix pages.
    """
    _, _, src_table, _ = prefill_page_table(cfg, 0)
    send_pool = decode_pools(cfg)[0]
    p, n = cfg.page_size, cfg.dcp_size
    out = {"direct": 0, "packed": 0}
    for r in range(n):
        dst_table = decode_page_table(cfg, r, n, send_pool)
        prefix_pages = len(owned_tokens(0, cfg.prefix_tokens, n, r, cfg.interleave_size)[0]) // p
        for start, length in cfg.chunks():
            tp = planmod.build_token_transfer_plan(
                src_table[start // p: start // p + -(-length // p)], dst_table[prefix_pages:], page_size=p,
                dcp_size=n, dcp_rank=r, interleave_size=cfg.interleave_size,
                src_page_offset=(start - cfg.prefix_tokens) // p, decode_prefix_len=cfg.prefix_tokens,
                num_kv_tokens=length)
            layers = cfg.geometry.num_layers
            out["direct"] += layers * len(planmod.group_runs(tp.src_token_indices, tp.dst_token_indices))
            rows = len(tp.src_token_indices)
            out["packed"] += layers * len(planmod.group_runs(np.arange(rows), tp.dst_token_indices))
    return out


def _check_run(run: dict, cfg: JobConfig) -> None:
    assert run["verified"], run["failures"] or run["ranks"]
    assert run["bytes"] == cfg.geometry.request_bytes(cfg.send_tokens)
    assert sum(r["bytes"] for r in run["ranks"]) == run["bytes"]
    for r in run["ranks"]:
        assert r["bytes_exact"] and r["bad_rows"] == 0 and r["bad_sentinel_rows"] == 0
        assert r["status"] == "success" and not r["errors"]
        assert r["rows"] == len(owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.dcp_size,
                                             r["dcp_rank"], cfg.interleave_size)[0])


def test_small_job_both_modes_nixl_matches_plan():
    cfg = JobConfig(**SMALL, engine="nixl")
    res = run_job(cfg)
    assert res["verified"] and [r["mode"] for r in res["runs"]] == ["direct", "packed"]
    assert res["warmup_seconds"] > 0  # untimed warm-up ran before the timed requests (and is not counted)
    # The environment switches in effect (an A/B's two files tell which is which): the defaults here
    # ("windows", a sender's round in one direct launch, is off unless DCP_JAX_DIRECT_ON names it).
    assert res["switches"] == {"direct_launch": True, "direct_off": ["windows"], "fused_flag_gate": True,
                               "pack_ticket_each": False}
    want = _expected_descriptors(cfg)
    for run in res["runs"]:
        _check_run(run, cfg)
        assert run["engine"] == "nixl" and run["warmup_seconds"] > 0
        # Each sender's kernels were warmed once its ranks linked (host KV compiles none).
        assert run["kernel_warm_up"]["pack"] == run["kernel_warm_up"]["fused"] == run["kernel_warm_up"]["unpack"] == []
        assert run["kernel_warm_up"]["seconds"] >= 0
        assert run["descriptors"] == want[run["mode"]]
        # One engine call per (chunk, rank): all layer entries in one batch.
        assert run["batches"] == run["engine_calls"] == cfg.dcp_size
        assert all(r["batches"] == r["engine_calls"] == 1 for r in run["ranks"])
        assert all(r["strategy"] == run["mode"] for r in run["ranks"])
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
        # Per-rank engine calls (Mooncake: one per 1024-descriptor window plus the notification).
        assert sum(r["engine_calls"] for r in run["ranks"]) == run["engine_calls"] == 2 * run["batches"]
        assert all(r["checksum_ok"] is True and r["chunks"] == chunks for r in run["ranks"])


def test_mooncake_engine_calls_per_rank_count_1024_descriptor_windows():
    # 4096 rows x 3 layer entries of token round-robin = 12,288 descriptors per rank in ONE batch,
    # which Mooncake submits as 12 windows of 1024, then its completion notification: 13 calls.
    cfg = JobConfig(model="tiny", prompt_tokens=8192, page_size=16, dcp_size=2, engine="mooncake",
                    modes=("direct",), timeout_s=20.0)
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert [(r["descriptors"], r["batches"], r["engine_calls"]) for r in run["ranks"]] == [(12288, 1, 13)] * 2
    assert run["batches"] == 2 and run["engine_calls"] == 26


@pytest.mark.parametrize("m, n, ip, i", [(2, 4, 1, 1), (4, 2, 8, 16)], ids=lambda v: str(v))
def test_prefill_dcp_m_to_decode_dcp_n(m, n, ip, i):
    cfg = JobConfig(model="tiny", prompt_tokens=600, page_size=16, dcp_size=n, prefill_dcp_size=m,
                    interleave_size=i, prefill_interleave_size=ip, chunk_tokens=256 if m == 2 else None,
                    timeout_s=20.0)
    res = run_job(cfg)
    # (chunk, source, destination) triples with rows, brute force from the ownership formulas.
    pairs = set()
    for k in range(m):
        toks, _ = owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, m, k, ip)
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
    # than shard / N; the pack buffer must still hold them.
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
    # Each (source, destination) pair of 512 rows goes in slices of the 256-row buffer.
    assert run["batches"] == with_rows * 2


def test_block_round_robin_sliced_pack_and_windows():
    # I = P: direct needs no packing, and uses at most 1/P of token round-robin's descriptors.
    base = dict(SMALL, model="tiny", prompt_tokens=1024, modes=("direct",))
    tok = run_job(JobConfig(**base))["runs"][0]
    blk = run_job(JobConfig(**base, interleave_size=16))["runs"][0]
    assert tok["verified"] and blk["verified"]
    assert blk["descriptors"] * 16 <= tok["descriptors"]
    # A pack buffer for 120 tokens (120 rows) forces sliced packing, and windows of 25 rows split
    # every slice; both still byte-exact.
    cfg = JobConfig(**dict(SMALL, modes=("packed",)), pack_tokens=120, max_batch_indices=25)
    run = run_job(cfg)["runs"][0]
    _check_run(run, cfg)
    assert all(r["strategy"] == "sliced" for r in run["ranks"])
    region = pack_bytes(cfg, 0) // cfg.geometry.row_bytes
    assert region == 120
    assert run["batches"] == sum(-(-r["rows"] // min(25, region)) for r in run["ranks"])


def test_corrupted_byte_is_caught_by_checksum_and_full_verification():
    cfg = JobConfig(**dict(SMALL, modes=("packed",)), verify=True, corrupt_rank=1)
    res = run_job(cfg)
    assert not res["verified"]
    ranks = res["runs"][0]["ranks"]
    assert [r["verified"] for r in ranks] == [True, False, True]
    assert ranks[1]["status"] == "success"  # the connector delivered; the damage came after
    assert ranks[1]["checksum_ok"] is False and ranks[1]["bad_rows"] == 1
    assert [tuple(x) for x in ranks[1]["bad_checksums"]] == [(0, cfg.geometry.num_layers - 1)]


def test_requests_stop_at_the_first_unverified_one_and_report_it():
    """requests=3 with a rank that damages a byte of every timed request: the mode stops after
    the first (a failed request ends it) and its run is that request, not verified; with a
    clean pool, three requests are all verified and the run is the median one."""
    bad = run_job(JobConfig(**dict(SMALL, modes=("packed",)), corrupt_rank=1, requests=3))["runs"][0]
    assert not bad["verified"] and "repeats" not in bad
    assert [r["verified"] for r in bad["ranks"]] == [True, False, True]
    good = run_job(JobConfig(**dict(SMALL, modes=("packed",)), requests=3))["runs"][0]
    secs = [r["request_seconds"] for r in good["repeats"]]
    assert good["verified"] and len(secs) == 3 and good["request_seconds"] == sorted(secs)[1]
    assert all(r["whole_gbps"] > 0 and r["timeline_ms"] for r in good["repeats"])
    assert all(r["verified"] for r in good["ranks"]) and good["bytes"] == bad["bytes"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_decode_killed_mid_request_then_next_request_to_survivors(engine):
    """Decode process 1 SIGKILLs itself after its first chunk landed: the mode fails within the
    grace period (the others abort through the connector, nobody waits out timeout_s), and the same
    prefill process then serves the two survivors as a DCP-2 group, byte-exact."""
    cfg = JobConfig(model="tiny", prompt_tokens=2048, page_size=16, dcp_size=3, chunk_tokens=256,
                    engine=engine, timeout_s=60.0, modes=("packed",), die_rank=1, die_after_chunks=1)
    tag = uuid.uuid4().hex[:8]
    prefills, decodes, _ = start_processes(cfg, tag=tag, min_dcp_size=2)
    try:
        t0 = time.monotonic()
        run = run_mode(cfg, "packed", f"{tag}-a", prefills, decodes)
        assert time.monotonic() - t0 < 30
        assert not run["verified"] and run["failures"]
        assert any(f.startswith("decode process 1 exited") for f in run["failures"]), run["failures"]
        assert not decodes[1].alive
        # The survivors were told to abort: the connector ended the request there (no timeout), or
        # it had already delivered every byte of theirs.
        for r in (0, 2):
            rank = run["ranks"][r]
            if rank["status"] == "success":
                assert rank["verified"] and rank["bytes_exact"], rank
            else:
                assert not rank["verified"] and rank["status"] in ("aborted", "failed") and rank["errors"], rank
        survivors = [decodes[0], decodes[2]]
        group = dataclasses.replace(cfg, dcp_size=2, die_rank=None)
        run = run_mode(cfg, "packed", f"{tag}-b", prefills, survivors)
        _check_run(run, group)
        assert [r["dcp_rank"] for r in run["ranks"]] == [0, 1]
    finally:
        stop_all(prefills + decodes)


def test_job_level_death_reports_failure_without_hanging():
    cfg = JobConfig(**dict(SMALL, modes=("packed",), timeout_s=8.0), chunk_tokens=64, die_rank=2,
                    die_after_chunks=2)
    t0 = time.monotonic()
    res = run_job(cfg)
    assert time.monotonic() - t0 < 90
    run = res["runs"][0]
    assert not res["verified"] and not run["verified"] and run["failures"]
    assert run["ranks"][2]["verified"] is False


def test_death_in_first_mode_fails_the_next_mode_with_a_message():
    # Decode rank 2 dies in the direct mode; the packed mode must not start on the dead process
    # and says why. The survivors must not wait out timeout_s for a request that cannot finish.
    cfg = JobConfig(**dict(SMALL, modes=("direct", "packed"), timeout_s=120.0), chunk_tokens=64,
                    die_rank=2, die_after_chunks=2)
    t0 = time.monotonic()
    res = run_job(cfg)
    assert time.monotonic() - t0 < 90
    direct, packed = res["runs"]
    assert not direct["verified"] and direct["failures"]
    assert not packed["verified"] and packed["failures"][0].startswith("mode not started")
    assert "decode process 2" in packed["failures"][0] and "exited" in packed["failures"][0]
    assert "comparison" not in res and not res["verified"]


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(model="llama"), "deepseek-v3"),
        (dict(prompt_tokens=0), "prompt_tokens"),
        (dict(page_size=-64), "page_size"),
        (dict(dcp_size=0), "dcp_size"),
        (dict(interleave_size=0), "interleave_size"),
        (dict(prefix_tokens=64), r"prefix_tokens=64 \(--prefix-tokens\) must be a multiple of 512"),
        (dict(prefix_tokens=32768), "prefix_tokens"),
        (dict(chunk_tokens=100), r"chunk_tokens=100 \(--chunk-tokens\) must be a multiple of page_size=64"),
        (dict(modes=("fast",)), "modes"),
        (dict(engine="ucx"), "engine"),
        (dict(max_batch_indices=0), "max_batch_indices"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(timeout_s=float("nan")), "timeout_s"),
        (dict(timeout_s=1e7), "timeout_s"),
        (dict(requests=0), "requests=0"),
        (dict(requests=True), "requests=True"),
        (dict(requests=2.0), "requests=2.0"),
        (dict(round_rows=0), r"round_rows=0 \(--round-rows\) must be an int >= 1"),
        (dict(round_rows=1.5), "round_rows=1.5"),
        (dict(dcp_size=65), r"dcp_size=65 \(--dcp-size\) must be <= 64"),
        (dict(prefill_dcp_size=65), r"prefill_dcp_size=65 \(--prefill-dcp-size\) must be <= 64"),
        (dict(corrupt_rank=8), "corrupt_rank"),
        (dict(die_after_chunks=0), "die_after_chunks"),
        (dict(modes=("packed", "fused")), "--path fused"),
        (dict(modes=(" packed",)), r"modes=\(' packed',\) \(--path\) must be distinct names of"),
        (dict(prefill_interleave_size=16), r"^--prefill-interleave-size=16 needs --prefill-dcp-size > 1: one prefill "
                                           r"rank holds every token"),
    ],
)
def test_bad_config_names_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        JobConfig(**kwargs)


def test_host_memory_estimate_covers_the_buffers_and_refuses_the_impossible():
    from dcp_jax.job.kv import check_host_memory, estimate_host_bytes

    cfg = JobConfig(**SMALL)
    row = cfg.geometry.row_bytes
    # At least the whole request on each side (prefill pool + pack, the decode pools).
    assert estimate_host_bytes(cfg) >= 2 * cfg.send_tokens * row
    assert estimate_host_bytes(cfg) >= 3 * decode_pool_pages(cfg) * cfg.page_size * row
    check_host_memory(cfg)  # a small job fits
    # 2**20-token pages (the connector's largest) of DeepSeek-V3 rows (70 KB): 73 GB per pool
    # page for a 512-token request.
    with pytest.raises(ValueError, match="GiB of host memory.*page_size=1048576"):
        check_host_memory(JobConfig(**dict(SMALL, model="deepseek-v3", page_size=2**20, prompt_tokens=512)))


def test_owned_tokens_matches_layout_reference():
    from dcp_jax.layout import local_index_np, owner_np

    for n, i, start in [(3, 1, 0), (4, 16, 128), (2, 5, 20)]:
        for r in range(n):
            t, j = owned_tokens(start, 300, n, r, i)
            ref = np.arange(start, 300)
            ref = ref[owner_np(ref, n, i) == r]
            np.testing.assert_array_equal(t, ref)
            np.testing.assert_array_equal(j, local_index_np(ref, n, i))  # from token 0 (spec section 10)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_page_tables_cover_the_prefix_from_token_0(m):
    # Prefix 96 on DCP3 decode ranks: 32 rows each, two whole pages. On the prefill side M = 1 and
    # M = 3 hold whole prefix pages too; M = 2 holds 48 rows of it (three pages: whole as well).
    cfg = JobConfig(**dict(SMALL, prefill_dcp_size=m), prefix_tokens=96, chunk_tokens=96)
    p = cfg.page_size
    for k in range(m):
        tokens, local, table, pool = prefill_page_table(cfg, k)
        rows = len(owned_tokens(0, cfg.prompt_tokens, m, k, 1)[0])
        assert len(table) == -(-rows // p) and len(set(table.tolist())) == len(table) and table.max() < pool
        assert tokens.min() >= cfg.prefix_tokens and local.max() < len(table) * p
    send_pool, pool = decode_pools(cfg)
    assert pool == decode_pool_pages(cfg) == send_pool + 2
    for r in range(cfg.dcp_size):
        table = decode_page_table(cfg, r, cfg.dcp_size, send_pool)
        rows = len(owned_tokens(0, cfg.prompt_tokens, cfg.dcp_size, r, 1)[0])
        assert len(table) == -(-rows // p) and len(set(table.tolist())) == len(table) and table.max() < pool
        # The prefix's pages come first and are never drawn: [send_pool, send_pool + 2).
        assert table[:2].tolist() == [send_pool, send_pool + 1] and table[2:].max() < send_pool


@pytest.mark.parametrize("kw", [
    dict(),
    dict(prefix_tokens=96, chunk_tokens=96),
    dict(prefill_dcp_size=2, prefix_tokens=48, chunk_tokens=64, seed=5),  # 24 prefix rows: not whole pages
    dict(prefill_dcp_size=3, prefill_interleave_size=2, interleave_size=4, prefix_tokens=192),
])
def test_plan_counts_on_the_job_page_tables(kw):
    """`dcp-jax plan` (dcp_jax.cost) draws the job's page tables itself: its counts on the tables
    the job hands the connector equal its counts on its own."""
    from dcp_jax.cost import CostConfig, cost_report

    cfg = JobConfig(**{**SMALL, **kw})
    geo = cfg.geometry
    cc = CostConfig(num_layers=geo.num_layers, item_lens=tuple(geo.kv_item_lens), prompt_tokens=cfg.prompt_tokens,
                    decode_prefix_len=cfg.prefix_tokens, chunk_tokens=cfg.chunk_tokens, page_size=cfg.page_size,
                    prefill_dcp_size=cfg.prefill_dcp_size, prefill_interleave_size=cfg.prefill_interleave_size,
                    dcp_size=cfg.dcp_size, interleave_size=cfg.interleave_size, seed=cfg.seed,
                    pool_slack=cfg.pool_slack)
    src, dst = request_page_tables(cfg)
    ours = cost_report(cc, src_page_tables=src, dst_page_tables=dst)
    assert ours == cost_report(cc)
    assert sum(r["bytes"] for r in ours) == 2 * geo.request_bytes(cfg.send_tokens)  # both modes


@pytest.mark.parametrize("kw", [
    dict(model="tiny", prompt_tokens=512, page_size=16, dcp_size=2, chunk_tokens=256),
    dict(model="tiny", prompt_tokens=1024, page_size=16, dcp_size=4, interleave_size=16),
    dict(model="tiny-mixed", prompt_tokens=2048, page_size=8, dcp_size=8, prefill_dcp_size=2, chunk_tokens=256),
])
def test_default_pack_holds_every_unit_at_once(kw):
    """The default pack buffer holds every (chunk, decode rank) unit of the request at once, each
    rounded up to the arena's alignment, so nothing waits for room and nothing is sliced."""
    cfg = JobConfig(**kw)
    row = cfg.geometry.row_bytes
    for k in range(cfg.prefill_dcp_size):
        toks = owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.prefill_dcp_size, k, 1)[0]
        owner = (toks // cfg.interleave_size) % cfg.dcp_size
        units = [int(np.count_nonzero((owner == r) & (toks >= s) & (toks < s + n)))
                 for s, n in cfg.chunks() for r in range(cfg.dcp_size)]
        need = sum(-(-u * row // PACK_ALIGN) * PACK_ALIGN for u in units)
        assert need <= pack_bytes(cfg, k)
        assert max(units) <= pack_bytes(cfg, k) // row
    forced = dataclasses.replace(cfg, pack_tokens=100)
    assert pack_bytes(forced, 0) == cfg.dcp_size * -(-100 // cfg.dcp_size) * row  # spec section 6
