"""A ticket a window (``DCP_JAX_PACK_TICKET_EACH=1``, `SenderPack._pack_each`): the round's
``region_ask`` frames all go first, then each window's pack with a ticket of its own, and
`_post_ready` posts each window once its ticket (and every older one) is ready. Here on the host
(`Packer.launches_each` forced on; host packs end inside the call), `pallas_kernels.written`
hands out gates that stand in for kernels still running; real engines move the bytes."""
import os
import subprocess
import sys

import pallas_kernels
import pytest

from conftest import Cluster, Gate, TransferStatus, announced, arena_free, events, region_free, wait_for
from dcp_jax.transfer import _sender_pack
from dcp_jax.transfer.staging import Packer

S = TransferStatus


@pytest.fixture
def each(monkeypatch):
    """Turns the ticket a window on; records asks and packs in order; returns (log, gates)."""
    log, gates = [], []
    monkeypatch.setattr(_sender_pack, "TICKET_EACH", True)
    monkeypatch.setattr(Packer, "launches_each", lambda self, windows: True)
    call = Packer.__call__

    def packing(self, idx, offset, *, sync=True):
        log.append(("pack", int(offset)))
        return call(self, idx, offset, sync=sync)

    monkeypatch.setattr(Packer, "__call__", packing)
    from dcp_jax.transfer._sender_region import SenderRegion

    ask = SenderRegion._ask_region

    def asking(self, u):
        log.append(("ask", u.target.conn.spec.dcp_rank))
        return ask(self, u)

    monkeypatch.setattr(SenderRegion, "_ask_region", asking)

    def written(buffer):
        gates.append(Gate())
        return gates[-1]

    monkeypatch.setattr(pallas_kernels, "written", written)
    return log, gates


@pytest.mark.parametrize("notify", ["round", "write"])
def test_asks_first_then_each_window_posts_once_its_own_ticket_is_ready(engine, each, notify):
    log, gates = each
    c = Cluster(engine, dcp_size=3, mode="region", receiver_kw=dict(region_bytes=64 << 20), region_notify=notify)
    try:
        L = 40
        src, dst = c.tables(L)
        c.expect("e", dst, L)
        assert wait_for(lambda: announced(c.sender, "e") == {0, 1, 2})  # one round: a window to each rank
        c.sender.send("e", src, 0, L)
        assert wait_for(lambda: len(gates) == 3), (log, c.reasons("e"))
        assert [k for k, _ in log] == ["ask"] * 3 + ["pack"] * 3, log
        assert wait_for(lambda: len(events(c.sender, "e", "grant")) == 3), c.reasons("e")
        first = events(c.sender, "e", "pack")[0][1]
        gates[1].open()  # a younger window's kernel ends first: it waits for the oldest one
        assert not wait_for(lambda: events(c.sender, "e", "post"), timeout_s=0.1)
        gates[0].open()
        assert wait_for(lambda: len(events(c.sender, "e", "post")) == 2), events(c.sender, "e", "post")
        assert [p[1] for p in events(c.sender, "e", "post")][0] == first
        gates[2].open()
        assert c.wait("e") == [S.SUCCESS] * 4, c.reasons("e")
        assert c.check_bytes(src, dst, L) == L
        assert all(c.sentinel_pages(r, dst[r]) for r in range(3))
        st = c.sender.request_stats("e")
        assert st["launches"] == 3 and st["pack_seconds"] > 0
        assert all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]
    finally:
        for g in gates:
            g.open()
        c.close()


def test_a_window_whose_pack_fails_ends_its_request_and_the_next_one_goes(engine, each, monkeypatch):
    log, gates = each
    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=64 << 20))
    try:
        packing = Packer.__call__
        fail = {"left": 1}

        def second_fails(self, idx, offset, *, sync=True):
            if sum(k == "pack" for k, _ in log) == 1 and fail["left"]:  # the round's second window
                fail["left"] = 0
                raise RuntimeError("pack launch failed")
            return packing(self, idx, offset, sync=sync)

        monkeypatch.setattr(Packer, "__call__", second_fails)
        L = 24
        src, dst = c.tables(L)
        c.expect("f", dst, L)
        assert wait_for(lambda: announced(c.sender, "f") == {0, 1})
        c.sender.send("f", src, 0, L)
        assert wait_for(lambda: gates), log
        for g in gates:
            g.open()
        assert c.sender.wait("f", 10) == S.FAILED
        assert "pack launch failed" in c.sender.failure_reason("f")
        assert all(wait_for(lambda r=r: r.poll("f").terminal) for r in c.receivers)
        assert wait_for(lambda: arena_free(c.sender)) and all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
        src2, dst2 = c.tables(L)
        c.expect("g", dst2, L)
        assert wait_for(lambda: announced(c.sender, "g") == {0, 1})
        c.sender.send("g", src2, 0, L)
        assert wait_for(lambda: len(gates) == 3), log  # one gate for "f"'s packed window, two for "g"
        for g in gates:
            g.open()
        assert c.wait("g") == [S.SUCCESS] * 3, c.reasons("g")
        assert c.check_bytes(src2, dst2, L) == L
    finally:
        for g in gates:
            g.open()
        c.close()


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), (None, False)])
def test_the_switch_is_read_from_the_environment_and_named_in_the_job_switches(value, on):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCP_JAX_")}
    if value is not None:
        env["DCP_JAX_PACK_TICKET_EACH"] = value
    code = ("from dcp_jax.job.run import switches; from dcp_jax.transfer import _sender_pack; "
            "print(_sender_pack.TICKET_EACH, switches()['pack_ticket_each'])")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(on), str(on)]
