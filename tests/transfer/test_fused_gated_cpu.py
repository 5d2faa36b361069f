"""The fused path gated on the sender's flag page (bridge.host_flag), on the CPU, with real pages.

On a GPU the sender enqueues a bump of its flag page after its copy kernel and sends
``fused_done(gated=True, seq=k)`` at once; each rank credits its rows only once the page reads k.
On the host the copy is synchronous and the sender's host bump writes the page itself: the pages,
the mapping by name, the crediting, the control plane and the engines here are all real (the
rank mapping is `test_region_fused_cpu`'s host stand-in for CUDA IPC). Holding a bump back plays
a device copy still running.
"""
import os

import pytest

from conftest import TransferStatus
from dcp_jax.transfer import _sender_region
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._receiver_links import _open_flag
from dcp_jax.transfer.spec import HandshakeError
from test_region import cluster, wait_for
from test_region_fused_cpu import fused_on_host  # noqa: F401 - the fixture
from test_region_hostile import rewrite

S = TransferStatus


def _fused_dones(c):
    """Records (gated, seq) of every fused_done the sender sends."""
    seen, orig = [], c.sender._ctl.send

    def send(ident, frame):
        m = proto.decode(frame)
        if m["k"] == "fused_done":
            seen.append((m["gated"], m["seq"]))
        return orig(ident, frame)

    c.sender._ctl.send = send
    return seen


def _hold_bumps(flag):
    """The flag's bumps count but do not reach the page (a device copy still running); returns
    `release()`, which writes the last number and lets later bumps through."""
    def bump_after(dep=None):
        flag.seq += 1
        return flag.seq

    def release():
        del flag.bump_after  # the class's own bump again
        flag._words[0] = flag.seq

    flag.bump_after = bump_after
    return release


def test_ranks_map_the_senders_page_and_credit_gated_rows(engine, fused_on_host):  # noqa: F811
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        flag = c.sender._flag
        assert flag is not None and flag.route == "host" and os.path.exists(flag.path)
        opened = [r._links[0].flag for r in c.receivers]
        assert [o.name for o in opened] == [flag.name] * 2
        dones = _fused_dones(c)
        for rid, (a, b) in [("x", (0, 23)), ("y", (0, 9))]:
            src, dst = c.tables(b)
            c.expect(rid, dst, b)
            c.sender.send(rid, src, a, b)
            assert c.wait(rid) == [S.SUCCESS] * 3, c.reasons(rid)
            assert c.check_bytes(src, dst, b) == b
        assert dones and all(g for g, _ in dones)
        assert sorted({s for _, s in dones}) == list(range(1, flag.seq + 1))  # one bump per round
        assert flag.value() == flag.seq >= 2
    finally:
        c.close()
    assert not os.path.exists(flag.path) and flag.closed  # the sender unlinked its page
    assert all(o.closed for o in opened)  # each rank unmapped it with its link


def test_ranks_wait_until_the_page_reads_their_number(engine, fused_on_host):  # noqa: F811
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        release = _hold_bumps(c.sender._flag)
        L = 29
        src, dst = c.tables(L)
        c.expect("g", dst, L)
        c.sender.send("g", src, 0, L)
        assert wait_for(lambda: all(r._gated for r in c.receivers))
        assert wait_for(lambda: c.sender.poll("g") is S.SUCCESS)  # the sender's own wait is over
        assert [r.poll("g").terminal for r in c.receivers] == [False, False]  # the page still reads 0
        assert all(r._gated for r in c.receivers)
        release()
        assert c.wait("g") == [S.SUCCESS] * 3, c.reasons("g")
        assert c.check_bytes(src, dst, L) == L
        assert all(not r._gated for r in c.receivers)
    finally:
        c.close()


def test_a_bump_that_fails_tells_the_ranks_after_the_wait(engine, fused_on_host):  # noqa: F811
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        def refuse(dep=None):
            raise RuntimeError("the bump's jit was refused")

        c.sender._flag.bump_after = refuse
        dones = _fused_dones(c)
        src, dst = c.tables(17)
        c.expect("r", dst, 17)
        c.sender.send("r", src, 0, 17)
        assert c.wait("r") == [S.SUCCESS] * 3, c.reasons("r")
        assert dones == [(False, 0), (False, 0)]
        assert c.check_bytes(src, dst, 17) == 17
    finally:
        c.close()


def test_gate_off_offers_no_page_and_tells_after_the_wait(engine, fused_on_host, monkeypatch):  # noqa: F811
    monkeypatch.setattr(_sender_region, "FUSED_FLAG_GATE", False)
    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)
    try:
        assert c.sender._flag is None and c.receivers[0]._links[0].flag is None
        dones = _fused_dones(c)
        src, dst = c.tables(11)
        c.expect("o", dst, 11)
        c.sender.send("o", src, 0, 11)
        assert c.wait("o") == [S.SUCCESS] * 2, c.reasons("o")
        assert dones == [(False, 0)] and c.check_bytes(src, dst, 11) == 11
    finally:
        c.close()


@pytest.mark.parametrize("bad, why", [
    (dict(gated=True), "offered no flag page"),
    (dict(gated=True, seq=1 << 32), "uint32"),
])
def test_a_gated_fused_done_that_cannot_be_honoured_fails(engine, fused_on_host, monkeypatch, bad, why):  # noqa: F811
    if "seq" not in bad:  # a sender that offered no page, yet says gated
        monkeypatch.setattr(_sender_region, "FUSED_FLAG_GATE", False)
    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)
    try:
        rewrite(c.sender._ctl, "send", lambda m: {**m, **bad} if m["k"] == "fused_done" else None)
        src, dst = c.tables(9)
        c.expect("n", dst, 9)
        c.sender.send("n", src, 0, 9)
        assert wait_for(lambda: c.receivers[0].poll("n") is S.FAILED)
        assert why in c.receivers[0].failure_reason("n")
    finally:
        c.close()


def test_hello_ack_flag_is_checked_before_anything_is_opened(tmp_path):
    from bridge.host_flag import SharedFlag

    assert _open_flag({"flag": "", "path": "fused"}) is None
    with SharedFlag.create() as flag:
        opened = _open_flag({"flag": flag.name, "path": "fused"})
        assert opened.value() == 0
        opened.close()
        with pytest.raises(HandshakeError) as e:
            _open_flag({"flag": flag.name, "path": "region"})
        assert e.value.field == "flag" and "region path" in str(e.value)
    for bad in ("../../etc/passwd", "dcp_jax_flag_1_zz", "dcp_jax_flag_1_" + "0" * 16 + "/x"):
        with pytest.raises(HandshakeError, match="dcp_jax_flag_<pid>") as e:
            _open_flag({"flag": bad, "path": "fused"})
        assert e.value.field == "flag"
    with pytest.raises(HandshakeError, match="cannot open") as e:  # gone (another host's /dev/shm)
        _open_flag({"flag": "dcp_jax_flag_1_" + "0" * 16, "path": "fused"})
    assert e.value.field == "flag"


def test_parts_of_a_request_that_ended_are_not_kept_waiting(engine, fused_on_host):  # noqa: F811
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        release = _hold_bumps(c.sender._flag)  # the copy never "ends": the parts would wait forever
        src, dst = c.tables(14)
        c.expect("a", dst, 14)
        c.sender.send("a", src, 0, 14)
        assert wait_for(lambda: all(r._gated for r in c.receivers))
        for r in c.receivers:
            r.abort("a", "the serving loop gave up")
        assert wait_for(lambda: not any(r._gated for r in c.receivers))
        assert [r.poll("a") for r in c.receivers] == [S.ABORTED] * 2
        release()  # a late flag credits nothing
        c.round_trip("b", 6)
    finally:
        c.close()


def test_a_page_that_shrinks_fails_the_gated_request_not_the_rank(engine, fused_on_host):  # noqa: F811
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        _hold_bumps(c.sender._flag)
        src, dst = c.tables(12)
        c.expect("s", dst, 12)
        c.sender.send("s", src, 0, 12)
        assert wait_for(lambda: all(r._gated for r in c.receivers))
        os.truncate(c.sender._flag.path, 0)  # its owner (or root) shrank it: a mapped read would SIGBUS
        assert wait_for(lambda: all(r.poll("s") is S.FAILED for r in c.receivers))
        assert all("flag page" in r.failure_reason("s") and "shrank" in r.failure_reason("s") for r in c.receivers)
        assert not any(r._gated for r in c.receivers)
    finally:
        c.close()


def test_a_lagging_page_stops_the_spin_once_the_oldest_part_waited_long(engine, fused_on_host):  # noqa: F811
    import time

    from dcp_jax.transfer._receiver_region import GATED_SPIN_S

    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)
    try:
        r = c.receivers[0]
        link, now = r._links[0], time.monotonic()
        with r._lock:
            r._gated = [(link, {"seq": 5}, now - 2 * GATED_SPIN_S), (link, {"seq": 6}, now)]
            assert not r._gated_waiting()  # a stream of new parts behind a stale one: back off
            r._gated = [(link, {"seq": 6}, now)]
            assert r._gated_waiting()
            r._gated = []
            assert not r._gated_waiting()
    finally:
        c.close()
