"""`bridge.mooncake_wake.ListenerWaker`: the child that wakes Mooncake's handshake listener while
the engine is destroyed (the destructor otherwise waits out a 1 s accept timeout with the GIL
held). Checked against a listener of our own (what the child does) and a real engine (what it is
for: the listener is gone once `close` returns, the child is reaped)."""
import os
import socket
import threading
import time

import pytest

from bridge.mooncake_wake import ListenerWaker


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    return srv, srv.getsockname()[1]


def _serve(srv, n, got):
    def accept():
        srv.settimeout(10)
        for _ in range(n):
            conn, _ = srv.accept()
            conn.settimeout(5)
            got.append(conn.recv(16))  # b"": closed at once, nothing sent
            conn.close()

    t = threading.Thread(target=accept)
    t.start()
    return t


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "no-such-host.invalid", "127.0.0.1:12345"])
def test_the_child_connects_sends_nothing_and_ends_once_refused(host, tmp_path, monkeypatch):
    """Any handshake host: one that cannot reach the (IPv4) listener falls back to 127.0.0.1. A
    socket.py in the working directory is not the child's socket module (-I)."""
    (tmp_path / "socket.py").write_text("raise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    srv, port = _listener()
    got = []
    t = _serve(srv, 3, got)
    waker = ListenerWaker.start(host, port, limit_s=30.0)
    assert waker is not None
    t.join(15)
    assert got == [b"", b"", b""]
    srv.close()  # now refused: the child ends by itself, long before its 30 s limit
    deadline = time.monotonic() + 10
    while waker._proc.poll() is None:
        assert time.monotonic() < deadline, "the child kept running after its connections were refused"
        time.sleep(0.01)
    waker.close()
    assert waker.woke is True


def test_the_child_ends_at_its_limit_and_close_kills_a_running_one():
    srv, port = _listener()  # accepts nothing: connections queue in the backlog
    try:
        t0 = time.monotonic()
        waker = ListenerWaker.start("127.0.0.1", port, limit_s=0.3)
        assert waker._proc.wait(timeout=10) == 3  # ran out of time: the listener never went
        assert time.monotonic() - t0 < 10
        waker.close()
        assert waker.woke is False
        waker = ListenerWaker.start("127.0.0.1", port, limit_s=60.0)
        time.sleep(0.05)
        waker.close()
        assert waker._proc.returncode is not None and waker.woke is False  # killed and reaped
    finally:
        srv.close()


def test_no_listener_at_all_ends_the_child_at_once():
    srv, port = _listener()
    srv.close()
    waker = ListenerWaker.start("127.0.0.1", port, limit_s=30.0)
    assert waker._proc.wait(timeout=10) == 2
    waker.close()
    assert waker.woke is False


@pytest.mark.parametrize("port", [0, -1, 65536, "80", None, True])
def test_a_port_no_listener_can_have_starts_nothing(port):
    assert ListenerWaker.start("127.0.0.1", port) is None


def test_no_interpreter_warns_once(monkeypatch, caplog):
    import bridge.mooncake_wake as mw

    monkeypatch.setattr(mw.sys, "executable", "")
    monkeypatch.setattr(mw, "_WARNED", [])
    with caplog.at_level("WARNING", logger="bridge"):
        assert ListenerWaker.start("127.0.0.1", 4000) is None
        assert ListenerWaker.start("127.0.0.1", 4000) is None
    assert [r.getMessage() for r in caplog.records if "waker did not start" in r.getMessage()] == [
        "Mooncake engine close: its listener waker did not start (no Python executable (sys.executable is "
        "empty)); each close takes ~1 s with the GIL held"]


def _children() -> set:
    """Pids of this process's children (Linux /proc), zombies included."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.mark.parametrize("hostname", ["127.0.0.1", "::1"])
def test_a_mooncake_engine_closes_with_its_listener_woken_gone_and_the_child_reaped(hostname, monkeypatch):
    """The waker reached the engine's listener and saw it go (`woke`), also for a handshake host
    the IPv4 listener cannot be reached at; no child is left; the listener is gone."""
    pytest.importorskip("mooncake.engine")
    from bridge.buffers import HostBuffer
    from bridge.mooncake import MooncakeEngine

    closed = []
    real_close = ListenerWaker.close

    def close(self):
        real_close(self)
        closed.append(self.woke)

    monkeypatch.setattr(ListenerWaker, "close", close)
    eng = MooncakeEngine("wake", hostname=hostname)
    eng.register([HostBuffer(1 << 16)])
    port = int(eng.session.rpartition(":")[2])
    before = _children()
    eng.close()
    assert eng.torn_down
    assert closed == [True]
    assert _children() - before == set()  # the waker was reaped
    with pytest.raises(OSError):  # the engine's handshake listener is gone
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
