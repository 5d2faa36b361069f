"""Region and fused paths against a peer that lies: every claim is checked before memory is
touched. A hostile side is a real connector whose outgoing control frames are rewritten on the
way out (real engines, real sockets); the honest side must refuse, write nothing, and hold no
range of its receive region afterwards. Plus the IPC handle checks that need no GPU."""
import time

import pytest

from conftest import SENTINEL, TransferStatus
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._region import ipc_open
from test_region import cluster, region_free, wait_for

S = TransferStatus
ROW = 48 + 16


def rewrite(obj, attr, fn):
    """Wraps ``obj.<attr>`` (a control-plane ``send``) so every frame passes through ``fn(msg)``,
    which returns the message to send instead (a dict) or None to send it unchanged."""
    orig = getattr(obj, attr)

    def send(*args):
        *head, frame = args
        msg = fn(proto.decode(frame))
        return orig(*head, frame if msg is None else proto.encode(**_fields(msg)))

    setattr(obj, attr, send)


def _fields(msg):
    m = dict(msg)
    m.pop("v")
    return {"kind": m.pop("k"), **m}


def all_sentinel(c, r):
    import numpy as np

    return all((np.asarray(a) == SENTINEL).all() for a in c.dst[r])


def run(c, L=24):
    src, dst = c.tables(L)
    c.expect("h", dst, L)
    c.sender.send("h", src, 0, L)
    return c.wait("h", timeout_s=10)


def test_grant_outside_the_declared_region_is_refused_by_the_sender(engine):
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=8 * ROW)
    try:
        link = c.receivers[0]._links[0]
        # The rank grants a range past the end of the region it declared at the handshake.
        rewrite(link.client, "send", lambda m: {**m, "offset": 8 * ROW} if m["k"] == "region_grant" else None)
        assert run(c) == [S.FAILED, S.FAILED]
        assert "inside the" in c.sender.failure_reason("h") and "receive region" in c.sender.failure_reason("h")
        assert c.sender.stats["bytes"] == 0 and all_sentinel(c, 0)
        assert wait_for(lambda: region_free(c.receivers[0]) and c.receivers[0].is_drained("h"))
    finally:
        c.close()


def test_grant_of_the_wrong_size_is_refused_by_the_sender(engine):
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=8 * ROW)
    try:
        link = c.receivers[0]._links[0]
        rewrite(link.client, "send", lambda m: {**m, "nbytes": m["nbytes"] + ROW} if m["k"] == "region_grant" else None)
        assert run(c) == [S.FAILED, S.FAILED]
        assert "region_grant" in c.sender.failure_reason("h")
        assert all_sentinel(c, 0)
    finally:
        c.close()


@pytest.mark.parametrize("lie", ["nbytes", "lo", "stop"])
def test_window_announcement_that_does_not_fit_is_refused_by_the_rank(engine, lie):
    c = cluster(engine, dcp_size=2, mode="region", region_bytes=4 * ROW)
    try:
        def hostile(m):
            if m["k"] != "region_ask" or m["rid"] != "h":
                return None
            if lie == "nbytes":  # a size other than the rows make
                return {**m, "nbytes": m["nbytes"] + ROW}
            if lie == "lo":  # rows past the rank's rows of that chunk
                return {**m, "lo": m["lo"] + 100}
            return {**m, "stop": m["stop"] + 1000}  # past the request's tokens

        rewrite(c.sender._ctl, "send", hostile)
        st = run(c)
        assert S.FAILED in st[1:], c.reasons("h")
        reasons = [r.failure_reason("h") for r in c.receivers]
        assert any("inconsistent" in x for x in reasons), reasons
        assert all(all_sentinel(c, r) for r in range(2))
        assert sum(r.stats["inconsistent_messages"] for r in c.receivers) >= 1
        assert all(r.stats["worker_errors"] == 0 for r in c.receivers)
        for recv in c.receivers:
            assert wait_for(lambda: region_free(recv)), recv.stats
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["region", "packed"])
@pytest.mark.parametrize("lie", ["stop", "lo"])
def test_pull_announcement_that_does_not_fit_is_refused_by_the_rank(engine, mode, lie):
    c = cluster(engine, dcp_size=2, mode=mode, direction="pull", region_bytes=4 * ROW)
    try:
        def hostile(m):
            if m["k"] != "pull_ready" or not m["nrows"]:
                return None
            return {**m, "stop": m["stop"] + 1000} if lie == "stop" else {**m, "lo": m["lo"] + 100}

        rewrite(c.sender._ctl, "send", hostile)
        st = run(c)
        assert S.FAILED in st[1:], c.reasons("h")
        assert any("inconsistent" in r.failure_reason("h") for r in c.receivers), c.reasons("h")
        assert all(all_sentinel(c, r) for r in range(2))
        assert all(r.stats["worker_errors"] == 0 for r in c.receivers)
        for recv in c.receivers:
            assert wait_for(lambda: region_free(recv) and recv.is_drained("h")), recv.stats
    finally:
        c.close()


def test_fused_done_on_a_region_connection_credits_nothing(engine):
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=8 * ROW)
    try:
        def hostile(m):  # claim the rows were written by a kernel instead of asking for room
            if m["k"] != "region_ask":
                return None
            return {k: m[k] for k in ("v", "k", "rid", "inc", "chunk", "part", "nparts", "start", "stop",
                                      "nrows")} | {"k": "fused_done", "gated": False, "seq": 0}

        rewrite(c.sender._ctl, "send", hostile)
        st = run(c)
        assert st[1] is S.FAILED and "fused_done on a region connection" in c.receivers[0].failure_reason("h")
        assert all_sentinel(c, 0)
    finally:
        c.close()


def test_duplicate_ask_gets_one_range(engine):
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=64 * ROW)
    try:
        orig = c.sender._ctl.send

        def twice(ident, frame):
            if proto.decode(frame)["k"] == "region_ask":
                orig(ident, frame)
            return orig(ident, frame)

        c.sender._ctl.send = twice
        assert run(c) == [S.SUCCESS, S.SUCCESS], c.reasons("h")
        time.sleep(0.1)
        assert c.receivers[0].stats["dropped_messages"] >= 1
        assert wait_for(lambda: region_free(c.receivers[0])), c.receivers[0].stats
    finally:
        c.close()


def test_late_duplicate_ask_gets_no_range(engine):
    # The first window's ask is replayed (through the sender's own control socket, from its
    # worker) after that window landed and was credited, while the request still waits for
    # its second chunk; then again after SUCCESS. Neither replay may take a range: the sender
    # drops a grant for a window it no longer has, and after SUCCESS no ``drained`` frees it.
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=64 * ROW, heartbeat_s=0.02)
    recv = c.receivers[0]
    asks, replay = [], []
    orig = c.sender._ctl.send

    def send(ident, frame):
        while replay:  # on the worker thread (its pings come every heartbeat_s): the socket is not shared
            orig(*replay.pop())
        if proto.decode(frame)["k"] == "region_ask":
            asks.append((ident, frame))
        return orig(ident, frame)

    def replay_first_ask():
        dropped = recv.stats["dropped_messages"]
        replay.append(asks[0])
        assert wait_for(lambda: not replay and recv.stats["dropped_messages"] > dropped), recv.stats

    c.sender._ctl.send = send
    try:
        L = 24
        src, dst = c.tables(L)
        c.expect("d", dst, L)
        c.sender.send("d", src, 0, 12)
        assert wait_for(lambda: recv.request_stats("d")["unpacks"] == 1), c.reasons("d")
        replay_first_ask()
        assert recv.stats["region_grants"] == 0 and recv.poll("d") is S.TRANSFERRING
        c.sender.send("d", src, 12, L)
        assert c.wait("d") == [S.SUCCESS, S.SUCCESS], c.reasons("d")
        assert c.check_bytes(src, dst, L) == L
        replay_first_ask()
        recv.release("d")
        assert wait_for(lambda: region_free(recv)), recv.stats
        assert recv.stats["region"]["in_use_bytes"] == 0 and recv.stats["region_grants"] == 0
        # The whole region serves the next request.
        src2, dst2 = c.tables(L)
        c.expect("e", dst2, L)
        c.sender.send("e", src2, 0, L)
        assert c.wait("e") == [S.SUCCESS, S.SUCCESS], c.reasons("e")
        assert c.check_bytes(src2, dst2, L) == L
        assert wait_for(lambda: region_free(recv)), recv.stats
    finally:
        c.close()


def _handle(**kw):
    d = {"v": 1, "handle": b"\x00" * 64, "device_id": 0, "base": 1 << 20, "alloc_size": 4096, "offset": 0,
         "nbytes": 4096, "pid": 1, "host": {"hostname": "h", "boot_id": "b"}}
    d.update(kw)
    return d


@pytest.mark.parametrize("bad, match", [
    ([_handle()], "2 layer entries"),                                     # one handle for two entries
    ([_handle(), _handle(nbytes=100, alloc_size=4096)], "whole rows"),    # 100 B is not rows of 16
    ([_handle(), _handle(handle=b"x")], "64 bytes"),
    ([_handle(), _handle(offset=4000)], "exceeds"),
    ([_handle(), {**_handle(), "extra": 1}], "keys"),
    ([_handle(), "not a dict"], "dict"),
])
def test_ipc_handles_are_checked_before_anything_opens(bad, match):
    with pytest.raises(ValueError, match=match):
        ipc_open(bad, [32, 16])
