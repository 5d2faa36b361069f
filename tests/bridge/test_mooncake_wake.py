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


def test_the_child_connects_sends_nothing_and_ends_once_refused():
    srv, port = _listener()
    got = []

    def accept():
        srv.settimeout(10)
        for _ in range(3):
            conn, _ = srv.accept()
            conn.settimeout(5)
            got.append(conn.recv(16))  # b"": closed at once, nothing sent
            conn.close()

    t = threading.Thread(target=accept)
    t.start()
    waker = ListenerWaker.start("127.0.0.1", port, limit_s=30.0)
    assert waker is not None
    t.join(15)
    assert got == [b"", b"", b""]
    srv.close()  # now refused: the child ends by itself, long before its 30 s limit
    deadline = time.monotonic() + 10
    while waker._proc.poll() is None:
        assert time.monotonic() < deadline, "the child kept running after its connections were refused"
        time.sleep(0.01)
    assert waker._proc.returncode == 0
    waker.close()  # reaping an ended child: no wait


def test_the_child_ends_at_its_limit_and_close_kills_a_running_one():
    srv, port = _listener()  # accepts nothing: connections queue in the backlog
    try:
        t0 = time.monotonic()
        waker = ListenerWaker.start("127.0.0.1", port, limit_s=0.3)
        assert waker._proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 10
        waker = ListenerWaker.start("127.0.0.1", port, limit_s=60.0)
        time.sleep(0.05)
        waker.close()
        assert waker._proc.returncode is not None  # killed and reaped
    finally:
        srv.close()


@pytest.mark.parametrize("port", [0, -1, 65536, "80", None])
def test_a_port_no_listener_can_have_starts_nothing(port):
    assert ListenerWaker.start("127.0.0.1", port) is None


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


def test_a_mooncake_engine_closes_with_its_listener_gone_and_the_child_reaped():
    pytest.importorskip("mooncake.engine")
    from bridge.buffers import HostBuffer
    from bridge.mooncake import MooncakeEngine

    eng = MooncakeEngine("wake")
    eng.register([HostBuffer(1 << 16)])
    host, _, port = eng.session.rpartition(":")
    before = _children()
    eng.close()
    assert eng.torn_down
    assert _children() - before == set()  # the waker was reaped
    with pytest.raises(OSError):  # the engine's handshake listener is gone
        socket.create_connection((host, int(port)), timeout=1).close()
