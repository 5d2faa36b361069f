"""`Child` (dcp_jax.child_process), the pipe to one rank process of the generate and TP/layout jobs:
a child that dies reports its own error whether the parent meets it in a send or a receive, and
every wait is bounded. The children are real processes (forked: local targets, no JAX state)."""
import multiprocessing as mp
import time

import pytest

from dcp_jax.child_process import Child

# forkserver, not fork: an xdist worker that ran engine tests before could not fork (CI:
# "OSError: [Errno 12] Cannot allocate memory" at os.fork()); the server is a fresh, small process.
# The targets are module level (the server imports this module); every wait is bounded.
CTX = mp.get_context("forkserver")
BIG = {"addresses": ["x" * 200_000]}  # more than a pipe's buffer: the send must meet the dead end


def _dies_with_an_error(conn):
    conn.send(("error", "Traceback ...\nValueError: the child's own reason"))
    conn.close()


def _dies_silently(conn):
    conn.close()


def _answers(conn, kind):
    conn.send((kind, {"n": 7}))
    conn.recv()


def _hangs(conn):
    conn.recv()


def test_a_send_to_a_child_that_died_raises_its_own_error():
    # Before: the parent's send hit BrokenPipeError, which the CLI turned into an empty exit 1.
    c = Child(CTX, "decode rank (0, 1)", _dies_with_an_error)
    c.proc.join(10)
    with pytest.raises(RuntimeError, match=r"(?s)decode rank \(0, 1\) failed:\n.*the child's own reason"):
        for _ in range(3):  # the first sends may still fit the pipe's buffer
            c.send("open", BIG)
    c.stop()
    c = Child(CTX, "decode rank 1", _dies_silently)
    c.proc.join(10)
    with pytest.raises(RuntimeError, match=r"decode rank 1 exited \(code 0\) before 'open'"):
        for _ in range(3):
            c.send("open", BIG)
    c.stop()


def test_recv_returns_the_arg_and_names_what_went_wrong():
    c = Child(CTX, "prefill rank 0", _answers, "address")
    assert c.recv("address", 10) == {"n": 7}
    c.send("close")
    c.stop()
    c = Child(CTX, "prefill rank 0", _answers, "sent")
    with pytest.raises(RuntimeError, match=r"prefill rank 0: expected 'address', got 'sent': \{'n': 7\}"):
        c.recv("address", 10)
    c.send("close")
    c.stop()
    c = Child(CTX, "prefill rank 2", _dies_with_an_error)
    with pytest.raises(RuntimeError, match=r"(?s)prefill rank 2 failed:\n.*the child's own reason"):
        c.recv("address", 10)
    c.stop()
    c = Child(CTX, "prefill rank 3", _dies_silently)
    with pytest.raises(RuntimeError, match=r"prefill rank 3 exited \(code 0\) before 'address'"):
        c.recv("address", 10)
    c.stop()


def test_waits_are_bounded():
    c = Child(CTX, "decode rank 5", _hangs)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"decode rank 5: no 'ready' within 0.3 s"):
        c.recv("ready", 0.3)
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    c.stop(0.2)  # still blocked in recv: killed after the bound
    assert time.monotonic() - t0 < 10
    assert not c.proc.is_alive() and c.proc.exitcode != 0
    assert c.conn.closed


def _orphan_that_ignores_sigterm():
    import signal

    from dcp_jax.child_process import exit_with_parent

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX's preemption notifier does
    exit_with_parent(0.1)
    while True:
        time.sleep(1)


def _parent_of_one(q):
    # fork here: the rank must be this process's own child, to be re-parented when it dies
    p = mp.get_context("fork").Process(target=_orphan_that_ignores_sigterm, daemon=False)
    p.start()
    q.put(p.pid)
    time.sleep(600)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()  # exited; the new parent may not reap it
    except FileNotFoundError:
        return True


def test_a_rank_ends_once_its_parent_is_gone_even_ignoring_sigterm():
    # Before: generate's decode ranks outlived a CLI stopped by SIGTERM, a core each, for minutes.
    import os
    import signal

    q = CTX.Queue()

    parent = CTX.Process(target=_parent_of_one, args=(q,))
    parent.start()
    rank = q.get(timeout=20)
    time.sleep(0.5)
    assert not _gone(rank)
    os.kill(rank, signal.SIGTERM)  # ignored: still running
    time.sleep(0.3)
    assert not _gone(rank)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(10)
    deadline = time.monotonic() + 10
    while not _gone(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = _gone(rank)
    if not gone:
        os.kill(rank, signal.SIGKILL)  # an orphan would hold pytest's output open
    assert gone, "the rank outlived its parent"


def test_report_error_sends_the_traceback_and_ignores_a_parent_gone():
    from dcp_jax.child_process import report_error

    parent, child = CTX.Pipe()
    try:
        raise ValueError("the rank's own failure")
    except ValueError:
        report_error(child)
    kind, text = parent.recv()
    assert kind == "error" and "ValueError: the rank's own failure" in text
    parent.close()  # the parent is gone: the pipe is broken
    try:
        raise ValueError("again")
    except ValueError:
        report_error(child)  # before: BrokenPipeError, a second traceback on the rank's stderr
    child.close()
