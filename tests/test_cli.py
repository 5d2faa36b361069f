"""`dcp-jax` CLI: a small real `transfer` run with its JSON, a corrupted run's exit status, bad input."""
import json

import pytest
from typer.testing import CliRunner

from dcp_jax.cli import app

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()
SMALL = ["--model", "tiny-mixed", "--prompt-tokens", "500", "--dcp-size", "2", "--page-size", "16",
         "--no-progress", "--timeout-s", "20"]


def test_transfer_writes_json_and_verifies(tmp_path):
    out = tmp_path / "run.json"
    res = runner.invoke(app, ["transfer", *SMALL, "--json", str(out), "--chunk-tokens", "128", "--verify"])
    assert res.exit_code == 0, res.output
    assert "verified" in res.output and "mode direct" in res.output and "mode packed" in res.output
    data = json.loads(out.read_text())
    assert data["config"]["model"] == "tiny-mixed" and data["config"]["chunks"] == 4
    assert data["verified"] is True
    assert "transfer_batch" in data["legend"]["batches"] and "Mooncake" in data["legend"]["engine_calls"]
    modes = {r["mode"]: r for r in data["runs"]}
    assert set(modes) == {"direct", "packed"}
    for r in data["runs"]:
        for key in ("engine", "descriptors", "bytes", "engine_calls", "pack_seconds", "transfer_seconds",
                    "total_seconds", "verified"):
            assert key in r
        assert r["engine"] == "nixl" and r["verified"] is True
        assert r["bytes"] == 500 * (48 + 16 + 96 + 8)
        assert [x["dcp_rank"] for x in r["ranks"]] == [0, 1] and all(x["checksum_ok"] for x in r["ranks"])
        assert r["engine_calls"] == 4 * 2  # one per (chunk, rank)
    assert modes["packed"]["descriptors"] < modes["direct"]["descriptors"]
    assert data["comparison"]["descriptor_ratio"] > 1


def test_corrupted_byte_exits_nonzero(tmp_path):
    out = tmp_path / "bad.json"
    args = [a for a in SMALL if a != "--no-progress"]  # with the progress bar this time
    res = runner.invoke(app, ["transfer", *args, "--mode", "packed", "--corrupt-rank", "0", "--json", str(out)])
    assert res.exit_code == 1, res.output
    assert "NOT VERIFIED" in res.output and "packed (chunk, rank) batches" in res.output
    data = json.loads(out.read_text())
    assert data["verified"] is False and data["runs"][0]["ranks"][0]["bad_rows"] == 1


@pytest.mark.parametrize(
    "args, text",
    [
        (["--model", "llama-70b"], "valid names: deepseek-v3"),
        (["--dcp-size", "-2"], "dcp_size=-2"),
        (["--prompt-tokens", "-5"], "prompt_tokens=-5"),
        (["--page-size", "0"], "page_size=0"),
        (["--mode", "sideways"], "--mode"),
        (["--path", "packed,teleport"], "--path='packed,teleport'"),
        (["--path", "region,region"], "distinct names"),
        # Names exactly, once: " packed" was stripped into a packed run; a second --path replaced the first.
        (["--path", " packed"], "--path=' packed': ' packed' is not a path name; --path takes a comma list (no spaces)"),
        (["--path", "packed,"], "--path='packed,': '' is not a path name"),
        (["--path", "packed", "--path", "region"], "--path given 2 times ('packed', 'region'): give it once"),
        (["--engine", "jax-transfer", "--device", "gpu", "--staging", "none"], "--engine"),
        (["--staging", "disk"], "--staging"),
        (["--pack-backend", "nope", "--staging", "host"], "--pack-backend"),
        (["--engine", "rdma"], "engine='rdma'"),
        (["--chunk-tokens", "100"], "chunk_tokens=100"),
        (["--prefix-tokens", "64"], "prefix_tokens=64"),
        (["--dcp-size", "100"], "dcp_size=100 (--dcp-size) must be <= 64"),
        (["--round-rows", "0"], "round_rows=0 (--round-rows) must be an int >= 1"),
        (["--timeout-s", "3000000"], "timeout_s=3000000.0 (--timeout-s) must be in [1, 86400]"),
        (["--timeout-s", "0"], "timeout_s=0.0 (--timeout-s) must be in [1, 86400]"),
        (["--timeout-s", "inf"], "timeout_s=inf"),
        (["--requests", "0"], "requests=0 (--requests) must be an int in [1, 100]"),
        (["--requests", "101"], "requests=101"),
        (["--requests", "2", "--tp-size", "2", "--model", "llama-3.1-8b"], "--requests: not taken by a TP/layout run"),
        # 36 MB to move, but a million-token page makes every pool page-sized: refused up front
        (["--prompt-tokens", "512", "--page-size", "1000000"], "GiB of host memory"),
        # a pack buffer past the machine's memory names the option that sized it
        (["--model", "tiny", "--pack-tokens", "1000000000000"], "(--pack-tokens: 178813.9 GiB of pack buffer)"),
        # The connector's own bounds: refused by a rank once running, reported as unverified bytes
        (["--interleave-size", "2147483648"], "--interleave-size * --dcp-size = 2147483648 * 8 exceeds int32"),
        (["--prefill-interleave-size", "2147483648", "--prefill-dcp-size", "2"], "--prefill-interleave-size *"),
        (["--page-size", "1048577"], "--page-size=1048577 must be <= 1048576 tokens"),
        (["--prefill-page-size", "1048577"], "--prefill-page-size=1048577 must be <= 1048576 tokens"),
    ],
)
def test_transfer_bad_input_is_a_clear_usage_error(args, text):
    res = runner.invoke(app, ["transfer", "--no-progress", *args])
    assert res.exit_code == 2, res.output
    flat = " ".join(res.output.replace("│", " ").split())  # undo rich's box and line wrapping
    assert text in flat, res.output


def test_plan_prints_cost_table_and_rejects_unknown_model():
    res = runner.invoke(app, ["plan", "--model", "deepseek-v3-fp8", "--prompt-tokens", "2048", "--dcp-size", "4"])
    assert res.exit_code == 0, res.output
    assert "direct" in res.output and "packed" in res.output
    res = runner.invoke(app, ["plan", "--model", "nope"])
    assert res.exit_code == 2 and "nope" in res.output


def test_plan_with_tp_prints_and_writes_only_the_heterogeneous_table(tmp_path):
    # Before: a model both plans know also printed (and wrote to --json) the TP-less table.
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--model", "deepseek-v3-fp8", "--prompt-tokens", "2048", "--dcp-size", "2",
                              "--tp-size", "2", "--json", str(out)], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert res.output.count("heterogeneous plan") == 1 and "packed" not in res.output and "dst rank" not in res.output
    rows = json.loads(out.read_text())
    # 2,048 tokens over decode DCP 2: 1,024 per DCP rank, the MLA latent on each of its 2 TP ranks.
    assert [(r["dcp_rank"], r["tp_rank"], r["rows"]) for r in rows] == [(d, t, 1024) for d in (0, 1) for t in (0, 1)]


@pytest.mark.parametrize("extra", [["--chunk-tokens", "256"], ["--prefix-tokens", "64"], ["--mode", "packed"],
                                   ["--plot", "x.png"], ["--path", "region"]])
def test_plan_with_tp_refuses_options_it_does_not_take(extra):
    # Before: silently ignored (the heterogeneous plan has no chunks, prefix, mode or plot).
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--tp-size", "2", "--prompt-tokens", "1024", *extra],
                        terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and f"{extra[0]}: not taken by the heterogeneous plan" in flat, res.output


@pytest.mark.parametrize("cmd", ["plan", "transfer"])
@pytest.mark.parametrize("option,value", [("--prefill-page-size", "0"), ("--prefill-tp-size", "-1"),
                                          ("--prefill-interleave-size", "0"), ("--prefill-dcp-size", "0")])
def test_tp_runs_name_the_side_of_a_bad_size(cmd, option, value):
    # Before: --prefill-page-size 0 was taken for "default" and the others said "page_size", "tp_size"...
    res = runner.invoke(app, [cmd, "--model", "llama-3.1-8b", "--prompt-tokens", "512", "--tp-size", "2",
                              option, value], terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and f"{option}={value} must be an int >= 1" in flat, res.output


@pytest.mark.parametrize("cmd", ["plan", "transfer"])
@pytest.mark.parametrize("model", ["tiny", "deepseek-v3"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_unknown_layout_is_named_whatever_the_model(cmd, model, side):
    # Before: with a model the heterogeneous plan lacks (tiny) the error named the model, not
    # the misspelt layout the user typed.
    res = runner.invoke(app, [cmd, "--model", model, "--prompt-tokens", "512", f"--{side}-layout", "nhdd"],
                        terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and f"{side} layout must be one of" in flat and "'nhdd'" in flat, res.output
    assert f"(--{side}-layout)" in flat, res.output  # the option the user typed, named


@pytest.mark.parametrize("args", [["plan"], ["transfer", "--no-progress"],
                                  ["plan", "--model", "llama-3.1-8b", "--tp-size", "2"]])
def test_absurd_prompt_tokens_are_refused_before_anything_is_sized(args):
    # 1e11 tokens once made `plan` take 15 GB before failing: refused up front, naming the option.
    res = runner.invoke(app, [*args, "--prompt-tokens", "100000000000"], terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "--prompt-tokens" in flat and "4,194,304" in flat, res.output


@pytest.mark.parametrize("command", ["transfer", "generate", "load", "plan"])
def test_help_at_80_columns_cuts_no_option_name(command):
    # rich's option table cut "--prefill-interleave-size" to "--prefill-interleave-s…" (fresh user).
    res = runner.invoke(app, [command, "--help"], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and max(map(len, res.output.splitlines())) <= 80, res.output
    if command == "transfer":
        assert "--prefill-interleave-size" in res.output


def test_help_documents_verify():
    res = runner.invoke(app, ["transfer", "--help"], terminal_width=200)
    assert res.exit_code == 0
    assert "--verify" in res.output and "CRC-32" in res.output


@pytest.mark.parametrize("extra", [
    ["--dcp-size", "3"],
    ["--dcp-size", "4", "--prefill-dcp-size", "2", "--chunk-tokens", "256", "--seed", "5"],
    # A prefill page size of its own: plan took the heterogeneous planner (other counts, and
    # "no heterogeneous cache entry" for tiny-mixed) while transfer ran the main job.
    ["--dcp-size", "2", "--prefill-page-size", "64"],
    ["--dcp-size", "4", "--prefill-dcp-size", "2", "--prefill-page-size", "8", "--chunk-tokens", "256"],
    ["--dcp-size", "2", "--prefill-page-size", "32", "--prefix-tokens", "64", "--seed", "3"],
    ["--dcp-size", "2", "--prefill-page-size", "128", "--prefix-tokens", "96"],  # prefix ends mid prefill page
    # A pack smaller than a rank's share (sliced): the sender's windows may fill the whole shared
    # arena (N * ceil(T / N) rows); plan gave each rank ceil(T / N) and counted twice the windows.
    ["--dcp-size", "2", "--pack-tokens", "100"],
    ["--dcp-size", "3", "--pack-tokens", "70", "--chunk-tokens", "256", "--prefill-page-size", "32"],
], ids=["m1", "m2-chunked", "prefill-page-64", "prefill-page-8-m2-chunked", "prefill-page-32-prefix",
        "prefill-page-128-prefix-96", "sliced", "sliced-chunked-prefill-page-32"])
def test_plan_prints_the_counts_transfer_reports(tmp_path, extra):
    """`plan` and `transfer` plan on the same allocator-drawn page tables and pack regions, in
    every path the CPU runs (fused, GPU only, plans no descriptor and no engine call)."""
    cfg = ["--model", "tiny-mixed", "--prompt-tokens", "700", "--page-size", "16", *extra]
    res = runner.invoke(app, ["transfer", *cfg, "--no-progress", "--timeout-s", "20", "--path", "direct,packed,region",
                              "--json", str(tmp_path / "job.json")])
    assert res.exit_code == 0, res.output
    res_plan = runner.invoke(app, ["plan", *cfg, "--path", "direct,packed,region,fused",
                                   "--json", str(tmp_path / "plan.json")], terminal_width=200)
    assert res_plan.exit_code == 0, res_plan.output
    job = {r["mode"]: r for r in json.loads((tmp_path / "job.json").read_text())["runs"]}
    plan = json.loads((tmp_path / "plan.json").read_text())
    fused = [r for r in plan if r["mode"] == "fused"]
    assert [(r["descriptors"], r["engine_calls"], r["packs"]) for r in fused] == [(0, 0, 0)] * len(fused)
    assert [r["bytes"] for r in fused] == [r["bytes"] for r in job["region"]["ranks"]]
    for mode in ("direct", "packed", "region"):
        rows = [r for r in plan if r["mode"] == mode]
        assert [r["descriptors"] for r in rows] == [r["descriptors"] for r in job[mode]["ranks"]]
        assert [r["bytes"] for r in rows] == [r["bytes"] for r in job[mode]["ranks"]]
        assert [r["engine_calls"] for r in rows] == [r["batches"] for r in job[mode]["ranks"]]
        assert sum(r["descriptors"] for r in rows) == job[mode]["descriptors"]
        assert f"{job[mode]['descriptors']:,}" in res_plan.output  # the printed total, too


@pytest.mark.parametrize(
    "args, text",
    [
        (["--chunk-tokens", "100"], "chunk_tokens=100 (--chunk-tokens) must be a multiple of page_size=64"),
        (["--prompt-tokens", "0"], "prompt_tokens=0 (--prompt-tokens) must be an int >= 1"),
        (["--prefix-tokens", "64"], "prefix_tokens=64"),
        (["--mode", "sideways"], "--mode"),
        (["--max-batch-indices", "0"], "max_batch_indices=0 (--max-batch-indices) must be an int >= 1 (None, "),
        (["--chunk-tokens", "0"], "chunk_tokens=0 (--chunk-tokens) must be an int >= 1 (None, the option"),
        (["--page-size", "0"], "page_size=0 (--page-size) must be an int >= 1"),
        # Before: ignored (one prefill rank holds every token whatever its interleave).
        (["--prefill-interleave-size", "16"], "--prefill-interleave-size=16 needs --prefill-dcp-size > 1"),
        # Before (fresh-user trial): -3 was taken and drew the tables of --seed 3; `load` refuses it.
        (["--seed", "-3"], "seed=-3 (--seed) must be an int >= 0"),
        (["--seed", "-3", "--model", "deepseek-v3", "--prefill-layout", "sglang_mla", "--decode-layout",
          "tpu_mla"], "--seed=-3 must be an int >= 0"),
    ],
)
def test_plan_validates_like_transfer(args, text):
    for cmd in ("plan", "transfer"):
        res = runner.invoke(app, [cmd, *args, *(["--no-progress"] if cmd == "transfer" else [])])
        assert res.exit_code == 2, (cmd, res.output)
        flat = " ".join(res.output.replace("│", " ").split())
        assert text in flat, (cmd, res.output)


def test_unwritable_outputs_are_clear_usage_errors(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    small = ["--model", "tiny", "--prompt-tokens", "256", "--dcp-size", "2", "--page-size", "16"]
    for cmd, opt in (("plan", "--plot"), ("plan", "--json"), ("transfer", "--json")):
        res = runner.invoke(app, [cmd, *small, opt, str(missing / "out.png"),
                                  *(["--no-progress"] if cmd == "transfer" else [])], terminal_width=300)
        assert res.exit_code == 2, (cmd, opt, res.output)
        flat = " ".join(res.output.replace("│", " ").split())
        assert opt in flat and "does not exist" in flat and "Traceback" not in res.output
        assert not missing.exists()  # nothing created
    res = runner.invoke(app, ["plan", *small, "--plot", str(tmp_path)], terminal_width=300)
    # Flattened like the checks above: the error box wraps a long tmp_path (pytest-xdist's has a
    # worker folder more), which may put "is a" and "folder" on two lines.
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "is a folder" in flat, res.output
    a_file = tmp_path / "x.file"
    a_file.write_text("kept")
    res = runner.invoke(app, ["plan", *small, "--json", str(a_file / "out.json")], terminal_width=300)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "is a file, not a folder" in flat, res.output
    assert a_file.read_text() == "kept"


def test_outputs_the_os_refuses_and_generate_folders_are_refused_before_the_run(tmp_path):
    # Before (fresh-user trial): /proc/x.json passed the folder check (os.access says yes to root)
    # and `plan` / `transfer` crashed writing it after the work; `generate --json <folder>` ran the
    # whole model, then crashed with exit 1, which its help defines as "tokens do not match".
    small = ["--model", "tiny", "--prompt-tokens", "64"]
    for cmd in ("plan", "transfer"):
        res = runner.invoke(app, [cmd, *small, "--json", "/proc/x.json",
                                  *(["--no-progress"] if cmd == "transfer" else [])], terminal_width=300)
        flat = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code == 2 and "not writable" in flat and "Traceback" not in res.output, res.output
    res = runner.invoke(app, ["generate", "--json", str(tmp_path), "--prompt-tokens", "8", "--new-tokens", "1",
                              "--dcp-size", "1"], terminal_width=300)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "is a folder" in flat and "TTFT" not in res.output, res.output
    res = runner.invoke(app, ["plan", *small, "--json", ""], terminal_width=300)  # typer makes it Path(".")
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "--json needs a file name (an empty argument" in flat, res.output
    fresh = tmp_path / "fresh.json"
    res = runner.invoke(app, ["plan", *small, "--json", str(fresh)], terminal_width=300)
    assert res.exit_code == 0 and json.loads(fresh.read_text())  # the probe left a file only where one is written


@pytest.mark.parametrize("extra,named", [(["--device", "gpu"], "--device"), (["--direction", "pull"], "--direction"),
                                         (["--prefix-tokens", "128"], "--prefix-tokens")])
def test_a_tp_layout_run_refuses_options_it_would_ignore(extra, named):
    # It runs push on host memory: a --device gpu run must not report host figures as the GPU's.
    res = runner.invoke(app, ["transfer", "--model", "llama-3.1-8b", "--tp-size", "2", "--prompt-tokens", "512",
                              "--no-progress", *extra], terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and named in flat and "TP/layout" in flat, res.output


def test_transfer_requests_prints_each_whole_request_and_the_median(tmp_path):
    """--requests 3: three timed requests per mode, each verified; the JSON run is the median one
    and lists all three, and the printed line names the same median and each time."""
    import math

    out = tmp_path / "r.json"
    res = runner.invoke(app, ["transfer", *SMALL, "--mode", "packed", "--requests", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())["runs"][0]
    secs = [r["request_seconds"] for r in run["repeats"]]
    assert len(secs) == 3 and all(r["verified"] for r in run["repeats"]) and run["verified"]
    assert all(math.isfinite(x) and x > 0 for x in secs)
    assert run["request_seconds"] == sorted(secs)[1]
    flat = " ".join(res.output.split())
    assert f"packed: 3 requests, first byte to last SUCCESS median {sorted(secs)[1] * 1e3:.3f} ms" in flat
    assert "each (ms): " + ", ".join(f"{x * 1e3:.3f}" for x in secs) in flat


def test_descriptor_ratio_in_words():
    from dcp_jax.cli import _descriptor_phrase

    assert _descriptor_phrase(64.76) == "[bold]64.8x[/] fewer descriptors"
    assert _descriptor_phrase(1.0) == _descriptor_phrase(1.04) == "about as many descriptors"  # was "1.0x fewer"
    assert _descriptor_phrase(0.5) == "[bold]2.0x[/] more descriptors"


@pytest.mark.parametrize("cmd", [["plan", "--model", "tiny", "--prompt-tokens", "128"],
                                 ["load", "--duration-s", "1"]])
def test_a_plot_suffix_matplotlib_cannot_write_is_refused_before_the_run(tmp_path, cmd):
    # Before: plan printed its whole table, then failed in savefig without naming --plot, and
    # --json was never written.
    res = runner.invoke(app, [*cmd, "--plot", str(tmp_path / "x.txt"), "--json", str(tmp_path / "p.json")],
                        terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "--plot" in flat and "suffix picks the image format" in flat, res.output
    assert "descriptors" not in flat and not list(tmp_path.iterdir())


@pytest.mark.parametrize("cmd", ["transfer", "plan"])
@pytest.mark.parametrize("extra,text", [
    (["--page-size", "2097152"], "--page-size=2097152 must be <= 1048576 tokens"),
    (["--interleave-size", "1073741824", "--dcp-size", "4"], "--interleave-size * --dcp-size = 1073741824 * 4"),
    (["--prefill-interleave-size", "1073741824", "--prefill-dcp-size", "4"], "--prefill-interleave-size *"),
    (["--prefill-layout", "tpu_mla"], "num_kv_heads must be 1 for MLA"),  # a GQA model in an MLA layout
    (["--prefill-interleave-size", "16"], "--prefill-interleave-size=16 needs --prefill-dcp-size > 1"),
])
def test_a_tp_layout_run_refuses_the_connectors_bounds_before_any_process(cmd, extra, text):
    # Before: transfer started every rank process, which refused its spec (a traceback, or rc 1
    # and no output at all when a decode rank died before the addresses reached it).
    args = [cmd, "--model", "llama-3.1-8b", "--prompt-tokens", "256", "--tp-size", "2", *extra]
    res = runner.invoke(app, args + (["--no-progress"] if cmd == "transfer" else []), terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and text in flat and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("extra,text", [
    (["--timeout-s", "0"], "--timeout-s=0.0 must be in (0, 86400] seconds"),
    (["--timeout-s", "nan"], "--timeout-s=nan"),
    (["--tp-size", "64", "--dcp-size", "16"], "--dcp-size=16 x --tp-size=64 = 1024 processes; at most 64"),
    (["--prompt-tokens", "131072", "--page-size", "1048576"], "GiB of host memory"),
    (["--path", "direct, region"], "--path='direct, region': ' region' is not a path name; --path takes a comma "
                                   "list (no spaces) of distinct names of direct, region (a TP or layout run)"),
    (["--path", "direct", "--path", "region"], "--path given 2 times"),
])
def test_a_tp_layout_transfer_refuses_what_its_processes_could_not_run(extra, text):
    res = runner.invoke(app, ["transfer", "--model", "llama-3.1-8b", "--prompt-tokens", "256", "--tp-size", "2",
                              "--no-progress", *extra], terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and text in flat, res.output


@pytest.mark.parametrize("cmd", ["transfer", "plan"])
def test_a_pair_of_two_kinds_is_refused_by_transfer_as_by_plan(cmd):
    # Before: plan refused it; transfer started 9 processes that each refused the handshake.
    args = [cmd, "--model", "kimi-k2", "--prompt-tokens", "64", "--prefill-layout", "nhd"]
    res = runner.invoke(app, args + (["--no-progress"] if cmd == "transfer" else []), terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "heterogeneous pair refused: kind differs (prefill 'gqa', decode 'mla')" in flat


@pytest.mark.parametrize("nbytes,text", [(2_302_672_896, "2.30 GB"), (393_216, "393 kB"), (999, "999 B"),
                                         (36_000_000, "36.0 MB"), (999_500, "1.00 MB"), (9_999_999, "10.0 MB"),
                                         (999_999_999_999, "1,000 GB")])
def test_the_job_header_size_has_three_significant_digits(nbytes, text):
    from dcp_jax.cli import _size_text

    assert _size_text(nbytes) == text  # a tiny model's request read "0.00 GB"


def test_round_rows_splits_a_chunk_into_launches_and_stays_byte_exact(tmp_path):
    # 500 tokens to 4 ranks: windows of 125 rows (128 index rows); 64 rows a round = a window each.
    out = tmp_path / "rounds.json"
    res = runner.invoke(app, ["transfer", *SMALL, "--dcp-size", "4", "--path", "region,packed", "--round-rows", "64", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["config"]["round_rows"] == 64 and data["config"]["dcp_size"] == 4 and data["verified"] is True
    assert [r["verified"] for r in data["runs"]] == [True, True]
    assert [r["launches"] for r in data["runs"]] == [4, 4]  # a window a round
    # By default host KV (nothing to compile, so no bucket caps a launch) packs a chunk in one
    # launch: the job sends once every rank's announcement is in (a late one went a round later:
    # 1 or 2 launches from run to run). Device KV stops at one window's bucket (test_warm_up.py).
    res = runner.invoke(app, ["transfer", *SMALL, "--dcp-size", "4", "--path", "region,packed", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert [r["launches"] for r in json.loads(out.read_text())["runs"]] == [1, 1]


def test_a_timeout_under_two_pings_is_refused_naming_the_option():
    # Found by a fresh-user trial: --timeout-s 0.9 passed the check, then every prefill process
    # failed at start with a traceback (the connectors' peer timeout is min(--timeout-s, 30 s) and
    # must hold two of their 0.5 s pings), exit 1 as if bytes were wrong.
    res = runner.invoke(app, ["transfer", *SMALL, "--timeout-s", "0.9"], terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "timeout_s=0.9 (--timeout-s) must be in [1, 86400] seconds" in flat, res.output
    assert "twice the connector's ping interval, 0.5 s" in flat, res.output


@pytest.mark.parametrize("text,msg", [
    (" packed", r"^--path=' packed': ' packed' is not a path name; --path takes a comma list \(no spaces\) of "
                r"distinct names of auto, direct, packed, region, fused$"),
    ("packed ", r"^--path='packed ': 'packed ' is not a path name"),
    ("Packed", r"^--path='Packed': 'Packed' is not a path name"),
    ("packed,,region", r"^--path='packed,,region': '' is not a path name"),
    ("", r"^--path='': '' is not a path name"),
    ("packed,packed", r"^--path='packed,packed' names 'packed' twice; --path takes"),
])
def test_path_names_are_taken_exactly(text, msg):
    from dcp_jax.cli_options import parse_paths
    from dcp_jax.job.config import PATHS

    with pytest.raises(ValueError, match=msg):
        parse_paths(text, PATHS)
    # The documented forms: one name, or a comma list of distinct names, kept in order.
    assert parse_paths("region,packed", PATHS) == ("region", "packed")
    assert parse_paths(",".join(PATHS), PATHS) == PATHS


@pytest.mark.parametrize("path,text", [
    ("auto", "'auto' is not a path name; --path takes a comma list (no spaces) of distinct names of direct, packed, "
             "region, fused ('auto' is chosen per peer at the handshake: name the paths)"),
    ("region,region", "--path='region,region' names 'region' twice"),
    ("Region", "'Region' is not a path name"),
])
def test_plan_path_is_refused_naming_the_option(path, text):
    res = runner.invoke(app, ["plan", "--path", path], terminal_width=200)
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and text in flat and "Traceback" not in res.output, res.output
    res = runner.invoke(app, ["plan", "--path", "region", "--path", "fused"], terminal_width=200)
    assert res.exit_code == 2 and "--path given 2 times" in res.output, res.output
