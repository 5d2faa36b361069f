"""The two-host harness itself: namespaces, links, addresses, processes, that the engines' bytes
cross the link, and that it leaves nothing behind (after a clean exit, after an exception, after a
crashed run)."""
import json
import subprocess
import sys

import pytest

from conftest import ITEM_LENS, PAGE, roundtrip
from dcp_jax.netns import Hosts, remove_stale, run_in
from dcp_jax.netns.agents import Agent
from dcp_jax.netns.hosts import link_running

pytestmark = pytest.mark.timeout(60)


def _netns():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _connect_script(addr, port):
    return [sys.executable, "-c", f"import socket; s=socket.create_connection(('{addr}', {port}), timeout=3); "
                                  f"print(s.recv(16).decode())"]


def test_two_hosts_talk_over_their_link_and_vanish_on_exit():
    with Hosts(2) as h:
        names = list(h.names)
        assert all(n in _netns() for n in names)
        out = run_in(h, 1, ["ip", "-4", "-o", "addr", "show", "dev", h.device(1)]).stdout
        assert f"{h.addr(1)}/24" in out
        assert "lo" in run_in(h, 0, ["ip", "-o", "link", "show", "up"]).stdout
        assert h.env(1)["UCX_NET_DEVICES"] == "veth0" and h.env(0)["UCX_NET_DEVICES"] == "veth1"
        # Running (carrier) on both ends as soon as Hosts returns: UCX skips links that are not.
        assert link_running(h.names[0], h.device(0, 1)) and link_running(h.names[1], h.device(1))
        # A server on host 0's address, a client on host 1: across the veth, not loopback.
        srv = subprocess.Popen(h.exec_argv(0, [sys.executable, "-c",
                               f"import socket; s=socket.create_server(('{h.addr(0, 1)}', 47123)); "
                               "c,a=s.accept(); c.sendall(a[0].encode())"]))
        try:
            got = ""
            for _ in range(50):
                p = run_in(h, 1, _connect_script(h.addr(0, 1), 47123))
                if p.returncode == 0:
                    got = p.stdout.strip()
                    break
            assert got == h.addr(1)  # the server saw the client's veth address
        finally:
            srv.wait(10)
        # Link down: nothing gets through; up again: it does.
        h.link_down(1)
        assert run_in(h, 1, _connect_script(h.addr(0, 1), 47124)).returncode != 0
        assert not link_running(h.names[1], h.device(1))
        h.link_up(1)
        assert link_running(h.names[0], h.device(0, 1)) and link_running(h.names[1], h.device(1))
    assert not any(n in _netns() for n in names)


def test_namespaces_are_removed_after_an_exception_and_stale_ones_of_dead_runs():
    with pytest.raises(ZeroDivisionError):
        with Hosts(3) as h:
            names = list(h.names)
            1 / 0
    assert not any(n in _netns() for n in names)
    # A crashed run's namespace (its pid is gone) is removed by the next run; a live one's is not.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    # Its own prefix: a Hosts() of a test on another pytest-xdist worker would remove a stale
    # "dcpn-" namespace before this one can, and the removal is what this test checks.
    stale = f"dcpt-{dead}-abcdef-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with Hosts(2, prefix="dcpt") as h:
        assert stale in h.stale_removed and stale not in _netns()
        assert remove_stale("dcpt") == []  # this run's own namespaces are live
        assert all(n in _netns() for n in h.names)


def test_a_spawned_process_runs_inside_its_host():
    with Hosts(2) as h:
        import multiprocessing as mp

        a, b = mp.get_context("spawn").Pipe()
        p = h.spawn(1, _report_addresses, (b,))
        assert a.poll(30)
        addrs = a.recv()
        p.join(10)
        assert h.addr(1) in addrs and h.addr(0, 1) not in addrs


def _report_addresses(conn):
    import os

    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    conn.send(out + os.environ["UCX_NET_DEVICES"])


def _rx_bytes(h, host):
    out = run_in(h, host, ["ip", "-s", "-j", "link", "show", "dev", h.device(host)]).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]


def test_the_engines_bytes_cross_the_veth(engine):
    # One kernel under both namespaces: UCX's default transports put with CMA (without UCX_TLS=tcp
    # this request moved 485 bytes over the veth, measured); TCP sends them over the link.
    geo = dict(item_lens=ITEM_LENS, page_size=PAGE, pages=512)
    with Hosts(2) as h:
        sender = Agent(h, 0, "sender", engine=engine, host=h.addr(0, 1), **geo)
        recv = Agent(h, 1, "receiver", engine=engine, host=h.addr(1), **geo)
        try:
            recv.call("connect", sender.hello)
            roundtrip(sender, recv, "warm", 8, src_pages=512)  # connection set up
            before = _rx_bytes(h, 1)
            n = 2048
            roundtrip(sender, recv, "big", n, src_pages=512)
            payload = n * sum(ITEM_LENS)  # 128 KiB
            got = _rx_bytes(h, 1) - before
            assert got >= payload, f"{got} bytes over the veth for {payload} bytes of rows"
        finally:
            sender.close(), recv.close()
