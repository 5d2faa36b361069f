"""`dcp-jax load`: end-to-end runs through the Python entry (real engines, real processes), the
request plan, the pool's stray-write checks, and option errors naming the option."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from bridge.mooncake import mooncake_available
from bridge.nixl import nixl_available
from dcp_jax.cli import app
from dcp_jax.kv_data import SENTINEL_BYTE, row_pattern
from dcp_jax.loadgen import LoadConfig, load_command, plan_requests
from dcp_jax.loadgen.pool import PagePool, owned_tokens

REQUIRED_KEYS = ("requests", "succeeded", "failed", "aborted", "bytes_verified", "misattributed_messages",
                 "sentinel_violations", "kernel_compiles_after_warmup", "rss_growth_bytes",
                 "registered_bytes_after_close", "requests_per_s", "p50_ms", "p99_ms")

_RUNS = [("nixl", "push", nixl_available()), ("nixl", "pull", nixl_available()),
         ("mooncake", "push", mooncake_available())]
#: The (engine, direction) runs, each skipped where its engine does not import.
_ENGINE_RUNS = pytest.mark.parametrize("engine,direction", [
    pytest.param(e, d, id=f"{e}-{d}", marks=pytest.mark.skipif(not ok, reason=f"{e} does not import here"))
    for e, d, ok in _RUNS])


@pytest.mark.slow
@pytest.mark.timeout(240)
@_ENGINE_RUNS
def test_load_run_end_to_end(tmp_path, engine, direction):
    cfg = LoadConfig(engine=engine, direction=direction, requests=200, concurrency=32, abort_fraction=0.1,
                     max_tokens=256, warmup=16, seed=3)
    out = tmp_path / "r.json"
    rc = load_command(cfg, out, progress=False)
    rep = json.loads(out.read_text())
    assert rc == 0, rep["failures"]
    assert set(REQUIRED_KEYS) <= set(rep)
    plans = plan_requests(cfg)
    aborted = [p for p in plans if p.abort is not None]
    assert len(aborted) == 20
    assert rep["ok"] is True and rep["failures"] == []
    assert rep["requests"] == 200 and rep["finished"] == 200
    assert rep["succeeded"] == 180 and rep["aborted"] == 20 and rep["failed"] == 0
    # Every byte of every succeeded request was compared on its rank: tokens x row bytes, once each.
    row = sum(cfg.geometry.kv_item_lens)
    assert rep["bytes_verified"] == sum(p.num_tokens * row for p in plans if p.abort is None)
    assert rep["misattributed_messages"] == 0 and rep["inconsistent_messages"] == 0
    assert rep["sentinel_violations"] == 0 and rep["source_rows_corrupted"] == 0
    assert rep["kernel_compiles_after_warmup"] == 0
    assert 0 <= rep["rss_growth_bytes"] < 100 << 20
    assert rep["registered_bytes_live"] > 0
    assert rep["registered_bytes_after_close"] == rep["registered_bytes_before"] == 0
    assert rep["requests_per_s"] > 0 and rep["gb_per_s"] > 0
    assert 0 < rep["p50_ms"] <= rep["p99_ms"] <= rep["max_ms"]
    assert rep["measured_requests"] == 200 - 16
    assert rep["aborted_by"]["sender"] > 0 and rep["aborted_by"]["receiver"] > 0
    assert rep["dropped_messages"] >= 0
    assert rep["unsuccessful_drain_max_ms"] >= 0  # aborted pages were reused only once drained
    assert rep["config"]["engine"] == engine and rep["config"]["direction"] == direction
    sides = rep["sides"]
    assert set(sides) == {"sender", "receiver0", "receiver1"}
    for name, side in sides.items():
        assert side["unfinished"] == 0 and side["end_violations"] == 0, name
        assert side["pool"]["free_pages"] == side["pool"]["pool_pages"], name
        assert side["stats"]["worker_errors"] == 0, name
        assert side["stats"]["aborted"] == 20 and side["stats"]["failed"] == 0, name
        assert side["stats"]["succeeded"] == 180, name
        assert side["own_process_group"] is True, name  # a SIGSTOP in a soak hangs up no other process
    assert sides["receiver0"]["stats"]["connections"] == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
@_ENGINE_RUNS
def test_load_run_through_receive_regions(tmp_path, engine, direction):
    # --mode region: one descriptor a window into each rank's receive region (one longest
    # request's share), so concurrent requests queue for its room; every range comes back.
    cfg = LoadConfig(engine=engine, direction=direction, mode="region", requests=100, concurrency=16,
                     abort_fraction=0.1, max_tokens=256, warmup=8, seed=5)
    out = tmp_path / "r.json"
    rc = load_command(cfg, out, progress=False)
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["ok"], rep["failures"]
    plans = plan_requests(cfg)
    row = sum(cfg.geometry.kv_item_lens)
    assert rep["succeeded"] == 90 and rep["aborted"] == 10 and rep["failed"] == 0
    assert rep["bytes_verified"] == sum(p.num_tokens * row for p in plans if p.abort is None)
    assert rep["sentinel_violations"] == 0 and rep["misattributed_messages"] == 0
    assert rep["regions_held_at_end"] == {"sender": 0, "receiver0": 0, "receiver1": 0}
    for r in (0, 1):
        stats = rep["sides"][f"receiver{r}"]["stats"]
        assert stats["region"]["capacity"] == cfg.region_bytes() == 128 * row  # 8,192 B: already aligned
        assert stats["unpacks"] >= 90  # at least one window per succeeded request
        assert stats["region"]["waits"] > 0  # 16 in flight against room for one: they queued
        assert stats["region"]["regions_in_use"] == 0 and stats["region"]["quarantined_bytes"] == 0


def test_region_bytes_is_one_longest_requests_share_aligned():
    g = LoadConfig(model="tiny").geometry
    assert LoadConfig(mode="region", max_tokens=256, dcp_size=2).region_bytes() == 128 * g.row_bytes
    # rank 0 owns 4 of 7 tokens with I = 2 (tokens 0, 1, 4, 5): 4 rows, rounded up to 64 bytes
    assert LoadConfig(mode="region", max_tokens=7, dcp_size=2, interleave_size=2).region_bytes() == \
        -(-4 * g.row_bytes // 64) * 64
    assert LoadConfig(mode="packed").region_bytes() is None


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not nixl_available(), reason="NIXL does not import here")
def test_injected_faults_fail_the_run(tmp_path):
    # Decode rank 0 writes one byte into a free page and flips one byte of a succeeded request:
    # the run must say so (one sentinel violation, one SUCCESS with wrong bytes) and exit 1.
    cfg = LoadConfig(requests=40, concurrency=8, abort_fraction=0.1, max_tokens=64, warmup=4,
                     inject="stray_write,corrupt_row")
    out = tmp_path / "r.json"
    assert load_command(cfg, out, progress=False) == 1
    rep = json.loads(out.read_text())
    assert rep["ok"] is False
    assert rep["sentinel_violations"] == 1 and rep["succeeded_wrong_bytes"] == 1
    assert rep["misattributed_messages"] == 1
    assert any("sentinel_violations=1" in f for f in rep["failures"])
    assert any("misattributed_messages=1" in f for f in rep["failures"])
    plans = plan_requests(cfg)
    row, first = sum(cfg.geometry.kv_item_lens), cfg.geometry.kv_item_lens[0]
    assert rep["bytes_verified"] == sum(p.num_tokens * row for p in plans if p.abort is None) - first
    assert rep["succeeded"] == 36 and rep["aborted"] == 4 and rep["failed"] == 0


@pytest.mark.timeout(120)
@pytest.mark.skipif(not nixl_available(), reason="NIXL does not import here")
def test_a_warmup_covering_the_run_says_so_and_claims_no_check_after_it(tmp_path):
    # Before (fresh-user trial): --warmup 100 --requests 5 reported kernel_compiles_after_warmup=0
    # and an RSS growth as if a phase had run after a warm-up; none had.
    cfg = LoadConfig(requests=5, concurrency=2, max_tokens=32, dcp_size=2, warmup=100, seed=5)
    out = tmp_path / "r.json"
    assert load_command(cfg, out, progress=False) == 0
    rep = json.loads(out.read_text())
    assert rep["warmup_covers_run"] is True and rep["measured_requests"] == 5 and rep["succeeded"] == 5
    assert rep["kernel_compiles_after_warmup"] is None and rep["rss_growth_bytes"] is None
    assert set(rep["rss_growth_by_process"].values()) == {None}  # nor per process (fresh-user trial)
    assert rep["bytes_verified"] == sum(p.num_tokens for p in plan_requests(cfg)) * sum(cfg.geometry.kv_item_lens)


def test_a_run_that_measures_no_request_fails_and_says_why(tmp_path):
    # Before (fresh-user trial): --duration-s 0.000001 ended the measured phase before its first
    # request; the run reported "all checks passed" with 0 measured requests and no latency.
    cfg = LoadConfig(requests=1000, concurrency=2, max_tokens=16, dcp_size=1, warmup=2, duration_s=1e-6, seed=5)
    out = tmp_path / "r.json"
    assert load_command(cfg, out, progress=False) == 1
    rep = json.loads(out.read_text())
    assert rep["ok"] is False and rep["measured_requests"] == 0 and rep["issued"] == 2 == rep["finished"]
    assert any("no request was measured (2 issued, 2 of them warm-up; --duration-s=1e-06" in f
               for f in rep["failures"]), rep["failures"]


def test_plans_are_drawn_lazily_in_the_same_sequence():
    from itertools import islice

    from dcp_jax.loadgen.config import iter_plans

    cfg = LoadConfig(requests=300, abort_fraction=0.3, max_tokens=40, dcp_size=2, seed=11)
    assert list(iter_plans(cfg)) == plan_requests(cfg)
    big = LoadConfig(requests=10_000_000, abort_fraction=0.0, max_tokens=8, seed=1)
    first = list(islice(iter_plans(big), 3))  # no ten million plans built for three
    assert [p.index for p in first] == [0, 1, 2] and first[0].rid == "load-1-0"


def test_plan_is_seeded_and_well_formed():
    cfg = LoadConfig(requests=500, abort_fraction=0.2, max_tokens=40, dcp_size=3, seed=7)
    plans = plan_requests(cfg)
    assert plans == plan_requests(cfg)
    assert len({p.rid for p in plans}) == 500 and len({p.seed for p in plans}) == 500
    assert sum(p.abort is not None for p in plans) == 100
    assert {len(p.chunks) for p in plans} == {1, 2, 3, 4}
    for p in plans:
        assert 1 <= p.num_tokens <= 40
        assert p.chunks[0][0] == 0 and p.chunks[-1][1] == p.num_tokens
        assert all(a < b for a, b in p.chunks) and all(p.chunks[k][1] == p.chunks[k + 1][0]
                                                        for k in range(len(p.chunks) - 1))
        if p.abort is not None:
            assert -1 <= p.abort.by < 3
            assert p.abort.point == "before_send" or len(p.chunks) > 1
    assert {p.abort.by for p in plans if p.abort} == {-1, 0, 1, 2}
    assert {p.abort.point for p in plans if p.abort} == {"before_send", "after_first_chunk"}
    assert sum(p.abort is not None for p in plan_requests(LoadConfig(requests=10, abort_fraction=0))) == 0
    assert all(p.abort is not None for p in plan_requests(LoadConfig(requests=10, abort_fraction=1)))


def test_owned_tokens_match_the_spec_examples():
    # spec section 2: N=2, I=1, L=129 -> [65, 64]; N=2, I=4, L=9 -> [5, 4]
    assert [len(owned_tokens(129, 2, r, 1)) for r in (0, 1)] == [65, 64]
    assert [len(owned_tokens(9, 2, r, 4)) for r in (0, 1)] == [5, 4]
    assert owned_tokens(9, 2, 1, 4).tolist() == [4, 5, 6, 7]


def test_pool_catches_stray_writes():
    pool = PagePool((16, 8), 12, 4, np.random.default_rng(0))
    table = pool.allocate(6)  # 2 pages
    assert len(table) == 2 and len(pool.free) == 10
    toks = np.arange(6)
    pool.fill(table, toks, seed=5)
    assert pool.verify(table, toks, seed=5) == (0, 0)
    assert pool.bytes_verified == 6 * 24
    # Another request's rows (another seed) are not this request's bytes.
    assert pool.verify(table, toks, seed=6)[0] == 12
    # A write past the request's last row (its last page's tail) is a sentinel violation.
    pool.layers[1][table[1], 3, 0] ^= 1
    assert pool.verify(table, toks, seed=5) == (0, 1)
    pool.give_back(table)
    assert len(pool.free) == 12 and (pool.layers[0][table] == SENTINEL_BYTE).all()
    # A write into a free page is caught when the page is handed out again, or at the end.
    victim = pool.free[0]
    pool.layers[0][victim, 2, 5] = 0
    before = pool.sentinel_violations
    assert pool.check_free() == 1 and pool.sentinel_violations == before + 1
    got = [pool.allocate(4) for _ in range(12)]
    assert pool.sentinel_violations == before + 2 and victim in np.concatenate(got)
    assert pool.first_problem
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(1)


def test_pool_partial_check_of_an_aborted_request():
    pool = PagePool((16,), 8, 4, np.random.default_rng(1))
    table, toks = pool.allocate(8), np.arange(8)
    rows = table[toks // 4] * 4 + toks % 4
    flat = pool.layers[0].reshape(-1, 16)
    flat[rows[:3]] = row_pattern(toks[:3], 0, 16, 9)        # the first chunk landed
    flat[rows[3], :7] = row_pattern(toks[3:4], 0, 16, 9)[0, :7]  # a write cut short
    assert pool.check_partial(table, toks, seed=9) == 0      # its own bytes or the sentinel
    flat[rows[5]] = row_pattern(toks[5:6], 0, 16, 10)        # another request's row
    assert pool.check_partial(table, toks, seed=9) == 1 and pool.partial_rows_foreign == 1


@pytest.mark.parametrize("kwargs,option", [
    (dict(requests=-1), "--requests"), (dict(requests=0), "--requests"),
    (dict(abort_fraction=1.5), "--abort-fraction"), (dict(abort_fraction=-0.1), "--abort-fraction"),
    (dict(engine="gloo"), "--engine"), (dict(direction="sideways"), "--direction"),
    (dict(concurrency=0), "--concurrency"), (dict(dcp_size=0), "--dcp-size"),
    (dict(max_tokens=0), "--max-tokens"), (dict(page_size=0), "--page-size"),
    (dict(model="gpt-2"), "--model"), (dict(timeout_s=0), "--timeout-s"), (dict(mode="fast"), "--mode"),
    # Below twice the connector's ping interval every side refuses it: before, the run started and
    # failed all requests.
    (dict(peer_timeout_s=0.1), r"--peer-timeout-s=0.1 must be >= 1"),
    # The connector's own range, (0, 86400] s: before (fresh-user trial), 100000 passed here and
    # every receiver raised at start (exit 1, "only 0 of 3 requests were issued").
    (dict(timeout_s=100000), r"--timeout-s=100000 must be in \(0, 86400\]"),
    (dict(peer_timeout_s=100000), r"--peer-timeout-s=100000 must be in \(0, 86400\]"),
    (dict(timeout_s="5"), "--timeout-s must be a number"), (dict(timeout_s=float("nan")), "--timeout-s"),
    (dict(max_rss_growth_mb=0), "--max-rss-growth-mb=0 must be a positive number of MiB"),
])
def test_bad_options_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        LoadConfig(**kwargs)


@pytest.mark.parametrize("args,option", [
    (["--requests", "-5"], "--requests"), (["--abort-fraction", "2"], "--abort-fraction"),
    (["--abort-fraction", "-0.5"], "--abort-fraction"), (["--engine", "ucx"], "--engine"),
    (["--direction", "both"], "--direction"), (["--json", "/no/such/folder/r.json"], "--json"),
    (["--timeout-s", "100000"], "--timeout-s"), (["--peer-timeout-s", "100000"], "--peer-timeout-s"),
    # Before: taken, then nothing drawn (a plain run takes no samples), exit 0.
    (["--plot", "x.png", "--requests", "3", "--warmup", "0"], "--plot needs --netns or --duration-s"),
])
def test_cli_refuses_bad_options(args, option):
    res = CliRunner().invoke(app, ["load", *args])
    assert res.exit_code == 2, res.output
    assert option in res.output


def test_the_pool_guard_counts_whole_pages():
    # Before: one token per request passed the 8 GiB guard with 65,536-token pages, and every
    # receiver then failed allocating its pool (37.8 TB).
    from dcp_jax.loadgen.config import LoadConfig

    with pytest.raises(ValueError, match=r"--page-size=65536 .* needs [\d,.]+ GiB of KV pool per side, more than 8"):
        LoadConfig(model="deepseek-v3", page_size=65536, max_tokens=1, concurrency=4096)
    cfg = LoadConfig(model="deepseek-v3", page_size=16, max_tokens=16, concurrency=64)
    assert cfg.pool_pages(16) * 16 * cfg.geometry.row_bytes <= 8 << 30
