"""What the heterogeneous connector job refuses before it starts a process (a rank process that
dies is reported through `dcp_jax.child_process.Child`, tested in tests/test_child.py)."""
import pytest

from dcp_jax.hetero.connector_job import check_job_size
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
