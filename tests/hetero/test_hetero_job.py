"""``dcp-jax transfer`` with TP / layout pairs: through the connector, one process per rank
(`dcp_jax.hetero.connector_job`), and the plan's one-process engine path (`dcp_jax.hetero.job`)."""
import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import pytest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import dcp_jax.hetero.job as hjob  # noqa: E402
from bridge import available_engines  # noqa: E402
from dcp_jax.cli import app  # noqa: E402


def _side(page, dcp=1, inter=1, tp=1, layout=None):
    return dict(page_size=page, dcp_size=dcp, interleave_size=inter, tp_size=tp, layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(available_engines()))
@pytest.mark.parametrize("tokens, prefill, decode", [
    (160, _side(16, tp=2), _side(64, 2, tp=4, layout="hnd")),   # the issue's first example
    (96, _side(128), _side(32, tp=2, layout="tpu_gqa")),        # the second, TPU decode layout: 1 descriptor
])                                                               # per (token, head, K/V, layer)
def test_issue_examples_verify(engine, tokens, prefill, decode):
    res = hjob.run_hetero_job("llama-3.1-8b", tokens, prefill, decode, engine=engine)
    assert res["verified"] and res["bytes"] == tokens * 8 * 128 * 2 * 2 * 32
    assert len(res["ranks"]) == decode["dcp_size"] * decode["tp_size"]
    assert all(r["descriptors"] > 0 for r in res["ranks"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(available_engines()))
@pytest.mark.parametrize("mode", ["direct", "region"])
def test_issue_example_through_the_connector_processes(engine, mode):
    from dcp_jax.hetero.connector_job import run_connector_job

    res = run_connector_job("llama-3.1-8b", 160, _side(16, tp=2), _side(64, 2, tp=4, layout="hnd"), engine=engine,
                            mode=mode)
    assert res["verified"] and res["processes"] == 2 + 8
    assert res["bytes"] == 160 * 8 * 128 * 2 * 2 * 32
    # direct, NHD -> HND with 2 heads per decode rank: one per (token, head, K/V, layer); region: one per window
    per_rank = [r["descriptors"] for r in res["ranks"]]
    assert per_rank == ([80 * 2 * 2 * 32] * 8 if mode == "direct" else [1] * 8)
    if mode == "direct":  # what `dcp-jax plan` prints for the same pair and seed
        from dcp_jax.hetero.cost import hetero_counts

        counts = hetero_counts("llama-3.1-8b", 160, _side(16, tp=2), _side(64, 2, tp=4, layout="hnd"))
        assert [c["direct"] for c in counts] == per_rank


@pytest.mark.slow
def test_plan_counts_what_the_direct_path_posts_where_it_exceeds_the_wire_blocks():
    # The README's example: the plan's wire blocks are far fewer than the direct path's posts
    # (it reads through the prefill layout too); the plan's `direct` column is what was posted.
    from dcp_jax.hetero.connector_job import run_connector_job
    from dcp_jax.hetero.cost import hetero_counts

    args = ("llama-3.1-8b", 300, _side(16), _side(16, 3, 8, tp=2))
    res = run_connector_job(*args, engine="nixl", mode="direct", seed=3)
    counts = hetero_counts(*args, seed=3)
    assert res["verified"]
    assert [c["direct"] for c in counts] == [r["descriptors"] for r in res["ranks"]]
    assert all(c["direct"] > 10 * c["descriptors"] for c in counts)


def test_a_missing_stream_is_caught(monkeypatch):
    real = hjob.execute_over_engines

    def drop_one(plan, src, dst, layers, **kw):
        out = real(plan, src, dst, layers, **kw)
        dst[(0, 1)][0][...] = hjob.SENTINEL  # as if rank (0, 1)'s first layer never arrived
        return out

    monkeypatch.setattr(hjob, "execute_over_engines", drop_one)
    res = hjob.run_hetero_job("llama-3.1-8b", 64, _side(16), _side(16, tp=2), engine="nixl")
    assert not res["verified"] and [r["verified"] for r in res["ranks"]] == [True, False]


def test_cli_runs_and_names_bad_input():
    runner = CliRunner()
    # Through the connector: 1 prefill and 2 decode rank processes, the region path (decode-side placement).
    res = runner.invoke(app, ["transfer", "--model", "llama-3.1-8b", "--prompt-tokens", "48", "--prefill-page-size",
                              "16", "--page-size", "32", "--tp-size", "2", "--dcp-size", "1", "--decode-layout", "hnd",
                              "--path", "region", "--no-progress"])
    assert res.exit_code == 0 and "verified" in res.output and "path region" in res.output, res.output
    # A rank that does not answer in time: its message and exit 1, not a 52-line traceback.
    res = runner.invoke(app, ["transfer", "--model", "llama-3.1-8b", "--prompt-tokens", "48", "--tp-size", "2",
                              "--dcp-size", "1", "--timeout-s", "0.01", "--no-progress"])
    assert res.exit_code == 1 and "no 'address' within 0.01 s" in res.output, res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["transfer", "--model", "llama-3.1-8b", "--tp-size", "3", "--no-progress"])
    assert res.exit_code == 2 and "tp_size=3" in " ".join(res.output.replace("│", " ").split()), res.output
    res = runner.invoke(app, ["transfer", "--model", "llama-3.1-8b", "--tp-size", "2", "--engine", "auto",
                              "--no-progress"])
    assert res.exit_code == 2 and "--engine='auto'" in " ".join(res.output.replace("│", " ").split()), res.output
