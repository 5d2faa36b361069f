"""`bridge.engine_env.quiet_engines`: the engines' quiet defaults, never over a caller's own."""
import os

from bridge.engine_env import LOOPBACK_ENV, QUIET_ENV, quiet_engines


def test_quiet_engines_sets_what_is_unset_and_keeps_what_the_caller_set(monkeypatch):
    for k in {**QUIET_ENV, **LOOPBACK_ENV}:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")  # the caller's own choice
    done = quiet_engines()
    assert done == {"UCX_LOG_LEVEL": "fatal", "NIXL_LOG_LEVEL": "WARN"}
    assert os.environ["MC_LOG_LEVEL"] == "INFO" and "UCX_NET_DEVICES" not in os.environ
    assert quiet_engines(loopback=True) == {"UCX_NET_DEVICES": "lo"}
    assert quiet_engines(loopback=True) == {}  # nothing left to set


def _run(code: str, **env) -> str:
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout


_AGENT = """
import bridge.nixl_agent as na          # NIXL imported (its logger configured) before the call
from bridge.engine_env import quiet_engines
{call}
a = na.nixl_agent("quiet-probe", na.nixl_agent_config(backends=["UCX"]))
"""


def test_quiet_engines_quiets_nixl_imported_before_it():
    """NIXL's wrapper logs its agent's start at INFO to stdout and reads NIXL_LOG_LEVEL only at
    import: a call after the import still stops those lines; without the call they come."""
    import pytest

    pytest.importorskip("bridge.nixl_agent")
    loud = _run(_AGENT.format(call=""), UCX_LOG_LEVEL="fatal")
    assert "Initialized NIXL agent: quiet-probe" in loud
    assert _run(_AGENT.format(call="quiet_engines()"), UCX_LOG_LEVEL="fatal") == ""
    # the caller's own level wins
    own = _run(_AGENT.format(call="quiet_engines()"), UCX_LOG_LEVEL="fatal", NIXL_LOG_LEVEL="INFO")
    assert "Initialized NIXL agent: quiet-probe" in own
