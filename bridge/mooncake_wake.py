"""Wakes a Mooncake engine's handshake listener while the engine is destroyed.

Why: ``mooncake.engine.TransferEngine``'s destructor (mooncake-transfer-engine 0.3.x, P2P
handshake) stops its handshake listener thread by clearing a flag and joining it, but that thread
sits in ``accept()`` with a 1 s receive timeout and sees the flag only when ``accept`` returns. So
every engine teardown took 1.01 s, and the destructor runs with the GIL held (a pybind11
destructor): every other thread of the process (a serving loop, the other side's workers) stood
still that second. Measured here (2026-12-07, one engine on loopback): 1.010 s without a waker,
2.8 ms with one.

How: a small child process (this interpreter, ``-S``, nothing imported but ``socket``) connects to
the listener's address every 2 ms and closes at once, until a connection is refused (the listener
is gone) or its time limit passes. A connection that comes while the listener still runs is
accepted and read as an empty handshake (closed: nothing is logged); the first one after the flag
is cleared ends the loop. It must be another process: the destructor holds the GIL, so a thread
of this process could not run. The child only connects to the address given (the engine's own
listener, on this host or this network namespace), sends nothing and reads nothing.
"""
from __future__ import annotations

import logging
import subprocess
import sys

__all__ = ["ListenerWaker"]

logger = logging.getLogger("bridge")

_CODE = """
import socket, sys, time
host, port, end = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        socket.create_connection((host, port), timeout=0.05).close()
    except OSError:
        break
    time.sleep(0.002)
"""


class ListenerWaker:
    """The child process that pokes ``host:port`` while an engine is destroyed (see the module).

    Args:
        host: the engine's handshake host (as given to ``initialize``: an address or name).
        port: its handshake (RPC) port, ``TransferEngine.get_rpc_port()``.
        limit_s: the child's own time limit (it ends by itself then).

    ``start`` returns None where no child could start (no interpreter path, spawn refused): the
    teardown then takes its 1 s. Use as: ``w = ListenerWaker.start(host, port); del engine;
    if w: w.close()``.
    """

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc

    @classmethod
    def start(cls, host: str, port: int, limit_s: float = 2.0) -> "ListenerWaker | None":
        if not sys.executable or not isinstance(port, int) or not 0 < port < 65536:
            return None
        try:
            proc = subprocess.Popen([sys.executable, "-S", "-c", _CODE, str(host), str(port), str(limit_s)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, close_fds=True)
        except Exception as exc:  # noqa: BLE001 - e.g. at interpreter exit: the slow teardown serves
            logger.debug("Mooncake listener waker not started (%s): its teardown takes ~1 s", exc)
            return None
        return cls(proc)

    def close(self) -> None:
        """Ends the child (it may have ended by itself) and reaps it; waits at most 1 s."""
        if self._proc.poll() is None:
            self._proc.kill()
        try:
            self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:  # a kill not yet delivered: left to the OS to reap
            logger.debug("Mooncake listener waker %d still running after kill", self._proc.pid)
