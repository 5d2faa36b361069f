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


def _spawn(role, n, rank, port, engine):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "_dcp_worker.py"), role, str(n), str(rank),
                             str(port), engine], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p, timeout=450):
    out, err = p.communicate(timeout=timeout)  # a stuck worker prints its stacks (faulthandler) first
    lines = [l for l in out.splitlines() if l.startswith("@@")]
    assert p.returncode == 0 and lines, f"worker failed (rc {p.returncode}):\n{err[-3000:]}"
    return json.loads(lines[-1][2:])


@pytest.mark.parametrize("n,engine", [(2, "nixl"), (4, "nixl"), (2, "mooncake")])
def test_dcp_consumers_byte_exact(n, engine):
    port = 5900 + 10 * n + (5 if engine == "mooncake" else 0)
    procs = [_spawn("producer", n, 0, port, engine)] + [_spawn("consumer", n, r, port, engine) for r in range(n)]
    try:
        results = [_result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    prod, cons = results[0], results[1:]
    assert prod["sent"] == ["long", "short"] and prod["stats"]["failed"] == 0
    for r, c in enumerate(cons):
        assert c["failed"] == [], c
        assert c["mismatched_elements"] == 0, c
        assert c["owned"]["long"] == len(range(r, 300, n))
    assert sum(c["owned"]["short"] for c in cons) == 3
    if n == 4:
        assert cons[3]["owned"]["short"] == 0  # completed without a byte
