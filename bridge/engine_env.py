"""The engines' environment defaults, in one place: quiet logs, and loopback for one-machine runs.

NIXL (UCX underneath) and Mooncake read these variables when an engine starts, so they must be
set before the first engine of a process is made. The demo job, the load generator and the
two-host rehearsal call `quiet_engines`; an embedding serving loop may call it too (its
own settings win: nothing set is overwritten).

    from bridge.engine_env import quiet_engines
    quiet_engines()            # before the first KVSender / KVReceiver / make_engine
"""
from __future__ import annotations

import logging
import os

__all__ = ["QUIET_ENV", "LOOPBACK_ENV", "quiet_engines"]

#: Log levels that keep only errors: UCX, NIXL's own logger, Mooncake's glog.
QUIET_ENV = {"UCX_LOG_LEVEL": "fatal", "NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "ERROR"}
#: UCX on the loopback device only (one machine: traffic stays on it).
LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo"}


def quiet_engines(loopback: bool = False) -> dict[str, str]:
    """Sets `QUIET_ENV` (and `LOOPBACK_ENV` when ``loopback``) in ``os.environ`` where the
    variable is not set yet; returns what was set now (name -> value).

    NIXL's Python wrapper reads ``NIXL_LOG_LEVEL`` once, when it is imported, into its ``nixl``
    logger (which writes to stdout): when the variable is set now, that logger's level is set here
    too, so its INFO lines stop also in a process that imported NIXL before this call."""
    wanted = {**QUIET_ENV, **(LOOPBACK_ENV if loopback else {})}
    done = {}
    for k, v in wanted.items():
        if k not in os.environ:
            os.environ[k] = v
            done[k] = v
    if "NIXL_LOG_LEVEL" in done:  # (a later first import sets the same level from the variable)
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return done
