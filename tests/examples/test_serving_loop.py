"""examples/serving_loop.py: runs end to end as a user would run it, and its row check bites."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bridge import available_engines

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serving_loop.py"
# The command a user runs first (NIXL, push); Mooncake only where NIXL is missing. The other
# engine and direction run the same code paths, covered by tests/transfer (one run here keeps
# this test near 20-40 s on 2 cores).
ENGINE = "nixl" if "nixl" in available_engines() else "mooncake"


@pytest.mark.slow
@pytest.mark.skipif(not available_engines(), reason="neither NIXL nor Mooncake imports here")
def test_example_runs_and_every_row_arrives():
    engine, direction = ENGINE, "push"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user has
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--engine", engine, "--direction", direction],
                          capture_output=True, text=True, timeout=240, env=env, cwd=EXAMPLE.parents[1])
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-4000:]
    assert out.startswith(f"{engine} {direction}: 1 prefill process, 2 decode ranks"), out
    # 5 requests of 1, 17, 64, 100 and 200 tokens: rank 0 owns 1+9+32+50+100, rank 1 the rest.
    assert "decode rank 0: 5/5 requests SUCCESS, 192 owned tokens x 3 layers byte-exact" in out, out
    assert "decode rank 1: 5/5 requests SUCCESS, 190 owned tokens x 3 layers byte-exact" in out, out
    assert "prefill: 5 requests sent, status SUCCESS" in out, out
    assert out.rstrip().endswith("OK"), out


def _example_module():
    spec = importlib.util.spec_from_file_location("serving_loop_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_row_check_catches_one_wrong_byte():
    """The decode side's check (what makes the example exit 1) sees a single flipped bit."""
    import jax.numpy as jnp

    ex = _example_module()
    rid, rank = "req-1", 1  # 17 tokens: rank 1 owns tokens 1, 3, .., 15 (local rows 0..7)
    table = np.zeros(ex.MAX_TOKENS // ex.PAGE_SIZE, np.int32)
    table[0] = 5  # its 8 rows sit in page 5
    ids = ex.prompt(rid)
    want = np.asarray(ex.model_kv(ids, np.arange(ex.MAX_TOKENS)))  # [layers, tokens, D]
    cache = [np.zeros((ex.NUM_PAGES, ex.PAGE_SIZE, ex.KV_DIM), want.dtype) for _ in range(ex.NUM_LAYERS)]
    for layer in range(ex.NUM_LAYERS):
        cache[layer][5, :8] = want[layer, 1:17:2]
    same, n = ex.rows_match(rank, [jnp.asarray(c) for c in cache], table, ids, 17)
    assert bool(same) and int(n) == 8
    bad = [c.copy() for c in cache]
    bad[2].view(np.uint16)[5, 7, 300] ^= 1  # one bit of token 15, layer 2
    same, n = ex.rows_match(rank, [jnp.asarray(c) for c in bad], table, ids, 17)
    assert not bool(same) and int(n) == 8
    # Rank 0 reading the same pages finds rank 1's tokens where its own 9 should be: a mismatch.
    same, n = ex.rows_match(0, [jnp.asarray(c) for c in cache], table, ids, 17)
    assert not bool(same) and int(n) == 9
