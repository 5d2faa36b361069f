"""Mapped index slots (`pallas_kernels.mapped_ring`): the slot arithmetic, the in-call copy and
the fan-out reading its indices from one slot, on the CPU (interpret mode). The UVA import itself
needs a GPU: `tests/gpu/test_copier_gpu.py` runs every fan-out launch through it there."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.config import GatherConfig
from pallas_kernels.mapped_ring import slot_layout, split_slot, supported, to_device


def test_slot_layout_hand_computed():
    """Vectors on 64-word lines, metadata after them, at least one line of it."""
    assert slot_layout(64, 2, 3) == (64, 192)
    assert slot_layout(65, 2, 3) == (128, 320)
    assert slot_layout(1, 1, 64) == (64, 128)
    assert slot_layout(32768, 2, 4096) == (32768, 2 * 32768 + 4096)
    assert slot_layout(100, 3, 65) == (128, 3 * 128 + 128)


def test_to_device_keeps_every_int32_value():
    """The in-call copy is value-preserving for every int32, the sign bit and INT_MIN too
    (the pack's table carries uint32 offsets as int32 bits)."""
    rng = np.random.default_rng()
    x = np.r_[rng.integers(-2**31, 2**31, 4096, dtype=np.int64), -2**31, 2**31 - 1, -1, 0].astype(np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(to_device)(jnp.asarray(x))), x)


def test_split_slot_returns_the_vectors_and_metadata_where_the_layout_puts_them():
    m, k, meta_len = 70, 3, 9
    stride, size = slot_layout(m, k, meta_len)
    words = np.arange(size, dtype=np.int32)
    vecs, meta = split_slot(jnp.asarray(words), m, k, meta_len)
    for j, v in enumerate(vecs):
        np.testing.assert_array_equal(np.asarray(v), words[j * stride:j * stride + m])
    np.testing.assert_array_equal(np.asarray(meta), words[k * stride:k * stride + meta_len])


def test_fanout_from_one_slot_matches_brute_force():
    """The fused launch's indices laid into one slot as the sender fills it (sidx, didx, the
    window table), read back inside the call: byte-exact against brute force, old words left
    between windows (the fill does not clear them) never stored."""
    from pallas_kernels import fanout as fo

    rng = np.random.default_rng()
    L, R, W, br = 3, 50, 12, 8
    rows = (30, 9, 17)
    src = rng.integers(0, 2**32, (L, R, W), dtype=np.uint32)
    dsts = [rng.integers(0, 2**32, L * r * W, dtype=np.uint32) for r in rows]
    windows = [(0, rng.integers(0, R, 19), rng.permutation(30)[:19]), (1, np.zeros(0, np.int64), np.zeros(0, np.int64)),
               (2, rng.integers(0, R, 8), rng.permutation(17)[:8])]
    want = [d.reshape(L, r, W).copy() for d, r in zip(dsts, rows)]
    for k, s, d in windows:
        for l in range(L):
            want[k][l][d] = src[l][s]
    sidx, didx, table = fo._layout(windows, br)
    m, tl = len(sidx), len(table)
    stride, size = slot_layout(m, 2, tl)
    slot = rng.integers(0, 2**31, size, dtype=np.int64).astype(np.int32)  # stale words everywhere
    starts, _, _ = fo._blocks([len(s) for _, s, _ in windows], [k for k, _, _ in windows], br)
    for (_, s, d), a in zip(windows, starts):  # what `_enqueue_fanout`'s fill writes
        slot[a:a + len(s)] = s
        slot[stride + a:stride + a + len(d)] = d
    slot[2 * stride:2 * stride + tl] = table
    outs = fo._fanout_slot_jit(jnp.asarray(src), jnp.asarray(slot), tuple(jnp.asarray(d) for d in dsts),
                               m=m, table_len=tl, first_layer=0, dst_rows=rows,
                               config=GatherConfig(block_rows=br), backend="interpret")
    for o, w, r in zip(outs, want, rows):
        np.testing.assert_array_equal(np.asarray(o).reshape(L, r, W), w)


def test_supported_is_false_without_a_gpu():
    """No CUDA device here: the copying ring serves (checked once, no exception)."""
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present: tests/gpu covers the mapped slots")
    assert supported() is False
    assert supported() is False


def test_gather_rows_from_one_slot_matches_the_plain_call():
    """`pack_rows`' launch with its indices and (rows, offset units, ok) in one slot equals the
    call with them passed apart, byte for byte (interpret mode), the rest of the pack untouched."""
    from pallas_kernels.gather import _gather_rows_jit, _gather_rows_slot_jit
    from pallas_kernels.mapped_ring import fill_padded

    rng = np.random.default_rng()
    L, R, W, m, n, off = 3, 40, 8, 32, 21, 16
    src = jnp.asarray(rng.integers(0, 2**32, (L, R, W), dtype=np.uint32))
    pack = rng.integers(0, 2**32, 1024, dtype=np.uint32)
    idx = rng.integers(0, R, n)
    stride, size = slot_layout(m, 1, 3)
    slot = np.zeros(size, np.int32)
    fill_padded([idx], (n, off, 1))([slot[:m]], slot[stride:stride + 3])
    static = dict(config=GatherConfig(block_rows=8), backend="interpret", offset_align=1)
    got = _gather_rows_slot_jit(src, jnp.asarray(slot), jnp.asarray(pack), m=m, **static)
    want = _gather_rows_jit(src, jnp.asarray(slot[:m]), jnp.asarray(pack), jnp.asarray([n, off, 1], jnp.int32), **static)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    expect = pack.copy()
    expect[off:off + L * n * W] = np.asarray(src)[:, idx].reshape(-1)
    np.testing.assert_array_equal(np.asarray(got), expect)


def test_gather_windows_from_one_slot_matches_the_plain_call():
    """`pack_windows`' launch with its indices and block table in one slot equals the plain
    call (two windows at word offsets 0 and 512, interpret mode)."""
    from pallas_kernels.windows import _gather_windows_jit, _gather_windows_slot_jit, window_blocks

    rng = np.random.default_rng()
    L, R, W, br = 2, 30, 8, 8
    src = jnp.asarray(rng.integers(0, 2**32, (L, R, W), dtype=np.uint32))
    pack = rng.integers(0, 2**32, 2048, dtype=np.uint32)
    wins = [rng.integers(0, R, 11), rng.integers(0, R, 5)]
    starts, blocks, m = window_blocks([11, 5], [0, 512], br)
    padded = np.zeros(m, np.int32)
    for s, w in zip(starts, wins):
        padded[s:s + len(w)] = w
    stride, size = slot_layout(m, 1, len(blocks))
    slot = np.zeros(size, np.int32)
    slot[:m], slot[stride:stride + len(blocks)] = padded, blocks
    static = dict(config=GatherConfig(block_rows=br), backend="interpret", offset_align=1)
    got = _gather_windows_slot_jit(src, jnp.asarray(slot), jnp.asarray(pack), m=m, table_len=len(blocks), **static)
    want = _gather_windows_jit(src, jnp.asarray(padded), jnp.asarray(pack), jnp.asarray(blocks), **static)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    expect = pack.copy()
    for w, off in zip(wins, (0, 512)):
        expect[off:off + L * len(w) * W] = np.asarray(src)[:, w].reshape(-1)
    np.testing.assert_array_equal(np.asarray(got), expect)


def test_slot_arguments_are_checked_and_named():
    """Bad sizes, a slot too short for its layout and non-int32 words are refused, named."""
    for args, exc, match in (((-100, 2, 3), ValueError, "m=-100"), ((10, 0, 3), ValueError, "k=0"),
                             ((10, 1, -1), ValueError, "meta_len=-1"), ((1.5, 2, 3), TypeError, "m must be an int"),
                             ((True, 2, 3), TypeError, "m must be an int")):
        with pytest.raises(exc, match=match):
            slot_layout(*args)
    with pytest.raises(ValueError, match=">= 448 words"):
        split_slot(jnp.zeros(10, jnp.int32), 100, 3, 5)
    with pytest.raises(ValueError, match="1-D"):
        split_slot(jnp.zeros((2, 400), jnp.int32), 100, 3, 5)
    for bad in (jnp.array([2**32 - 1], jnp.uint32), jnp.zeros(4, jnp.int8), jnp.zeros(4, jnp.float32)):
        with pytest.raises(TypeError, match="int32"):
            to_device(bad)


def test_claim_slot_waits_only_for_a_slot_a_queued_call_may_still_read():
    """The slot-reuse rule both rings share: slots in turn, each call counted; a slot is claimed
    again only after one wait for everything enqueued (once per `slots` calls), never before."""
    from types import SimpleNamespace

    from pallas_kernels.mapped_ring import claim_slot, fill_padded, fill_slot

    waits = []
    dests = SimpleNamespace(calls=0, done=0, handles=[SimpleNamespace(block_until_ready=lambda: waits.append(1))])
    ring = SimpleNamespace(next=0, slots=3, last_use=[-1] * 3, m=4, k=2, meta_len=2)
    ring.stride, size = slot_layout(ring.m, ring.k, ring.meta_len)
    got = [claim_slot(ring, dests) for _ in range(7)]
    assert got == [0, 1, 2, 0, 1, 2, 0] and dests.calls == 7
    assert len(waits) == 2 and dests.done == 6  # before the 4th and the 7th claims
    host = np.full(size, 9, np.int32)
    fill_slot(fill_padded([[1, 2], [3]], (7, 8)), host, ring)
    np.testing.assert_array_equal(host[:4], [1, 2, 0, 0])
    np.testing.assert_array_equal(host[ring.stride:ring.stride + 4], [3, 0, 0, 0])
    np.testing.assert_array_equal(host[2 * ring.stride:2 * ring.stride + 2], [7, 8])
    assert (host[2 * ring.stride + 2:] == 9).all()  # words past the metadata keep older values
