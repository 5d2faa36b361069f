"""The fused path's control flow on the CPU: everything but the CUDA IPC mapping is the real code.

On a GPU the receiver exports IPC handles of its layers, the sender maps them and one
`copy_rows` kernel writes the rank's rows into the mapped pages, then ``fused_done`` crosses the
control plane. Here the only stand-in is the mapping itself: the "handles" name a receiver of
this process and the "mapping" is that receiver's own writable row views, so `copy_rows` (its
host form), the ``fused_done`` checks and crediting, the counters and the endings all run as on
the GPU, through real engines' control planes (the engine moves no byte on this path).
"""
import numpy as np
import pytest

import conftest
from conftest import TransferStatus
from dcp_jax.transfer import _sender_handshake
from dcp_jax.transfer import receiver as receiver_mod
from test_region import cluster, wait_for

S = TransferStatus


class _HostMapping:
    """What `bridge.cuda_ipc.IpcMapping` gives the sender: ``.arrays`` and ``close``."""

    def __init__(self, arrays):
        self.arrays, self.closed = list(arrays), False

    def close(self):
        self.closed = True


@pytest.fixture
def fused_on_host(monkeypatch):
    layers_of = {}

    def export(layers):  # the receiver's "handles": a key naming its row views
        layers_of[len(layers_of)] = layers.rows
        return [{"host_mapping": len(layers_of) - 1}]

    def open_(handles, item_lens):
        (h,) = handles
        return _HostMapping(layers_of[h["host_mapping"]])

    real = _sender_handshake.choose_path
    monkeypatch.setattr(receiver_mod, "ipc_export", export)
    monkeypatch.setattr(_sender_handshake, "ipc_open", open_)
    monkeypatch.setattr(_sender_handshake, "choose_path",
                        lambda mode, **kw: "fused" if mode == "fused" else real(mode, **kw))
    return layers_of


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_fused_path_lands_byte_exact_with_no_descriptor(engine, fused_on_host, direction):
    c = cluster(engine, dcp_size=3, mode="fused", direction=direction, region_bytes=0)
    try:
        L = 37
        src, dst = c.tables(L)
        c.expect("f", dst, L)
        for a, b in [(0, 10), (10, 11), (11, L)]:
            c.sender.send("f", src, a, b)
        assert c.wait("f") == [S.SUCCESS] * 4, c.reasons("f")
        assert c.check_bytes(src, dst, L) == L
        assert all(c.sentinel_pages(r, dst[r]) for r in range(3))
        st = c.sender.request_stats("f")
        assert [v["path"] for v in st["ranks"].values()] == ["fused"] * 3
        assert all(v["descriptors"] == 0 and v["batches"] == 0 for v in st["ranks"].values())
        assert sum(v["bytes"] for v in st["ranks"].values()) == L * sum(c.item_lens)
        assert st["copy_seconds"] > 0 and c.sender.stats["descriptors"] == 0
        for recv in c.receivers:
            rs = recv.request_stats("f")
            assert rs["paths"] == ["fused"] and rs["unpacks"] == 0
    finally:
        c.close()


def test_fused_mapping_is_closed_with_the_connection(engine, fused_on_host):
    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)
    try:
        (conn,) = c.sender._conns.values()
        mapping = conn.mapping
        assert isinstance(mapping, _HostMapping) and not mapping.closed
    finally:
        c.close()
    assert mapping.closed


def test_fused_page_table_past_the_mapped_rows_fails_before_any_write(engine, fused_on_host, monkeypatch):
    # The sender checks the rank's rows against what it mapped (no engine checks these addresses).
    whole = _sender_handshake.ipc_open
    monkeypatch.setattr(_sender_handshake, "ipc_open",  # the rank "exported" 4 pages of its 8
                        lambda handles, item_lens: _HostMapping([a[:16] for a in whole(handles, item_lens).arrays]))
    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0, pages=8)
    try:
        src, dst = c.tables(8)
        dst[0] = np.array([6, 7], np.int64)  # pages the mapping does not hold
        c.expect("x", dst, 8)
        c.sender.send("x", src, 0, 8)
        assert c.wait("x") == [S.FAILED, S.FAILED]
        assert "mapped layers hold 16 rows" in c.sender.failure_reason("x")
        assert all((np.asarray(a) == conftest.SENTINEL).all() for a in c.dst[0])
        assert wait_for(lambda: c.receivers[0].is_drained("x") and c.sender.is_drained("x"))
    finally:
        c.close()


def test_duplicate_fused_done_is_credited_once(engine, fused_on_host):
    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)
    try:
        orig = c.sender._ctl.send

        def twice(ident, frame):
            from dcp_jax.transfer import protocol as proto

            if proto.decode(frame)["k"] == "fused_done":
                orig(ident, frame)
            return orig(ident, frame)

        c.sender._ctl.send = twice
        src, dst = c.tables(20)
        c.expect("d", dst, 20)
        c.sender.send("d", src, 0, 20)
        assert c.wait("d") == [S.SUCCESS, S.SUCCESS], c.reasons("d")
        c.check_bytes(src, dst, 20)
        assert wait_for(lambda: c.receivers[0].stats["dropped_messages"] >= 1)
        assert c.receivers[0].request_stats("d")["bytes"] == 20 * sum(c.item_lens)
    finally:
        c.close()


def test_warm_up_on_host_kv_compiles_nothing_and_checks_its_argument(engine, fused_on_host):
    """`KVSender.warm_up` after the ranks connected: host KV packs with numpy and its fused
    copiers copy one by one, so no bucket compiles; the copier was made at the handshake."""
    from pallas_kernels import compile_count

    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        assert all(conn.copier is not None for conn in c.sender._conns.values())
        count = compile_count()
        assert c.sender.warm_up() == {"pack": [], "fused": []}
        assert c.sender.warm_up(max_rows=64) == {"pack": [], "fused": []}
        assert compile_count() == count
        for bad in (0, -3):
            with pytest.raises(ValueError, match="max_rows"):
                c.sender.warm_up(bad)
        for bad in (True, 1.0, "64"):
            with pytest.raises(TypeError, match="max_rows"):
                c.sender.warm_up(bad)
        src, dst = c.tables(21)  # and the links still serve, one rank's window at a time too
        c.expect("w", dst, 21)
        c.sender.send("w", src, 0, 1)  # tokens of rank 0 only: rank 1 has no window this round
        c.sender.send("w", src, 1, 21)
        assert c.wait("w") == [S.SUCCESS] * 3, c.reasons("w")
        assert c.check_bytes(src, dst, 21) == 21
    finally:
        c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.sender.warm_up()


def test_a_window_launched_before_its_post_fails_is_waited_for_then_drained(engine, fused_on_host):
    """The round launches its fused copies before the per-window bookkeeping (`_launch_fused`),
    so a window's post can fail after its copy was enqueued (here rank 1's message head): its
    request FAILS naming the error, the launched window still counts in flight until the round's
    wait, then both sides drain; the other request of the round succeeds byte-exact, and the
    round leaves nothing queued."""
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        real = c.sender._window_head

        def head(u):
            if u.req.rid == "bad" and u.target.conn.spec.dcp_rank == 1:
                raise RuntimeError("head refused")
            return real(u)

        c.sender._window_head = head
        src, dst = c.tables(24)
        for rid in ("bad", "good"):
            c.expect(rid, dst if rid == "good" else c.tables(24)[1], 24)
        with c.sender._lock:  # both requests' windows in one round
            c.sender.send("bad", src, 0, 24)
            c.sender.send("good", src, 0, 24)
        assert c.wait("good") == [S.SUCCESS] * 3, c.reasons("good")
        assert c.check_bytes(src, dst, 24) == 24
        assert c.wait("bad")[0] is S.FAILED and "head refused" in c.sender.failure_reason("bad")
        assert wait_for(lambda: c.sender.is_drained("bad") and all(r.is_drained("bad") for r in c.receivers))
        assert c.sender._fused == [] and c.sender._fused_launched == ({}, [])
    finally:
        c.close()
