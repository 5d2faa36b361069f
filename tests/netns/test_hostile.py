"""Hostile and broken peers against a real sender on another host (network namespace).

Host 0 runs a `KVSender` bound to its address on link 1, host 1 a well-behaved `KVReceiver`,
host 2 an `Attacker` (its own engine, raw frames, raw TCP). After each attack: the refusal was
logged with its reason and counted, no engine call was made for it, no byte of the attacker's
memory or of the receiver's pages outside its requests changed (sentinels), and a request from
the sender to the receiver still succeeds byte-exact on the same processes. NIXL only: the
checks are the connector's, not the engine's (Mooncake runs the same code path).
"""
import msgpack
import numpy as np
import pytest

from conftest import ITEM_LENS, PAGE, roundtrip, wait_for
from dcp_jax.netns import Hosts
from dcp_jax.netns.agents import Agent, AgentError
from dcp_jax.transfer import protocol as proto

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def net():
    from bridge.nixl import nixl_available

    if not nixl_available():
        pytest.skip("NIXL does not import here")
    with Hosts(3) as h:
        geo = dict(item_lens=ITEM_LENS, page_size=PAGE)
        # The attacker sends only when told to (no heartbeats): a long peer timeout keeps it.
        sender = Agent(h, 0, "sender", engine="nixl", host=h.addr(0, 1), timeout_s=10.0, peer_timeout_s=60.0, **geo)
        recv = Agent(h, 1, "receiver", engine="nixl", host=h.addr(1), timeout_s=10.0, **geo)
        recv.call("connect", sender.hello)
        evil = Agent(h, 2, "attacker", engine="nixl", host=h.addr(2), address=sender.hello, **geo)
        yield dict(hosts=h, sender=sender, recv=recv, evil=evil, n=[0])
        for a in (evil, recv, sender):
            a.close()


def _fresh(net, stem):
    net["n"][0] += 1
    return f"{stem}-{net['n'][0]}"


def _logged(net, *words):
    """Waits for a sender log line holding every one of ``words``; returns it."""
    def find():
        return next((ln for ln in net["sender"].call("logs") if all(w in ln for w in words)), None)
    return wait_for(find, 5.0)


def _ranks(sender, rid):
    try:
        return sender.call("request_stats", rid)["ranks"]
    except AgentError:  # not announced yet
        return None


def _after_attack(net, engine_calls_before):
    """The sender made no engine call for the attack and still serves the good receiver."""
    s = net["sender"].call("stats")
    assert s["engine_calls"] == engine_calls_before and s["worker_errors"] == 0, s
    assert net["evil"].call("guard_ok")
    roundtrip(net["sender"], net["recv"], _fresh(net, "good"), 37)


def test_wrong_protocol_version_is_refused_and_named(net):
    calls = net["sender"].call("stats")["engine_calls"]
    hello = msgpack.packb({"v": proto.PROTOCOL_VERSION + 7, "k": "hello", "rid": "", "inc": 0}, use_bin_type=True)
    replies = net["evil"].call("raw", [hello], 2.0)
    nacks = [m for m in replies if m.get("k") == "hello_nack"]
    assert nacks and nacks[0]["field"] == "version", replies
    assert nacks[0]["theirs"] == proto.PROTOCOL_VERSION + 7
    assert _logged(net, "refused a frame", f"protocol version {proto.PROTOCOL_VERSION + 7}")
    _after_attack(net, calls)


def test_geometry_mismatch_is_refused_at_the_handshake(net):
    calls = net["sender"].call("stats")["engine_calls"]
    before = net["sender"].call("stats")["handshakes_refused"]
    ans = net["evil"].call("handshake", item_lens=[48, 32])
    assert ans["k"] == "hello_nack" and ans["field"] == "item_lens", ans
    assert net["sender"].call("stats")["handshakes_refused"] == before + 1
    assert _logged(net, "refused a handshake", "item_lens")
    _after_attack(net, calls)


def test_page_ids_outside_the_receivers_cache_are_refused(net):
    # The attacker registered 16 pages; pages 16..23 of its arrays are unregistered guard pages.
    assert net["evil"].call("handshake")["k"] == "hello_ack"
    calls = net["sender"].call("stats")["engine_calls"]
    rid = _fresh(net, "outside")
    net["evil"].call("expect", rid, 5, 16, [14, 15, 16, 17])
    assert _logged(net, "refused an announcement", rid, "outside")
    net["sender"].call("send", rid, np.arange(4), 0, 16)  # the sender has nobody to send it to
    st = net["sender"].call("request_stats", rid)
    assert st["ranks"] == {} and st["inflight"] == 0, st
    assert net["evil"].call("notes") == 0
    net["sender"].call("abort", rid)
    net["sender"].call("release", rid)
    _after_attack(net, calls)


def test_page_table_longer_than_the_request_is_refused(net):
    assert net["evil"].call("handshake")["k"] == "hello_ack"
    calls = net["sender"].call("stats")["engine_calls"]
    rid = _fresh(net, "long")
    net["evil"].call("expect", rid, 5, 8, [0, 1, 2, 3, 4, 5])  # 8 tokens need 2 pages of 4
    assert _logged(net, "refused an announcement", rid, "6 pages", "2 are needed")
    net["sender"].call("send", rid, np.arange(2), 0, 8)
    assert net["sender"].call("request_stats", rid)["ranks"] == {}
    net["sender"].call("abort", rid)
    net["sender"].call("release", rid)
    _after_attack(net, calls)


def test_request_id_of_another_connection_is_not_touched(net):
    sender, recv, evil = net["sender"], net["recv"], net["evil"]
    assert evil.call("handshake")["k"] == "hello_ack"
    rid = _fresh(net, "theirs")
    recv.call("expect", rid, np.arange(10), 40)  # the good receiver's request, not sent yet
    assert wait_for(lambda: _ranks(sender, rid), 5.0)
    dropped = sender.call("stats")["dropped_messages"]
    for inc in (0, 1, 12345):  # the attacker does not know the incarnation; nor does it matter
        evil.call("send_msg", "abort", rid, inc, reason="hijack")
        evil.call("send_msg", "failed", rid, inc, reason="hijack")
    evil.call("expect", rid, 99, 40, list(range(10)))  # another group: not this request's rank
    assert sender.call("stats")["dropped_messages"] >= dropped + 7
    assert _logged(net, "dropped", rid)
    assert sender.call("poll", rid) == "WAITING" and recv.call("poll", rid) == "WAITING"
    sender.call("send", rid, np.arange(10), 0, 40)
    assert sender.call("wait", rid, 20)[0] == "SUCCESS" and recv.call("wait", rid, 20)[0] == "SUCCESS"
    assert recv.call("check", np.arange(10), np.arange(10), 40, 1, 64) == dict(rows=40, bad_rows=0)
    assert evil.call("notes") == 0 and evil.call("guard_ok")
    for side in (sender, recv):
        side.call("release", rid)
    recv.call("clear", list(range(10)))
    assert recv.call("sentinel_ok", [])


def test_unhandshaked_peer_is_ignored(net):
    calls = net["sender"].call("stats")["engine_calls"]
    rid = _fresh(net, "anon")
    frame = proto.encode("expect", rid, 3, num_tokens=8, prefix_tokens=0, page_table=proto.pack_i64([0, 1]),
                         dcp_rank=0)
    replies = net["evil"].call("raw", [frame, proto.encode("abort", rid, 3, reason="x")], 0.5)
    # Answered, not served: "you have no connection here, connect again".
    assert [m["k"] for m in replies] == ["hello_nack"] * 2 and replies[0]["field"] == "connection", replies
    assert _logged(net, "not handshaked", "expect")
    with pytest.raises(Exception, match="not known"):
        net["sender"].call("poll", rid)
    _after_attack(net, calls)


def test_oversized_truncated_and_multipart_frames_are_rejected(net):
    sender, evil = net["sender"], net["evil"]
    assert evil.call("handshake")["k"] == "hello_ack"
    calls, rejected = sender.call("stats")["engine_calls"], sender.call("stats")["rejected_messages"]
    good = proto.encode("expect", "t", 3, num_tokens=8, prefix_tokens=0, page_table=proto.pack_i64([0, 1]),
                        dcp_rank=0)
    oversized = msgpack.packb({"v": proto.PROTOCOL_VERSION, "k": "expect", "rid": "big", "inc": 1,
                               "num_tokens": 8, "prefix_tokens": 0, "dcp_rank": 0,
                               "page_table": b"\0" * (proto.MAX_CONTROL_BYTES + 8)}, use_bin_type=True)
    for frame in (good[: len(good) // 2], oversized, b"\xc1\xff\x00garbage"):
        evil.call("send_raw_on_conn", frame)
    evil.call("raw", [b"a", b"b", b"c"], 0.3, True)  # three frames in one message
    assert wait_for(lambda: sender.call("stats")["rejected_messages"] >= rejected + 4, 5.0)
    assert _logged(net, "refused a frame", "exceeds the limit")
    assert _logged(net, "refused a frame", "not a msgpack message")
    # The attacker's handshaked connection lives on: the sender still pings it.
    assert any(m.get("k") == "ping" for m in evil.call("send_msg", "ping", wait_s=1.5))
    _after_attack(net, calls)


def test_random_bytes_on_the_control_port(net):
    calls = net["sender"].call("stats")["engine_calls"]
    assert net["evil"].call("tcp_garbage", 65536, 7, 4) >= 0
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 4096, 20)]
    net["evil"].call("raw", frames, 0.3)
    _after_attack(net, calls)


def test_control_plane_listens_only_on_the_chosen_address(net):
    # The sender was bound to host 0's address on link 1; its address on link 2 refuses.
    h, port = net["hosts"], int(net["sender"].hello.rsplit(":", 1)[1])
    evil = net["evil"]
    with pytest.raises(Exception, match="refused"):
        evil.call("connect_tcp", h.addr(0, 2), port)
    assert evil.call("connect_tcp", h.addr(0, 1), port) is True
