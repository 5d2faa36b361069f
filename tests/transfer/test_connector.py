"""KVSender / KVReceiver end to end with real engines: bytes, sentinels, statuses, stats."""
import time

import numpy as np
import pytest

import bridge
from conftest import Cluster, TransferStatus
from dcp_jax.transfer import KVReceiver

S = TransferStatus


@pytest.mark.parametrize("direction", ["push", "pull"])
@pytest.mark.parametrize("mode", ["packed", "direct"])
def test_chunked_request_lands_byte_exact(engine, direction, mode):
    c = Cluster(engine, dcp_size=3, direction=direction, mode=mode)
    try:
        L = 37  # partial last page, three ranks, token round-robin
        src, dst = c.tables(L)
        c.expect("r0", dst, L)
        for a, b in [(0, 10), (10, 11), (11, L)]:  # chunked prefill, one call per chunk
            c.sender.send("r0", src, a, b)
        assert c.wait("r0") == [S.SUCCESS] * 4, c.reasons("r0")
        assert c.check_bytes(src, dst, L) == L
        for r in range(3):
            assert c.sentinel_pages(r, dst[r])
        st = c.sender.request_stats("r0")
        assert sum(v["rows"] for v in st["ranks"].values()) == L
        assert {v["strategy"] for v in st["ranks"].values()} == {mode}
        assert c.receivers[0].stats["bytes"] == 13 * sum(c.item_lens)  # rank 0 owns 13 of 37
    finally:
        c.close()


def test_prefix_hit_sends_only_the_tail(engine):
    c = Cluster(engine, dcp_size=2, page_size=4, interleave_size=4)
    try:
        L, prefix = 29, 11
        src, dst = c.tables(L)
        c.expect("r", dst, L, prefix_tokens=prefix)
        c.sender.send("r", src, 0, L)
        assert c.wait("r") == [S.SUCCESS] * 3
        c.check_bytes(src, dst, L, prefix_tokens=prefix)
        # The prefix's rows were never written: they still hold the sentinel.
        kv = [np.asarray(c.dst[0][0])]
        assert (kv[0][dst[0][0]] == 0xA5).all()  # tokens 0..3 (rank 0's first block) < prefix
    finally:
        c.close()


def test_rank_with_no_tokens_still_completes(engine):
    c = Cluster(engine, dcp_size=4)
    try:
        src, dst = c.tables(2)  # ranks 2 and 3 own nothing of a 2-token request
        c.expect("tiny", dst, 2)
        c.sender.send("tiny", src, 0, 2)
        assert c.wait("tiny") == [S.SUCCESS] * 5
        c.check_bytes(src, dst, 2)
        assert c.receivers[3].stats["bytes"] == 0
    finally:
        c.close()


def test_jax_arrays_as_caller_kv(engine):
    c = Cluster(engine, dcp_size=2, kind="jax")
    try:
        src, dst = c.tables(21)
        c.expect("j", dst, 21)
        c.sender.send("j", src, 0, 21)
        assert c.wait("j") == [S.SUCCESS] * 3
        assert c.check_bytes(src, dst, 21) == 21  # read back through the caller's JAX arrays
    finally:
        c.close()


def test_many_concurrent_requests_small_arena(engine):
    # The arena holds 3 tokens: windows queue for regions, nothing is overwritten or refused.
    c = Cluster(engine, dcp_size=2, pages=256, mode="packed", pack_bytes=3 * 64)
    try:
        reqs = {}
        for k in range(12):
            L = int(c.rng.integers(1, 30))
            src, dst = c.tables(L)
            reqs[f"q{k}"] = (src, dst, L)
            c.expect(f"q{k}", dst, L)
        for rid, (src, _, L) in reqs.items():
            c.sender.send(rid, src, 0, L)
        for rid, (src, dst, L) in reqs.items():
            assert c.wait(rid) == [S.SUCCESS] * 3, c.sender.failure_reason(rid)
            c.check_bytes(src, dst, L)
        arena = c.sender.stats["arena"]
        assert arena["waits"] > 0 and arena["in_use_bytes"] == 0 and arena["quarantined_bytes"] == 0
    finally:
        c.close()


def test_send_before_expect_and_release_reuse(engine):
    c = Cluster(engine, dcp_size=2)
    try:
        src, dst = c.tables(9)
        c.sender.send("x", src, 0, 9)  # the decode side announces later
        time.sleep(0.05)
        assert c.sender.poll("x") is S.WAITING
        c.expect("x", dst, 9)
        assert c.wait("x") == [S.SUCCESS] * 3
        for side in [c.sender] + c.receivers:
            side.release("x")
        with pytest.raises(KeyError, match="request_id='x'"):
            c.sender.poll("x")
        src2, dst2 = c.tables(5)  # the id again, for a new request
        c.expect("x", dst2, 5)
        c.sender.send("x", src2, 0, 5)
        assert c.wait("x") == [S.SUCCESS] * 3
        c.check_bytes(src2, dst2, 5)
    finally:
        c.close()


def test_close_releases_registrations_and_is_bounded(engine):
    before = bridge.registered_bytes()
    c = Cluster(engine, dcp_size=2)
    assert bridge.registered_bytes() > before
    src, dst = c.tables(8)
    c.expect("open", dst, 8)  # left open on purpose: close must fail it, not hang
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 5 * 3
    assert bridge.registered_bytes() == before
    assert c.receivers[0].poll("open") is S.FAILED


def test_kernel_compiles_constant_after_warm_up(engine):
    c = Cluster(engine, dcp_size=2, mode="packed")
    try:
        def one(rid, L):
            src, dst = c.tables(L)
            c.expect(rid, dst, L)
            c.sender.send(rid, src, 0, L)
            assert c.wait(rid) == [S.SUCCESS] * 3
            for side in [c.sender] + c.receivers:
                side.release(rid)
        one("warm", 8)
        before = c.sender.stats["kernel_compiles"]
        for k in range(10):
            one(f"k{k}", int(c.rng.integers(1, 9)))
        assert c.sender.stats["kernel_compiles"] == before
    finally:
        c.close()


def test_bad_arguments_name_themselves(engine):
    c = Cluster(engine, dcp_size=2)
    try:
        src, dst = c.tables(8)
        with pytest.raises(ValueError, match="start"):
            c.sender.send("b", src, 5, 5)
        with pytest.raises(ValueError, match="page_table"):
            c.sender.send("b", src[:1], 0, 8)  # too few pages for 8 tokens of page 4
        with pytest.raises(ValueError, match="page_table"):
            c.sender.send("b", [10_000, 1], 0, 8)  # outside the cache
        with pytest.raises(TypeError, match="request_id"):
            c.sender.send(7, src, 0, 8)
        with pytest.raises(ValueError, match="prefix_tokens"):
            c.receivers[0].expect("b", dst[0], 8, prefix_tokens=9)
        with pytest.raises(ValueError, match="page_table"):
            c.receivers[0].expect("b", [], 8)
        for bad in (None, "7", 3):  # no sequence at all: a TypeError (it read "must be 1-D, got shape ()")
            with pytest.raises(TypeError, match="page_table must be a sequence"):
                c.receivers[0].expect("b", bad, 8)
            with pytest.raises(TypeError, match="page_table must be a sequence"):
                c.sender.send("b", bad, 0, 8)
        c.sender.send("b", src, 0, 4)
        with pytest.raises(ValueError, match="overlap"):
            c.sender.send("b", src, 3, 8)
        with pytest.raises(ValueError, match="address"):
            c.receivers[0].connect("localhost:1")
        with pytest.raises(ValueError, match="already connected"):
            c.receivers[0].connect(c.sender.address)
        with pytest.raises(RuntimeError, match="connect"):
            spec = c.receivers[0].spec
            lonely = KVReceiver(spec, [np.zeros((4, 4, il), np.uint8) for il in c.item_lens], engine=engine)
            try:
                lonely.expect("z", [0], 1)
            finally:
                lonely.close()
    finally:
        c.close()


def test_layers_viewing_one_buffer_register_once_and_release(engine):
    # Two layer entries over the same buffer (vLLM's K/V views of one tensor do this): the
    # connector registers the union once (the engines refuse overlapping registrations), and
    # nothing stays registered after close.
    from dcp_jax.transfer import KVCacheSpec, KVSender

    before = bridge.registered_bytes()
    layer = np.zeros((4, 4, 16), np.uint8)
    s = KVSender(KVCacheSpec(2, (16, 16), 4), [layer, layer], engine=engine)
    try:
        # The layers' union plus the sender's own pack buffer.
        assert bridge.registered_bytes() - before >= layer.nbytes
    finally:
        s.close()
    # A receiver's entries must start at distinct addresses (one address twice would land two
    # layers on the same bytes): views of one buffer one page apart, overlapping.
    buf = np.zeros((5, 4, 16), np.uint8)
    r = KVReceiver(KVCacheSpec(2, (16, 16), 4), [buf[:4], buf[1:]], engine=engine)
    try:
        assert bridge.registered_bytes() - before == buf.nbytes
    finally:
        r.close()
    assert bridge.registered_bytes() == before


def test_bad_caller_kv_is_refused_by_name():
    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender

    spec = KVCacheSpec(2, (16, 16), 4)
    ok = np.zeros((4, 4, 16), np.uint8)
    with pytest.raises(ValueError, match="kv_layers has 1 layers"):
        KVSender(spec, [ok])
    with pytest.raises(ValueError, match=r"kv_layers\[1\].*page_size=4"):
        KVSender(spec, [ok, np.zeros((4, 8, 8), np.uint8)])
    with pytest.raises(ValueError, match=r"kv_layers\[1\] holds 32 bytes per token"):
        KVSender(spec, [ok, np.zeros((4, 4, 16), np.uint16)])
    with pytest.raises(ValueError, match=r"kv_layers\[0\] must be C-contiguous"):
        KVSender(spec, [np.zeros((4, 4, 32), np.uint8)[:, :, ::2], ok])
    with pytest.raises(TypeError, match="kv_layers must be a list"):
        KVSender(spec, ok)
    with pytest.raises(TypeError, match=r"kv_layers\[1\]: KV layers must be numpy, CuPy or JAX arrays, got list"):
        KVSender(spec, [ok, ok.tolist()])
    # A big-endian float16 layer is named "float16" too: its numbers would arrive as others.
    f16 = KVCacheSpec(2, (16, 16), 4, dtype="float16")
    half = np.zeros((4, 4, 8), np.float16)
    with pytest.raises(TypeError, match=r"kv_layers\[0\] has dtype '>f2', not in this machine's byte order"):
        KVSender(f16, [half.astype(">f2"), half])
    with pytest.raises(TypeError, match=r"kv_layers\[1\] has dtype '>f2'"):
        KVReceiver(f16, [half, half.astype(">f2")])
    # An integer container is bytes, whatever its byte order (spec section 10: "any dtype").
    KVReceiver(f16, [half, np.zeros((4, 4, 8), ">u2")]).close()
    KVReceiver(f16, [half, np.zeros((4, 4, 16), np.uint8)]).close()
    with pytest.raises(ValueError, match="mode"):
        KVSender(spec, [ok, ok.copy()], mode="fast")
    with pytest.raises(ValueError, match="pack_bytes"):
        KVSender(spec, [ok, ok.copy()], pack_bytes=8)
    for huge in (2**62 + 1, 2**63, 2**70):  # past any allocator's C size: named, not an OverflowError
        with pytest.raises(ValueError, match=rf"pack_bytes={huge} must be an int >= one token's .* <= 2\*\*62"):
            KVSender(spec, [ok, ok.copy()], pack_bytes=huge)


def test_full_prefix_hit_and_empty_request_succeed_at_once(engine):
    c = Cluster(engine, dcp_size=2)
    try:
        src, dst = c.tables(8)
        c.expect("hit", dst, 8, prefix_tokens=8)  # every rank already holds all 8 tokens
        assert [r.poll("hit") for r in c.receivers] == [S.SUCCESS, S.SUCCESS]
        c.sender.send("hit", src, 0, 8)  # the prefill still sends: nothing to do, no error
        assert c.wait("hit") == [S.SUCCESS] * 3
        for r in c.receivers:
            r.expect("none", [], 0)
        assert [r.poll("none") for r in c.receivers] == [S.SUCCESS, S.SUCCESS]
    finally:
        c.close()


def test_each_chunk_keeps_the_page_table_it_was_sent_with(engine):
    c = Cluster(engine, dcp_size=1)
    try:
        src, dst = c.tables(16)
        c.expect("t", dst, 16)
        c.sender.send("t", src, 0, 8)  # tokens 0..7 on src[0], src[1]
        other = np.array([c._free_src.pop(), c._free_src.pop(), src[2], src[3]])  # differs in front
        c.sender.send("t", other, 8, 16)
        assert c.wait("t") == [S.SUCCESS] * 2
        c.check_bytes(np.array([src[0], src[1], src[2], src[3]]), dst, 16)
    finally:
        c.close()


def test_closed_sides_refuse_calls_and_duplicate_links_are_refused(engine):
    from dcp_jax.transfer import HandshakeError

    c = Cluster(engine, dcp_size=1)
    try:
        alias = c.sender.address.replace("127.0.0.1", "localhost")
        with pytest.raises(HandshakeError, match="already connected"):
            c.receivers[0].connect(alias)  # the same sender under another spelling
        with pytest.raises(ValueError, match="read-only"):
            ro = np.frombuffer(bytes(4 * 4 * 48), np.uint8).reshape(4, 4, 48)
            KVReceiver(c.receivers[0].spec, [ro, np.zeros((4, 4, 16), np.uint8)], engine=engine)
        # A broadcast view is both strided and read-only: the error names both.
        with pytest.raises(ValueError, match=r"kv_layers\[0\] must be C-contiguous and writeable"):
            bc = np.broadcast_to(np.zeros((1, 4, 48), np.uint8), (4, 4, 48))
            KVReceiver(c.receivers[0].spec, [bc, np.zeros((4, 4, 16), np.uint8)], engine=engine)
        src, dst = c.tables(4)
        c.close()
        with pytest.raises(RuntimeError, match="closed"):
            c.sender.send("late", src, 0, 4)
        with pytest.raises(RuntimeError, match="closed"):
            c.receivers[0].expect("late", dst[0], 4)
        with pytest.raises(RuntimeError, match="closed"):
            c.receivers[0].connect(c.sender.address)
        # close is idempotent, but its argument is still checked (it was ignored once closed)
        for side in (c.sender, c.receivers[0]):
            for bad in (-1, 0, float("nan")):
                with pytest.raises(ValueError, match="timeout_s"):
                    side.close(timeout_s=bad)
            side.close(timeout_s=1.0)
    finally:
        c.close()


def test_spec_refuses_unknown_dtype_names():
    from dcp_jax.transfer import KVCacheSpec

    for name in ("bfloat16", "float8_e4m3fn", "float16", "float32", "uint8"):
        assert KVCacheSpec(1, [8], 4, dtype=name).dtype == name
    for name in ("float99", "f4", "fp8", "object"):
        with pytest.raises(ValueError, match=f"dtype='{name}'"):
            KVCacheSpec(1, [8], 4, dtype=name)
    with pytest.raises(ValueError, match="dtype='float99'"):  # a peer's spec too, before the handshake
        KVCacheSpec.from_dict(dict(KVCacheSpec(1, [8], 4).to_dict(), dtype="float99"))


def test_spec_takes_item_lens_as_bytes_whatever_the_dtype():
    # The DCP spec (section 10): "any dtype; bytes are what move": callers outside the project
    # build specs with odd byte lengths under the default dtype.
    from dcp_jax.transfer import KVCacheSpec

    assert KVCacheSpec(2, [1152, 7], 4).item_lens == (1152, 7)
    assert KVCacheSpec(1, [6], 4, dtype="float32").row_bytes == 6


def test_spec_refuses_unordered_item_lens_and_huge_pages():
    # Before: a set was taken in its hash order, and page_size=2**62 was accepted (byte offsets of
    # page x row overflow int64 long before).
    from dcp_jax.transfer import KVCacheSpec

    for bad in ({8, 16}, frozenset({8}), {0: 8}):
        with pytest.raises(TypeError, match="item_lens must be a sequence"):
            KVCacheSpec(len(bad), bad, 4)
    assert KVCacheSpec(1, [8], 1 << 20).page_size == 1 << 20
    with pytest.raises(ValueError, match="page_size=.* must be <= 1048576"):
        KVCacheSpec(1, [8], (1 << 20) + 1)


def test_spec_takes_dtype_objects_as_their_names():
    # A serving stack holds its cache dtype as an object, not a string: numpy, ml_dtypes (JAX)
    # and torch dtypes become the canonical name the handshake compares.
    import jax.numpy as jnp

    from dcp_jax.transfer import KVCacheSpec, check_compatible

    assert KVCacheSpec(1, [8], 4, dtype=np.float16).dtype == "float16"
    assert KVCacheSpec(1, [8], 4, dtype=np.dtype("float32")).dtype == "float32"
    a, b = KVCacheSpec(1, [8], 4, dtype=jnp.bfloat16), KVCacheSpec(1, [8], 4, dtype="bfloat16")
    assert a.dtype == "bfloat16" and a == b
    check_compatible(a, b)  # one element type, however it was spelled
    torch = pytest.importorskip("torch")
    assert KVCacheSpec(1, [8], 4, dtype=torch.float8_e4m3fn).dtype == "float8_e4m3fn"
    with pytest.raises(TypeError, match="dtype"):
        KVCacheSpec(1, [8], 4, dtype=object())
    with pytest.raises(TypeError, match="dtype"):
        KVCacheSpec(1, [8], 4, dtype=None)
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec(1, [8], 4, dtype="f4")  # names are canonical: "float32"
    other = ">f2" if np.little_endian else "<f2"
    with pytest.raises(ValueError, match="byte order"):  # it would have read as plain "float16"
        KVCacheSpec(1, [8], 4, dtype=np.dtype(other))


def test_handshake_refusal_without_two_values_reads_as_a_reason():
    from dcp_jax.transfer import HandshakeError

    e = HandshakeError("path", None, None, "the fused path cannot be served: no IPC handles")
    assert str(e) == "handshake refused (path): the fused path cannot be served: no IPC handles"
    assert "differs (this side 2, peer 3)" in str(HandshakeError("num_layers", 2, 3))


def test_pings_must_fit_twice_into_each_sides_peer_timeout(engine):
    from dcp_jax.transfer import HandshakeError, KVCacheSpec, KVSender

    layers = [np.zeros((4, 4, 16), np.uint8)]
    with pytest.raises(ValueError, match="heartbeat_s=10 must be <= peer_timeout_s / 2"):
        KVSender(KVCacheSpec(1, [16], 4), layers, engine=engine, heartbeat_s=10, peer_timeout_s=5)
    c = Cluster(engine, dcp_size=1, item_lens=(16,), peer_timeout_s=5.0, heartbeat_s=2.0, connect=False)
    try:  # the sender's 2 s pings would not keep a receiver with a 3 s limit: refused at connect
        spec = c.receivers[0].spec
        r = KVReceiver(spec, [np.zeros((8, 4, 16), np.uint8)], engine=engine, peer_timeout_s=3.0)
        try:
            with pytest.raises(HandshakeError, match=r"peer_timeout_s=3 must be >= 2 x that"):
                r.connect(c.sender.address)
        finally:
            r.close()
        c.receivers[0].connect(c.sender.address)  # 5 s: served
    finally:
        c.close()


@pytest.mark.parametrize("port, exc, match", [(-1, ValueError, r"port=-1 must be an int in \[0, 65535\]"),
                                              (70000, ValueError, r"port=70000 must be an int in \[0, 65535\]"),
                                              (1.5, TypeError, r"port must be an int, got float \(port=1.5\)"),
                                              (True, TypeError, r"port must be an int, got bool \(port=True\)")])
def test_sender_port_out_of_range_is_refused(port, exc, match):
    from dcp_jax.transfer import KVCacheSpec, KVSender

    with pytest.raises(exc, match=match):
        KVSender(KVCacheSpec(1, [16], 4), [np.zeros((4, 4, 16), np.uint8)], engine="nixl", port=port)


def test_stalled_request_says_which_ranks_never_announced_it(engine):
    c = Cluster(engine, dcp_size=2, timeout_s=1.0)
    try:
        src, dst = c.tables(8)
        c.sender.send("nobody", src, 0, 8)  # no rank expects it
        c.receivers[0].expect("half", dst[0], 8)  # rank 1 never does
        c.sender.send("half", src, 0, 8)
        deadline = time.monotonic() + 10
        while not (c.sender.poll("nobody").terminal and c.sender.poll("half").terminal) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.sender.poll("nobody") is TransferStatus.FAILED
        assert "no decode rank announced this request" in c.sender.failure_reason("nobody")
        assert c.sender.poll("half") is TransferStatus.FAILED
        assert "decode rank(s) [1]" in c.sender.failure_reason("half")
    finally:
        c.close()


def test_two_held_requests_may_not_write_one_page(engine):
    c = Cluster(engine, dcp_size=1)
    try:
        r = c.receivers[0]
        r.expect("p1", [8, 9], 8)  # page size 4: pages 8 and 9 are written
        with pytest.raises(ValueError, match=r"page_table: page 9 is written by request 'p1'"):
            r.expect("p2", [9, 10], 8)
        r.expect("p3", [8, 11], 8, prefix_tokens=4)  # page 8 holds only its prefix: shared, fine
        r.release("p1")  # live: its pages are held until the sender says it writes none
        deadline = time.monotonic() + 10
        while True:
            try:
                r.expect("p2", [9, 10], 8)  # free again once drained
                break
            except ValueError as exc:
                assert "released, not drained yet" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.01)
    finally:
        c.close()
