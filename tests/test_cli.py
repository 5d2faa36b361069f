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
        (["--engine", "rdma"], "engine='rdma'"),
        (["--chunk-tokens", "100"], "chunk_tokens=100"),
        (["--prefix-tokens", "64"], "prefix_tokens=64"),
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


def test_help_documents_verify():
    res = runner.invoke(app, ["transfer", "--help"], terminal_width=200)
    assert res.exit_code == 0
    assert "--verify" in res.output and "CRC-32" in res.output
