"""Wakes a Mooncake engine's handshake listener while the engine is destroyed.

Why: ``mooncake.engine.TransferEngine``'s destructor (mooncake-transfer-engine 0.3.x, P2P
handshake) stops its handshake listener thread by clearing a flag and joining it, but that thread
sits in ``accept()`` with a 1 s receive timeout and sees the flag only when ``accept`` returns. So
every engine teardown took 1.01 s, and the destructor runs with the GIL held (a pybind11
destructor): every other thread of the process (a serving loop, the other side's workers) stood
still that second. Measured here (2026-12-07, one engine on loopback, 2 cores): 1.010 s without
a waker, 20-70 ms with one (most of it the child's start-up, now without the GIL held).

How: a small child process (this interpreter, ``-I -S``, nothing imported but ``socket``)
connects to the listener every 2 ms and closes at once, until a connection is refused (the
listener is gone; a timeout is not taken for that) or its time limit passes. The engine is destroyed once the child runs. A
connection that comes while the listener still runs is accepted and read as an empty handshake
(Mooncake logs two WARNING lines for it, "Socket read incompleted", unless its log level is
raised: `bridge.engine_env.quiet_engines`); the first one after the flag is cleared ends the
loop. It must be another process: the destructor holds the GIL, so a thread of this process could
not run. The child only connects to the engine's own listener (its handshake host, else
127.0.0.1: Mooncake listens on 0.0.0.0 whatever host it was given), sends nothing and reads nothing.
Where no child can start, a warning says so once and each close takes its second.
"""
from __future__ import annotations

import logging
import select
import subprocess
import sys

__all__ = ["ListenerWaker"]

logger = logging.getLogger("bridge")

# argv: host, port, limit_s. Mooncake listens on 0.0.0.0 (IPv4) whatever host it was given, so a
# host that cannot reach it (an IPv6 or unresolvable name, a "host:port" string) falls back to
# 127.0.0.1 (this network namespace's loopback). One byte on stdout says it runs (the parent then
# destroys the engine); the exit status says whether it reached the listener and saw it go (0),
# never reached it (2), or ran out of time (3).
_CODE = """
import socket, sys, time
host, port, end = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
sys.stdout.write("r"); sys.stdout.flush()
addr = None
for cand in (host, "127.0.0.1"):
    try:
        socket.create_connection((cand, port), timeout=0.05).close()
        addr = cand
        break
    except OSError:
        pass
if addr is None:
    sys.exit(2)
while time.monotonic() < end:
    time.sleep(0.002)
    try:
        socket.create_connection((addr, port), timeout=0.05).close()
    except ConnectionRefusedError:
        sys.exit(0)
    except OSError:
        pass
sys.exit(3)
"""

_WARNED = []  # one warning per process where no waker can start


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
        #: After `close`: True if the child reached the listener and saw it go (it was woken).
        self.woke: bool | None = None

    @classmethod
    def start(cls, host: str, port: int, limit_s: float = 2.0) -> "ListenerWaker | None":
        """Starts the child and returns once it runs (at most 1 s), so that the engine's
        destructor, which holds the GIL, does not also wait for an interpreter to start."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            return None
        if not sys.executable:
            cls._warn("no Python executable (sys.executable is empty)")
            return None
        try:  # -I: no working directory, PYTHONPATH or user site on its path (a local socket.py)
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CODE, str(host), str(port), str(limit_s)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, close_fds=True)
        except Exception as exc:  # noqa: BLE001 - e.g. at interpreter exit: the slow teardown serves
            cls._warn(f"{type(exc).__name__}: {exc}")
            return None
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            proc.stdout.read(1)
        return cls(proc)

    @staticmethod
    def _warn(why: str) -> None:
        if not _WARNED:
            _WARNED.append(why)
            logger.warning("Mooncake engine close: its listener waker did not start (%s); each close "
                           "takes ~1 s with the GIL held", why)

    def close(self) -> None:
        """Reaps the child and sets `woke`: it ends by itself within a few ms of the listener
        going (up to 0.2 s are given), else it is killed; waits at most 1.2 s."""
        try:
            self._proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        try:
            rc = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:  # a kill not yet delivered: left to the OS to reap
            logger.debug("Mooncake listener waker %d still running after kill", self._proc.pid)
            rc = None
        self._proc.stdout.close()
        self.woke = rc == 0
