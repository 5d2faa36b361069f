"""Connector test setup: real engines (NIXL over UCX, Mooncake over TCP) on loopback.

`Cluster` builds one `KVSender` and N `KVReceiver`s in this process (engines talk over loopback
exactly as across processes), over fresh random KV pages; every receiver page starts as the
sentinel byte so a stray write shows. Oracles here do not call the library's formulas.
"""
import os
import sys
import threading
import time

# The engines' loopback and log settings come from tests/conftest.py, loaded before this file.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from bridge.mooncake import mooncake_available  # noqa: E402
from bridge.nixl import nixl_available  # noqa: E402
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus  # noqa: E402

SENTINEL = 0xA5
ENGINES = [e for e, ok in (("nixl", nixl_available()), ("mooncake", mooncake_available())) if ok]


def owner(t, n, i):  # the oracle's own ownership rule (spec section 2), token by token
    return (t // i) % n


def local_index(t, n, i):
    return (t // (i * n)) * i + t % i


class Cluster:
    """One sender over random KV and ``dcp_size`` receivers over sentinel-filled KV."""

    def __init__(self, engine, *, dcp_size=2, item_lens=(48, 16), page_size=4, pages=64,
                 interleave_size=1, direction="push", mode="auto", pack_bytes=None, kind="numpy",
                 timeout_s=20.0, peer_timeout_s=5.0, seed=None, connect=True, receiver_kw=None, **sender_kw):
        self.rng = np.random.default_rng(seed)
        self.dcp_size, self.page_size, self.item_lens = dcp_size, page_size, tuple(item_lens)
        self.interleave = interleave_size
        self.src = [self.rng.integers(0, 256, (pages, page_size, il), dtype=np.uint8) for il in item_lens]
        wrap = _as_kind(kind)
        # The caller's arrays (numpy or JAX): the engines write into these very buffers.
        self.dst = [[wrap(np.full((pages, page_size, il), SENTINEL, np.uint8)) for il in item_lens]
                    for _ in range(dcp_size)]
        self.sender_spec = KVCacheSpec(len(item_lens), item_lens, page_size)
        self.sender = KVSender(self.sender_spec, [wrap(a) for a in self.src], engine=engine, mode=mode,
                               pack_bytes=pack_bytes, timeout_s=timeout_s, peer_timeout_s=peer_timeout_s,
                               **sender_kw)
        self.receivers = []
        try:
            for r in range(dcp_size):
                spec = KVCacheSpec(len(item_lens), item_lens, page_size, dcp_size, r, interleave_size)
                self.receivers.append(KVReceiver(spec, self.dst[r], engine=engine,
                                                 direction=direction, timeout_s=timeout_s,
                                                 peer_timeout_s=peer_timeout_s, **(receiver_kw or {})))
                if connect:
                    self.receivers[-1].connect(self.sender.address)
        except BaseException:
            self.close()
            raise
        self.pages = pages
        self._free_src = list(self.rng.permutation(pages))
        self._free_dst = [list(self.rng.permutation(pages)) for _ in range(dcp_size)]

    def tables(self, num_tokens):
        """Fresh disjoint page tables for one request: (src table, [dst table per rank])."""
        p, n, i = self.page_size, self.dcp_size, self.interleave
        src = [self._free_src.pop() for _ in range(-(-num_tokens // p))]
        dst = []
        for r in range(n):
            rows = sum(1 for t in range(num_tokens) if owner(t, n, i) == r)
            dst.append([self._free_dst[r].pop() for _ in range(-(-rows // p))])
        return np.array(src, np.int64), [np.array(d, np.int64) for d in dst]

    def expect(self, rid, dst_tables, num_tokens, prefix_tokens=0):
        for r, recv in enumerate(self.receivers):
            recv.expect(rid, dst_tables[r], num_tokens, prefix_tokens)

    def wait(self, rid, timeout_s=20.0, sides=None):
        """Polls every side until terminal; returns {side: status}."""
        sides = sides or [self.sender] + self.receivers
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = [s.poll(rid) for s in sides]
            if all(x.terminal for x in st):
                return st
            time.sleep(0.002)
        return [s.poll(rid) for s in sides]

    def round_trip(self, rid, num_tokens):
        """One whole request on fresh pages through every rank (expect, send, wait): asserts
        SUCCESS on every side and every owned row byte-exact; returns the page tables."""
        src, dst = self.tables(num_tokens)
        self.expect(rid, dst, num_tokens)
        self.sender.send(rid, src, 0, num_tokens)
        assert self.wait(rid) == [TransferStatus.SUCCESS] * (1 + self.dcp_size), self.reasons(rid)
        assert self.check_bytes(src, dst, num_tokens) == num_tokens
        return src, dst

    def release_ranks(self, rid):
        """Every decode rank releases ``rid`` once `is_drained` says its pages may be reused."""
        for recv in self.receivers:
            wait_for(lambda recv=recv: recv.is_drained(rid))
            recv.release(rid)

    def reasons(self, rid):
        """Every side's status and failure reason (for assertion messages)."""
        return [(s.poll(rid).name, s.failure_reason(rid)) for s in [self.sender] + self.receivers]

    def check_bytes(self, src_table, dst_tables, num_tokens, prefix_tokens=0):
        """Every owned token of [prefix, L) byte-exact at its rank; returns rows checked."""
        p, n, i = self.page_size, self.dcp_size, self.interleave
        kv = [[np.asarray(a) for a in layers] for layers in self.dst]
        checked = 0
        for t in range(prefix_tokens, num_tokens):
            r = owner(t, n, i)
            j = local_index(t, n, i)
            dp, do = dst_tables[r][j // p], j % p
            sp, so = src_table[t // p], t % p
            for l in range(len(self.item_lens)):
                got = kv[r][l][dp, do]
                np.testing.assert_array_equal(got, self.src[l][sp, so], err_msg=f"token {t} layer {l}")
            checked += 1
        return checked

    def sentinel_pages(self, r, used_pages):
        """True when every page of rank r outside ``used_pages`` still holds only the sentinel."""
        kv = self.dst
        others = np.setdiff1d(np.arange(self.pages), np.asarray(used_pages, np.int64))
        return all((np.asarray(kv[r][l])[others] == SENTINEL).all() for l in range(len(self.item_lens)))

    def close(self):
        for recv in self.receivers:
            recv.close()
        if getattr(self, "sender", None) is not None:
            self.sender.close()


def check_region_timeline(timeline):
    """Region push, per decode rank of a sender's timeline (``[event, rank, t]``): the k-th
    ``pack`` comes before the k-th ``ask`` (asked as soon as the pack is enqueued), which comes
    before the k-th ``packed`` (the round's synchronisation), and the k-th ``post`` after both,
    in order and in time. Ranks with no ask (no region window) are left out. Returns
    {rank: windows}."""
    seen = {}
    for i, (name, rank, t) in enumerate(timeline):
        seen.setdefault(rank, {}).setdefault(name, []).append((i, t))
    out = {}
    for rank, ev in seen.items():
        if "ask" not in ev:
            continue
        k = len(ev["ask"])
        assert len(ev.get("pack", ())) == len(ev.get("packed", ())) == len(ev.get("post", ())) == k, (rank, ev)
        for (i0, t0), (i1, t1), (i2, t2), (i3, t3) in zip(ev["pack"], ev["ask"], ev["packed"], ev["post"]):
            assert i0 < i1 < i2 < i3 and t0 <= t1 <= t2 <= t3, (rank, ev)
        out[rank] = k
    return out


class Gate:
    """A pack ticket (`pallas_kernels.written`'s `ready` / `wait`) standing in for a device
    pack: a pack still running until `open()`; `wait()` blocks until then (at most 10 s, or its
    ``timeout_s``: False then). ``error``: a failed kernel, raised by `ready` and `wait`."""

    def __init__(self, error=None):
        self.opened, self.waits, self.error = threading.Event(), 0, error

    def open(self):
        self.opened.set()

    def ready(self):
        if self.error is not None:
            raise self.error
        return self.opened.is_set()

    def wait(self, timeout_s=None):
        self.waits += 1
        if self.error is not None:
            raise self.error
        if timeout_s is not None:
            return self.opened.wait(timeout_s)
        assert self.opened.wait(10.0)
        return True


def wait_for(pred, timeout_s=10.0):
    """Polls ``pred`` every 5 ms for up to ``timeout_s``; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.005)
    return pred()


def region_free(recv):
    """True when the receiver holds no range of its receive region (in use or quarantined)."""
    st = recv.stats
    return (st["region"]["in_use_bytes"] == 0 and st["region"]["quarantined_bytes"] == 0
            and st["region_grants"] == 0 and st["region_waiting"] == 0)


def arena_free(sender):
    """True when the sender's pack arena holds no region (in use or quarantined)."""
    a = sender.stats["arena"]
    return a["in_use_bytes"] == 0 and a["quarantined_bytes"] == 0 and a["free_bytes"] == a["capacity"]


def announced(sender, rid):
    """The decode ranks whose announcement of ``rid`` reached the sender (empty before any)."""
    try:
        return set(sender.request_stats(rid)["ranks"])
    except KeyError:  # no expect arrived yet
        return set()


def events(sender, rid, name):
    """The ``[name, rank, t]`` entries of a request's timeline."""
    return [e for e in sender.request_stats(rid)["timeline"] if e[0] == name]


def _as_kind(kind):
    if kind == "numpy":
        return lambda a: a
    if kind == "jax":
        import jax.numpy as jnp

        return lambda a: jnp.asarray(a)
    raise ValueError(kind)


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


__all__ = ["Cluster", "ENGINES", "Gate", "SENTINEL", "TransferStatus", "announced", "arena_free", "check_region_timeline",
           "events", "region_free", "wait_for"]
