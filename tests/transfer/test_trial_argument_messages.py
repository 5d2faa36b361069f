"""Argument messages a fresh-user trial found wrong (2027): two different custom layout labels
reported as an unknown layout, a float token count refused with ValueError, "1 are required",
and the same rules at the other int arguments of the connector (one helper per rule)."""
import numpy as np
import pytest

from conftest import Cluster
from dcp_jax.transfer import HandshakeError, KVCacheSpec, KVReceiver, KVSender, check_compatible
from dcp_jax.transfer._worker import check_page_table, check_tokens

ITEMS = (48, 16)


def _spec(layout, **kw):
    return KVCacheSpec(2, ITEMS, 4, layout=layout, **kw)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_two_different_custom_labels_say_the_labels_differ(side):
    # Before: "layout must be one of ('sglang_mla', ...), got layout='foo'" (the views' list).
    with pytest.raises(HandshakeError, match="layout labels differ") as e:
        check_compatible(_spec("foo"), _spec("bar"), side=side)
    ours, theirs = ("foo", "bar") if side == "prefill" else ("bar", "foo")
    assert (e.value.field, e.value.ours, e.value.theirs) == ("layout", ours, theirs)
    assert "this side 'foo', peer 'bar'" in str(e.value) if side == "prefill" else \
        "this side 'bar', peer 'foo'" in str(e.value)
    assert "must be one of" not in str(e.value)


def test_custom_label_against_a_known_layout_names_both_and_the_known_ones():
    with pytest.raises(HandshakeError, match=r"layout labels differ.*'vllm-cpu' is not a layout") as e:
        check_compatible(_spec("vllm-cpu"), _spec("mla"))
    assert (e.value.ours, e.value.theirs) == ("vllm-cpu", "mla") and "'tpu_gqa'" in str(e.value)


def test_equal_custom_labels_pass_and_an_unknown_label_with_tp_keeps_its_message():
    check_compatible(_spec("foo"), _spec("foo"))  # whole rows between equal labels: allowed
    # tp_size > 1 needs the views, which know only their layouts: the unknown label is named.
    with pytest.raises(HandshakeError, match=r"layout must be one of .*got layout='foo'"):
        check_compatible(_spec("foo", tp_size=2), _spec("foo", tp_size=2))


def test_different_custom_labels_are_refused_at_the_connect():
    src = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    dst = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with KVSender(_spec("foo"), src, engine="nixl") as s, KVReceiver(_spec("bar"), dst, engine="nixl") as r:
        with pytest.raises(HandshakeError, match="layout labels differ") as e:
            r.connect(s.address)
        assert (e.value.ours, e.value.theirs) == ("bar", "foo")


@pytest.mark.parametrize("value", [8.0, "8", None, True])
def test_check_tokens_refuses_non_ints_with_type_error(value):
    with pytest.raises(TypeError, match=rf"num_tokens must be an int, got {type(value).__name__} "
                                        rf"\(num_tokens={value!r}\)"):
        check_tokens("num_tokens", value)
    assert check_tokens("num_tokens", np.int32(8)) == 8
    with pytest.raises(ValueError, match=r"num_tokens=-1 must be an int in \[0, 2\*\*62\]"):
        check_tokens("num_tokens", -1)


def test_expect_and_send_refuse_float_token_counts_with_type_error():
    # Before: ValueError "num_tokens=8.0 must be an int >= 0 (tokens)".
    c = Cluster("nixl", dcp_size=1, page_size=4, seed=3)
    try:
        src, dst = c.tables(8)
        r = c.receivers[0]
        with pytest.raises(TypeError, match=r"num_tokens must be an int, got float \(num_tokens=8\.0\)"):
            r.expect("q", dst[0], num_tokens=8.0)
        with pytest.raises(TypeError, match=r"prefix_tokens must be an int, got float \(prefix_tokens=4\.0\)"):
            r.expect("q", dst[0], 8, prefix_tokens=4.0)
        with pytest.raises(TypeError, match=r"stop must be an int, got float \(stop=8\.0\)"):
            c.sender.send("q", src, 0, 8.0)
    finally:
        c.close()


def test_region_bytes_and_port_refuse_floats_with_type_error():
    dst = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with pytest.raises(TypeError, match=r"region_bytes must be an int, got float \(region_bytes=4096\.0\)"):
        KVReceiver(KVCacheSpec(2, ITEMS, 4), dst, engine="nixl", region_bytes=4096.0)
    with pytest.raises(ValueError, match=r"region_bytes=-1 must be None or an int in \[0, 2\*\*62\]"):
        KVReceiver(KVCacheSpec(2, ITEMS, 4), dst, engine="nixl", region_bytes=-1)
    with pytest.raises(TypeError, match=r"port must be an int, got float \(port=5555\.0\)"):
        KVSender(KVCacheSpec(2, ITEMS, 4), [a.copy() for a in dst], engine="nixl", port=5555.0)


def test_too_short_page_table_says_1_page_is_required():
    # Before: "page_table has 0 pages; 1 are required for 3 local rows of page_size=4".
    for table, rows, page_size, want in (
            ([], 3, 4, "page_table has 0 pages; 1 page is required for 3 local rows of page_size=4"),
            ([], 1, 1, "page_table has 0 pages; 1 page is required for 1 local row of page_size=1"),
            ([0], 2, 1, "page_table has 1 page; 2 pages are required for 2 local rows of page_size=1")):
        with pytest.raises(ValueError) as e:
            check_page_table(table, rows, page_size, 16)
        assert str(e.value) == want


def test_a_bad_page_id_is_named_by_its_index():
    # Before: "page_table holds page ids outside [0, 16) (min -1, max 7)": which entry?
    with pytest.raises(ValueError, match=r"^page_table\[2\]=-1 is outside \[0, 16\) \(the cache's pages; min -1, max 7\)$"):
        check_page_table([7, 3, -1, 5], 4, 1, 16)
    with pytest.raises(ValueError, match=r"^page_table\[1\]=16 is outside \[0, 16\)"):
        check_page_table(np.array([0, 16, 99]), 3, 1, 16)
    with pytest.raises(ValueError, match=r"^page_table repeats page id 3 \(at page_table\[1\] and page_table\[3\]\)$"):
        check_page_table([5, 3, 4, 3, 3], 5, 1, 16)
    # Entries past the pages the rows need are not checked (a table may be longer than needed).
    assert check_page_table([1, 2, -5], 2, 1, 16).tolist() == [1, 2, -5]


@pytest.mark.parametrize("cls", [KVSender, KVReceiver])
def test_timeout_s_is_checked_when_set_on_a_running_connector(cls):
    # Before: the constructor checked timeout_s, a later assignment took anything ("5", NaN),
    # which failed only inside the worker's deadline arithmetic.
    layers = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with cls(_spec("mla"), layers, engine="nixl", timeout_s=2) as c:
        assert c.timeout_s == 2.0 and isinstance(c.timeout_s, float)
        c.timeout_s = np.float32(0.5)
        assert c.timeout_s == 0.5 and type(c.timeout_s) is float
        for bad, err in [("5", TypeError), (True, TypeError), (float("nan"), ValueError), (0, ValueError),
                         (-1.0, ValueError), (1e9, ValueError)]:
            with pytest.raises(err, match="timeout_s"):
                c.timeout_s = bad
            assert c.timeout_s == 0.5  # unchanged by a refused value


@pytest.mark.parametrize("cls", [KVSender, KVReceiver])
def test_what_the_handshake_rests_on_is_fixed_at_construction(cls):
    # Found by a fresh-user trial: a receiver's spec swapped for a wider one after construction
    # passed the handshake, and a push wrote pages outside the request with SUCCESS on both sides.
    layers = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    names = ("spec", "mode", "staged", "max_batch_indices") if cls is KVSender else (
        "spec", "direction", "group", "host", "staged")
    with cls(_spec("mla"), layers, engine="nixl") as c:
        before = {n: getattr(c, n) for n in names}
        for name in names:
            with pytest.raises(AttributeError, match=f"{name} is fixed at construction"):
                setattr(c, name, _spec("mla", dcp_size=2, dcp_rank=1) if name == "spec" else "other")
        assert {n: getattr(c, n) for n in names} == before
        assert c.spec == _spec("mla")


@pytest.mark.parametrize("cls", [KVSender, KVReceiver])
def test_liveness_settings_are_fixed_and_drain_grace_is_checked(cls):
    # Before: peer_timeout_s = 0.0 was taken on a running sender, which then dropped every
    # receiver as silent within 2 s (its peers had agreed another limit at hello).
    layers = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with cls(_spec("mla"), layers, engine="nixl", peer_timeout_s=4, heartbeat_s=1) as c:
        assert (c.peer_timeout_s, c.heartbeat_s) == (4.0, 1.0)
        for name in ("peer_timeout_s", "heartbeat_s"):
            for value in (0.0, float("nan"), 3.0):
                with pytest.raises(AttributeError, match=f"{name} is fixed at construction"):
                    setattr(c, name, value)
        assert (c.peer_timeout_s, c.heartbeat_s) == (4.0, 1.0)
        if cls is KVReceiver:
            assert c.drain_grace_s == c.timeout_s + 8.0
            c.drain_grace_s = 1
            assert c.drain_grace_s == 1.0
            for bad, err in [(float("nan"), ValueError), (-1, ValueError), ("2", TypeError)]:
                with pytest.raises(err, match="drain_grace_s"):
                    c.drain_grace_s = bad
            assert c.drain_grace_s == 1.0
    with pytest.raises(ValueError, match="peer_timeout_s=nan"):
        cls(_spec("mla"), layers, engine="nixl", peer_timeout_s=float("nan"))


def test_the_default_drain_grace_is_capped_at_a_day():
    layers = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with KVReceiver(_spec("mla"), layers, engine="nixl", timeout_s=86400, peer_timeout_s=86400) as r:
        assert r.drain_grace_s == 86400.0


@pytest.mark.parametrize("host", [None, "", 127])
def test_a_sender_needs_an_address_to_advertise(host):
    # Before: host=None (a receiver's "any interface") failed deep in zmq: "tcp://None:*".
    layers = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with pytest.raises(ValueError, match=r"host=.* must be an address of this machine that receivers reach"):
        KVSender(_spec("mla"), layers, engine="nixl", host=host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", "0", "0.0", "00.0.0.0"])
def test_a_sender_refuses_a_wildcard_it_would_advertise(host):
    # Before: host="0.0.0.0" was taken and advertised as tcp://0.0.0.0:PORT, which works on
    # loopback only: a receiver on another host cannot dial it.
    layers = [np.zeros((8, 4, il), np.uint8) for il in ITEMS]
    with pytest.raises(ValueError, match=r"is a wildcard: the sender advertises its host"):
        KVSender(_spec("mla"), layers, engine="nixl", host=host)


@pytest.mark.parametrize("shape,dtype", [((2, 4, 16, 2, 16), np.uint16), ((1, 4, 16, 4, 16), np.uint16),
                                         ((2, 4, 16, 8, 8), np.uint8)])
def test_a_per_head_cache_in_another_arrangement_of_heads_is_refused(shape, dtype):
    # Same bytes per token, other heads / head_dim (a tester's trial): it was accepted, and the
    # views would have placed heads mixed up. uint8 with the last dimension in bytes is fine.
    from dcp_jax.transfer import KVCacheSpec, KVSender

    spec = KVCacheSpec(1, [2 * 4 * 8 * 2], 16, layout="nhd", num_kv_heads=4, head_dim=8, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"kv_layers\[0\] has shape .*'nhd' layout of tp_rank=0 \(4 KV heads "
                                         r"of head_dim=8\) is \(2, 4, 16, 4, 8\)"):
        KVSender(spec, [np.zeros(shape, dtype)], engine="nixl")
    for ok in (np.zeros((2, 4, 16, 4, 8), np.uint16), np.zeros((2, 4, 16, 4, 16), np.uint8)):
        KVSender(spec, [ok], engine="nixl").close()
