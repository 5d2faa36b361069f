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
