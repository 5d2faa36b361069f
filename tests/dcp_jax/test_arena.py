"""PackArena: aligned first-fit regions, release and coalescing, quarantine, stats, threads."""

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dcp_jax.transfer.arena import PackArena, PackRegion


def test_first_fit_alignment_and_coalescing():
    a = PackArena(1000, align=64)
    r1, r2, r3 = a.acquire("a", 10), a.acquire("b", 64), a.acquire("c", 65)
    assert (r1.offset, r2.offset, r3.offset) == (0, 64, 128) and r3.nbytes == 65 and r3.end == 193
    assert a.stats["in_use_bytes"] == 64 + 64 + 128 and a.stats["regions_in_use"] == 3
    a.release(r2)
    assert a.acquire("d", 64).offset == 64  # first fit reuses the hole
    a.release(r1)
    assert a.largest_free() == 1000 - 256
    big = a.acquire("e", 1000 - 256)  # the tail range ends at 1000, not a multiple of 64
    assert big.offset == 256 and a.stats["free_bytes"] == 64
    assert a.acquire("f", 65) is None and a.stats["waits"] == 1
    for r in (big, r3):
        a.release(r)
    g = a.acquire("g", 64)
    assert g.offset == 0
    a.release(g)
    s = a.stats
    assert s["regions_in_use"] == 1 and s["acquires"] == 6 and s["high_water_bytes"] == 64 + 128 + 744
    assert a.free_ranges() == [(0, 64), (128, 872)]
    assert "PackArena(capacity=1,000" in repr(a)


def test_release_twice_and_wrong_states_raise():
    a, b = PackArena(256), PackArena(256)
    r = a.acquire(("req", 0, 1, 0), 100)
    with pytest.raises(ValueError, match="not acquired from this arena"):
        b.release(r)
    with pytest.raises(ValueError, match="release_quarantined.*in_use, not quarantined"):
        a.release_quarantined(r)
    a.release(r)
    assert r.state == "released"
    with pytest.raises(ValueError, match="released, not in_use"):
        a.release(r)
    with pytest.raises(ValueError, match="quarantine"):
        a.quarantine(r)
    with pytest.raises(ValueError, match="not acquired"):
        a.release(PackRegion(0, 10, "x"))


def test_quarantine_holds_bytes_until_released():
    a = PackArena(128, align=64)
    r = a.acquire("k", 128)
    a.quarantine(r)
    assert r.state == "quarantined" and a.stats["quarantined_bytes"] == 128 and a.stats["in_use_bytes"] == 0
    with pytest.raises(ValueError, match="quarantined, not in_use"):
        a.release(r)
    assert a.acquire("k2", 1) is None  # never handed out while quarantined
    a.release_quarantined(r)
    assert a.acquire("k3", 128).offset == 0


@pytest.mark.parametrize("args, kw, exc, match", [
    ((-1,), {}, ValueError, "nbytes"),
    ((10,), dict(align=0), ValueError, "align"),
    ((10.0,), {}, TypeError, "nbytes"),
])
def test_constructor_errors(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        PackArena(*args, **kw)


def test_acquire_errors_name_nbytes():
    a = PackArena(100)
    for bad in (0, -5, 101):
        with pytest.raises(ValueError, match="nbytes"):
            a.acquire("k", bad)
    with pytest.raises(TypeError, match="nbytes"):
        a.acquire("k", 1.5)
    with pytest.raises(ValueError, match="nbytes"):
        PackArena(0).acquire("k", 1)


def test_threads_never_share_bytes():
    a = PackArena(64 * 64, align=64)
    owner = [None] * (64 * 64)
    errors = []

    def work(tid):
        for k in range(300):
            r = a.acquire((tid, k), 1 + (k * 37 + tid) % 300)
            if r is None:
                continue
            for b in range(r.offset, r.end):
                if owner[b] is not None:
                    errors.append((tid, b))
                owner[b] = tid
            for b in range(r.offset, r.end):
                owner[b] = None
            a.release(r)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert a.free_ranges() == [(0, 64 * 64)] and a.stats["in_use_bytes"] == 0


class ArenaMachine(RuleBasedStateMachine):
    """Random acquire / release / quarantine / release_quarantined against a model of the bytes."""

    def __init__(self):
        super().__init__()
        self.arena = None
        self.live: list[PackRegion] = []
        self.quarantined: list[PackRegion] = []
        self.poisoned: set[int] = set()  # bytes of quarantined regions

    @precondition(lambda self: self.arena is None)
    @rule(capacity=st.integers(1, 5000), align=st.sampled_from([1, 8, 64, 100]))
    def make(self, capacity, align):
        self.arena, self.align = PackArena(capacity, align=align), align

    @precondition(lambda self: self.arena is not None)
    @rule(nbytes=st.integers(1, 1500))
    def acquire(self, nbytes):
        if nbytes > self.arena.capacity:
            with pytest.raises(ValueError, match="nbytes"):
                self.arena.acquire("k", nbytes)
            return
        fits = self.arena.largest_free() >= nbytes
        r = self.arena.acquire(len(self.live), nbytes)
        assert (r is not None) == fits
        if r is not None:
            assert r.state == "in_use" and r.nbytes == nbytes
            assert not self.poisoned & set(range(r.offset, r.end))
            self.live.append(r)

    @precondition(lambda self: self.arena is not None)
    @rule(k=st.integers(0, 100), how=st.sampled_from(["release", "quarantine"]))
    def drop(self, k, how):
        if not self.live:
            return
        r = self.live.pop(k % len(self.live))
        if how == "release":
            self.arena.release(r)
            with pytest.raises(ValueError):
                self.arena.release(r)
        else:
            self.arena.quarantine(r)
            self.quarantined.append(r)
            self.poisoned |= set(range(r.offset, r.offset + r._reserved))

    @precondition(lambda self: self.arena is not None)
    @rule(k=st.integers(0, 100))
    def unquarantine(self, k):
        if not self.quarantined:
            return
        r = self.quarantined.pop(k % len(self.quarantined))
        self.arena.release_quarantined(r)
        self.poisoned -= set(range(r.offset, r.offset + r._reserved))

    @invariant()
    def consistent(self):
        if self.arena is None:
            return
        a, s = self.arena, self.arena.stats
        held = sorted(self.live + self.quarantined, key=lambda r: r.offset)
        for r in held:
            assert r.offset % self.align == 0 and 0 <= r.offset and r.offset + r._reserved <= a.capacity
            assert r.nbytes <= r._reserved
        for x, y in zip(held, held[1:]):
            assert x.offset + x._reserved <= y.offset  # no two live regions overlap
        free = a.free_ranges()
        for (o1, s1), (o2, _) in zip(free, free[1:]):
            assert o1 + s1 < o2  # coalesced: no two free ranges touch
        assert s["free_bytes"] + s["in_use_bytes"] + s["quarantined_bytes"] == s["capacity"]
        assert s["in_use_bytes"] == sum(r._reserved for r in self.live)
        assert s["quarantined_bytes"] == sum(r._reserved for r in self.quarantined)
        assert s["regions_in_use"] == len(self.live)
        assert s["high_water_bytes"] >= s["in_use_bytes"] + s["quarantined_bytes"]

    def teardown(self):
        if self.arena is None:
            return
        for r in self.live:
            self.arena.release(r)
        for r in self.quarantined:
            self.arena.release_quarantined(r)
        assert self.arena.free_ranges() == [(0, self.arena.capacity)]  # full release: one range


TestArena = ArenaMachine.TestCase
TestArena.settings = settings(max_examples=200, stateful_step_count=30, deadline=None, derandomize=True)
