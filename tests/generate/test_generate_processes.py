"""``dcp-jax generate`` with real processes: one prefill process per prefill rank (a KVSender),
one decode process per decode rank (a KVReceiver, jax.distributed over gloo), a real engine on
loopback. A representative subset (the full matrix: `dcp_jax.generate.matrix`, results in
benchmarks/results/generate_matrix_cpu.json). Slow: about 30 s per run on 2 idle cores."""
import json
import os
import subprocess
import sys

import pytest

from dcp_jax.generate.config import GenerateConfig
from dcp_jax.generate.run import run_generate

pytestmark = pytest.mark.slow


def test_cli_dcp2_nixl_fp32(tmp_path):
    out = tmp_path / "gen.json"
    cmd = [sys.executable, "-m", "dcp_jax.cli", "generate", "--dcp-size", "2", "--prompt-tokens", "1000",
           "--new-tokens", "32", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    for key in ("tokens", "reference_tokens", "tokens_match", "max_logit_rel_err", "ttft_s", "ttft_parts_s",
                "tpot_s"):
        assert key in rep
    assert rep["tokens"] == rep["reference_tokens"] and len(rep["tokens"]) == 32 and rep["tokens_match"]
    assert rep["max_logit_rel_err"] <= 1e-5 and rep["steps_compared"] == 32
    assert rep["kv_in_place"] and rep["ranks_agree"]
    parts = rep["ttft_parts_s"]
    assert abs(sum(parts.values()) - rep["ttft_s"]) < 1e-9 and min(parts.values()) > 0
    assert "match" in p.stdout and "transfer" in p.stdout


def test_mooncake_bf16_prefill_dcp2_to_decode_dcp4_each_side_its_interleave_and_page_size():
    # One run for four properties (each such run costs ~45 s on 2 cores): Mooncake, bf16, and
    # DCP-M -> DCP-N with a token interleave and 64-token pages on the prefill side, a page
    # interleave and 16-token pages on decode.
    rep = run_generate(GenerateConfig(dcp_size=4, prefill_dcp_size=2, prefill_interleave_size=1,
                                      prefill_page_size=64, interleave_size=16, page_size=16,
                                      prompt_tokens=1000, new_tokens=8,
                                      engine="mooncake", dtype="bf16"))
    assert rep["passed"] and rep["matching_prefix"] == 8, rep
    assert rep["max_logit_rel_err"] <= 2e-2


def test_one_corrupted_row_on_one_rank_is_seen():
    rep = run_generate(GenerateConfig(dcp_size=2, prompt_tokens=1000, new_tokens=4, corrupt_rank=1))
    assert not rep["passed"] and rep["max_logit_rel_err"] > 1e-5, rep
