"""`Child`: a spawned worker process and the parent's end of its pipe, for the demo jobs that
drive one process per rank (``dcp-jax generate``, the TP/layout ``transfer``); `exit_with_parent`,
called first in such a process, ends it once its parent is gone. Imports no JAX (a rank sets its
XLA flags before JAX loads).

The protocol is ``(kind, arg)`` tuples both ways. A child that fails sends ``("error",
traceback)`` before it exits, so the parent reports the child's own error, whichever of its
sends or receives meets the dead child first, and never the pipe's BrokenPipeError or EOFError
(which the CLI turned into an empty exit 1). Every wait is bounded.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["Child", "exit_with_parent", "report_error"]


def report_error(conn) -> None:
    """In a rank's ``except``: sends ``("error", traceback)`` to the parent; a parent already
    gone is ignored (the rank exits anyway; a second traceback about the pipe said nothing)."""
    import traceback

    try:
        conn.send(("error", traceback.format_exc()))
    except OSError:
        pass


def exit_with_parent(poll_s: float = 0.5) -> threading.Thread:
    """Called first in a rank process: a daemon thread ends the process (``os._exit(1)``) within
    ``poll_s`` seconds once its parent is gone (re-parented: ``os.getppid()`` changed).

    Why: a rank computing or waiting never reads its pipe, and JAX's distributed runtime catches
    SIGTERM (its preemption notifier), so ``generate``'s decode ranks outlived a parent stopped
    by SIGTERM, each holding a core, until killed by hand. Returns the thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    t = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    t.start()
    return t


class Child:
    """Starts ``target(child_conn, *args)`` in a ``ctx`` process named ``who``; owns the process
    and the parent's end of the pipe (`stop` releases both)."""

    def __init__(self, ctx, who: str, target, *args):
        self.who = who
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=who.replace(" ", "-"))
        self.proc.start()
        child.close()

    def _its_error(self, before: str) -> RuntimeError:
        """What to raise once the pipe broke: the child's own ``error`` message if it sent one."""
        self.proc.join(5)
        try:
            while self.conn.poll(0):
                got, why = self.conn.recv()
                if got == "error":
                    return RuntimeError(f"{self.who} failed:\n{why}")
        except (EOFError, OSError):
            pass
        return RuntimeError(f"{self.who} exited (code {self.proc.exitcode}) before {before!r}")

    def send(self, kind: str, arg: Any = None) -> None:
        """Sends ``(kind, arg)``.

        Raises:
            RuntimeError: the child is gone; the message is its own error if it sent one.
        """
        try:
            self.conn.send((kind, arg))
        except OSError:  # BrokenPipeError, ConnectionResetError
            raise self._its_error(kind) from None

    def recv(self, expect: str, timeout_s: float) -> Any:
        """Waits at most ``timeout_s`` seconds for a ``(expect, arg)`` message; returns ``arg``.

        Raises:
            RuntimeError: the child sent ``error`` (its traceback is in the message), sent another
                kind, or exited before sending.
            TimeoutError: nothing came within ``timeout_s`` from a child still running.
        """
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise self._its_error(expect)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.who}: no {expect!r} within {timeout_s:g} s")
        try:
            kind, arg = self.conn.recv()
        except (EOFError, OSError):  # the child closed its end: gone or going
            raise self._its_error(expect) from None
        if kind == "error":
            raise RuntimeError(f"{self.who} failed:\n{arg}")
        if kind != expect:
            raise RuntimeError(f"{self.who}: expected {expect!r}, got {kind!r}: {arg}")
        return arg

    def stop(self, timeout_s: float = 10.0) -> None:
        """Joins the process (killed after ``timeout_s`` seconds) and closes the pipe."""
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
