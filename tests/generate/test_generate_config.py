"""`GenerateConfig` refuses what the connector would refuse, before any process starts, and the
parent reports a child that died at start-up with the child's own error (tests/test_child.py)."""
import pytest

from dcp_jax.generate.config import GenerateConfig


@pytest.mark.parametrize("kw,text", [
    (dict(interleave_size=2 ** 31), r"--interleave-size \* --dcp-size = 2147483648 \* 2 exceeds int32"),
    (dict(prefill_interleave_size=2 ** 30, prefill_dcp_size=2), r"--prefill-interleave-size \* --prefill-dcp-size"),
    (dict(prefill_interleave_size=16), r"^--prefill-interleave-size=16 needs --prefill-dcp-size > 1"),  # was ignored
    (dict(page_size=(1 << 20) + 1), r"--page-size=1048577 must be <= 1048576"),
    (dict(prefill_page_size=(1 << 20) + 1), r"--prefill-page-size=1048577 must be <= 1048576"),
    (dict(timeout_s=100_000.0), r"--timeout-s=100000.0 must be in \(0, 86400\]"),
    (dict(timeout_s=float("inf")), r"--timeout-s=inf"),
    (dict(timeout_s=float("nan")), r"--timeout-s=nan"),
    (dict(timeout_s=0.0), r"--timeout-s=0.0"),
    (dict(new_tokens=10 ** 9), r"--new-tokens=1000000000 must be <= 4,096"),
    (dict(seed=2 ** 63), r"--seed=9223372036854775808 must be < 2\*\*63"),
])
def test_bounds_the_connector_sets_are_refused_up_front(kw, text):
    with pytest.raises(ValueError, match=text):
        GenerateConfig(**{"dcp_size": 2, "prompt_tokens": 20, **kw})


def test_more_prefill_processes_than_the_job_allows_are_refused():
    # Before: --prefill-dcp-size 100 started 100 prefill processes.
    with pytest.raises(ValueError, match=r"--prefill-dcp-size=100 must be <= 64 \(one process per rank\)"):
        GenerateConfig(dcp_size=2, prompt_tokens=20, prefill_dcp_size=100)


def test_a_rank_that_does_not_answer_in_time_is_one_message_and_exit_1():
    # Before: a TimeoutError from the rank pipes came out as an 81-line traceback, and the
    # ranks were joined 10 s each before being killed (Ctrl-C took 20 s).
    import time

    from typer.testing import CliRunner

    from dcp_jax.cli import app

    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["generate", "--prompt-tokens", "20", "--new-tokens", "2", "--no-reference",
                                   "--timeout-s", "0.01"])
    assert res.exit_code == 1, res.output
    assert "prefill 0: no 'address' within 0.01 s" in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output
    assert time.monotonic() - t0 < 15
