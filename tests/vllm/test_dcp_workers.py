"""DCP through the adapter's worker hooks: one producer and N consumer workers in separate processes.

vLLM's CPU backend runs DCP 1, so the decode DCP-N path is tested with `DcpJaxConnector`'s worker
hooks driven directly (`_dcp_worker.py`): caches laid out as vLLM lays them, rows="token", token
round-robin; each consumer checks every byte against its own ownership oracle. The 3-token
request leaves rank 3 of 4 without a token: it must still complete.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(n, port, engine, timeout=450):
    """The launcher: one producer and n consumer processes (`_dcp_worker.py`); their results."""
    p = subprocess.run([sys.executable, os.path.join(HERE, "_dcp_worker.py"), str(n), str(port), engine],
                       capture_output=True, text=True, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith("@@")]
    assert lines, f"launcher failed (rc {p.returncode}):\n{p.stderr[-3000:]}"
    out = json.loads(lines[-1][2:])
    assert p.returncode == 0 and not out["errors"], "\n".join(out["errors"]) or p.stderr[-3000:]
    return out["results"]


@pytest.mark.parametrize("n,engine", [(2, "nixl"), (4, "nixl"), (2, "mooncake")])
def test_dcp_consumers_byte_exact(n, engine):
    port = 5900 + 10 * n + (5 if engine == "mooncake" else 0)
    results = _run(n, port, engine)
    prod, cons = results[0], results[1:]
    assert prod["sent"] == ["long", "short"] and prod["stats"]["failed"] == 0
    for r, c in enumerate(cons):
        assert c["failed"] == [], c
        assert c["mismatched_elements"] == 0, c
        assert c["owned"]["long"] == len(range(r, 300, n))
    assert sum(c["owned"]["short"] for c in cons) == 3
    if n == 4:
        assert cons[3]["owned"]["short"] == 0  # completed without a byte
