"""What the heterogeneous connector job refuses before it starts a process, and how it reports a
rank process that died before its first message."""
import multiprocessing as mp

import pytest

from dcp_jax.hetero.connector_job import _send, check_job_size
from dcp_jax.hetero.cost import hetero_sides


def _side(**kw):
    return dict(dict(page_size=16, dcp_size=1, interleave_size=1, tp_size=1, layout=None), **kw)


def test_process_and_memory_bounds():
    p, d, layers = hetero_sides("llama-3.1-8b", _side(), _side(tp_size=2, dcp_size=2))
    check_job_size(p, d, layers, 4096)  # 4 decode processes, a few MB: fine
    p, d, layers = hetero_sides("llama-3.1-8b", _side(), _side(tp_size=8, dcp_size=9))
    with pytest.raises(ValueError, match=r"--dcp-size=9 x --tp-size=8 = 72 processes; at most 64"):
        check_job_size(p, d, layers, 64)
    p, d, layers = hetero_sides("llama-3.1-8b", _side(page_size=1 << 20), _side(page_size=1 << 20))
    with pytest.raises(ValueError, match=r"caches need about [\d,.]+ GiB of host memory"):
        check_job_size(p, d, layers, 1 << 20)


def _dies_with_an_error(conn):
    conn.send(("error", "Traceback ...\nValueError: the rank's own reason"))
    conn.close()


def test_a_rank_that_died_reports_its_own_error():
    # Before: sending it the addresses raised BrokenPipeError, which the CLI made an empty exit 1.
    a, b = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_dies_with_an_error, args=(b,))
    proc.start()
    b.close()
    proc.join(10)
    with pytest.raises(RuntimeError, match=r"(?s)decode rank \(0, 1\) failed:.*the rank.s own reason"):
        for _ in range(3):  # the first sends may still fit the pipe's buffer
            _send((proc, a, (0, 1)), "decode rank (0, 1)", ["tcp://127.0.0.1:1"] * 50_000)
    a.close()
