"""A round's posts wait for its own pack only (`pallas_kernels.written`), not inside the round:
the worker goes on (the next round's pack, grants, completions) and posts each round once its
pack finished, oldest round first. On a GPU the ticket covers a device pack; here (host packs
finish inside the call) a gate stands in for a device pack still running: the tests hold it shut
and open it, with real engines (NIXL over UCX, Mooncake over TCP) moving the bytes.
"""
import contextlib
import threading
import time

from conftest import Cluster, Gate, TransferStatus, announced, arena_free, check_region_timeline, events, wait_for
from dcp_jax.transfer._sender_pack import SenderPack

S = TransferStatus
ROW = 48 + 16


def gated(monkeypatch, error=None):
    """Every round with a pack gets a fresh shut `Gate`; returns the list they go into."""
    gates = []

    def ticket(self, packed):
        if not any(addr is not None for _, _, _, addr in packed):
            return None
        gates.append(Gate(error))
        return gates[-1]

    monkeypatch.setattr(SenderPack, "_pack_ticket", ticket)
    return gates


@contextlib.contextmanager
def gated_cluster(monkeypatch, engine, mode, error=None):
    """A sender and two ranks whose rounds' packs are held by gates (`gated`); at exit every
    gate opens and every side closes. Yields (gates, cluster)."""
    gates = gated(monkeypatch, error)
    kw = dict(receiver_kw=dict(region_bytes=64 * ROW)) if mode == "region" else {}
    c = Cluster(engine, mode=mode, dcp_size=2, **kw)
    try:
        yield gates, c
    finally:
        open_all(gates)
        c.close()


def open_all(gates):
    for g in gates:
        g.open()


def start(c, rid, num_tokens, packed=False):
    """Every rank expects ``rid``, then the sender gets all of it; with ``packed``, returns once
    both ranks' windows are packed (their packs held "running" by the gates). Returns the tables."""
    src, dst = c.tables(num_tokens)
    c.expect(rid, dst, num_tokens)
    assert wait_for(lambda: announced(c.sender, rid) == {0, 1})
    c.sender.send(rid, src, 0, num_tokens)
    if packed:  # one round, or two when a rank announced late
        assert wait_for(lambda: {e[1] for e in events(c.sender, rid, "pack")} == {0, 1}), c.reasons(rid)
    return src, dst


def test_rounds_post_once_their_pack_finished_oldest_first(engine, monkeypatch):
    with gated_cluster(monkeypatch, engine, "region") as (gates, c):
        c.sender._index_cap["pack"] = 1  # one window per round: two rounds, one per rank
        src, dst = start(c, "r", 24)
        # Both rounds packed and asked while neither pack "finished": the worker did not wait.
        assert wait_for(lambda: len(gates) == 2 and len(events(c.sender, "r", "ask")) == 2), c.reasons("r")
        assert wait_for(lambda: len(events(c.sender, "r", "grant")) == 2), c.reasons("r")
        time.sleep(0.05)
        assert events(c.sender, "r", "packed") == events(c.sender, "r", "post") == []
        first = events(c.sender, "r", "pack")[0][1]
        gates[1].open()  # the newer round's pack ends first: it still waits for the older one
        time.sleep(0.05)
        assert events(c.sender, "r", "post") == []
        gates[0].open()
        assert c.wait("r") == [S.SUCCESS] * 3, c.reasons("r")
        assert c.check_bytes(src, dst, 24) == 24
        posts = events(c.sender, "r", "post")
        assert [p[1] for p in posts] == [first, 1 - first]  # oldest round first
        assert check_region_timeline(c.sender.request_stats("r")["timeline"]) == {0: 1, 1: 1}
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]


def test_abort_while_a_pack_runs_keeps_its_region_until_the_pack_ends(engine, monkeypatch):
    with gated_cluster(monkeypatch, engine, "packed") as (gates, c):
        src, dst = start(c, "a", 20, packed=True)
        c.sender.abort("a")
        assert c.sender.poll("a") is S.ABORTED
        time.sleep(0.05)
        # The pack may still write its regions: the arena does not hand them out yet.
        assert c.sender.stats["arena"]["in_use_bytes"] > 0
        open_all(gates)
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]
        assert events(c.sender, "a", "post") == [] and c.sender.engine.counters.descriptors == 0
        assert wait_for(lambda: all(r.poll("a") is S.ABORTED for r in c.receivers)), c.reasons("a")
        # The sender goes on: the next request's round posts once its own pack ended.
        src2, dst2 = c.tables(9)
        c.expect("b", dst2, 9)
        n = len(gates)
        c.sender.send("b", src2, 0, 9)
        assert wait_for(lambda: {e[1] for e in events(c.sender, "b", "pack")} == {0, 1}), c.reasons("b")
        assert len(gates) > n and c.sender.poll("b") is S.WAITING
        open_all(gates)
        assert c.wait("b") == [S.SUCCESS] * 3, c.reasons("b")
        assert c.check_bytes(src2, dst2, 9) == 9


def test_close_waits_for_a_running_pack_and_frees_its_region(engine, monkeypatch):
    with gated_cluster(monkeypatch, engine, "region") as (gates, c):
        src, dst = start(c, "c", 16, packed=True)
        time.sleep(0.05)
        assert events(c.sender, "c", "post") == []
        threading.Timer(0.2, lambda: [g.open() for g in gates]).start()  # the "kernels" end while close waits
        t0 = time.monotonic()
        c.sender.close(timeout_s=5.0)
        assert all(g.waits == 1 for g in gates) and time.monotonic() - t0 >= 0.15
        assert c.sender.stats["arena"]["in_use_bytes"] == 0
        assert c.sender.poll("c") is S.FAILED and "sender closed" in c.sender.failure_reason("c")


def test_a_pack_that_failed_fails_its_request_and_the_sender_goes_on(engine, monkeypatch):
    # A CUDA error surfaces when the ticket is polled (CuPy's Event.done raises): the round's
    # windows fail naming it, the worker's rounds go on (no worker error, heartbeats continue).
    error = RuntimeError("an illegal memory access was encountered (injected)")
    with gated_cluster(monkeypatch, engine, "region", error) as (_, c):
        src, dst = start(c, "f", 16)
        assert c.wait("f") == [S.FAILED] * 3, c.reasons("f")
        assert "illegal memory access" in c.sender.failure_reason("f")
        assert all("illegal memory access" in r.failure_reason("f") for r in c.receivers)
        assert events(c.sender, "f", "post") == [] and c.sender.engine.counters.descriptors == 0
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]
        assert c.sender.stats["worker_errors"] == 0
        monkeypatch.undo()  # the device recovers: host packs again
        c.round_trip("g", 11)


def test_close_gives_up_on_a_pack_that_never_ends(engine, monkeypatch):
    from dcp_jax.transfer import _sender_units

    monkeypatch.setattr(_sender_units, "DRAIN_PACK_S", 0.3)
    monkeypatch.setattr(_sender_units, "_ORPHANED_PACKS", [])
    with gated_cluster(monkeypatch, engine, "packed") as (gates, c):
        src, dst = start(c, "h", 16, packed=True)
        pack = c.sender._pack
        t0 = time.monotonic()
        c.sender.close(timeout_s=5.0)
        assert time.monotonic() - t0 < 4.0  # within its timeout, the hung pack not waited out
        assert _sender_units._ORPHANED_PACKS == [pack]  # its buffer is never freed or reused
        assert c.sender.poll("h") is S.FAILED


def test_a_request_stalled_on_its_pack_says_so(engine, monkeypatch):
    with gated_cluster(monkeypatch, engine, "region") as (gates, c):
        c.sender.timeout_s = 1.0  # the sender's bound only: the ranks wait longer
        src, dst = start(c, "s", 16)
        assert wait_for(lambda: c.sender.poll("s") is S.FAILED, 10.0), c.reasons("s")
        assert "waits for its pack kernel" in c.sender.failure_reason("s"), c.reasons("s")
        open_all(gates)
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]
