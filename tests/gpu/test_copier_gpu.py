"""GPU: the one-argument forms of a layer-major KV cache. `pack_rows` / `pack_windows` read
layers that lie back to back in one buffer through ONE stacked source view, `RowCopier` copies
from such a cache into another (the fused path: stacked source, flat destination); each is
byte-exact against the per-layer form and CuPy fancy indexing, in place, with no recompiles
over repeated calls.

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
cp = pytest.importorskip("cupy")

from pallas_kernels import (  # noqa: E402
    PackSource,
    RowCopier,
    compile_count,
    copy_fanout,
    pack_rows,
    pack_windows,
    synchronize,
)
from pallas_kernels import device  # noqa: E402

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX sees none)", allow_module_level=True)


def _one_buffer(rows, item, L, seed, fill=None):
    """L layers u8[rows, item] as back-to-back views of one allocation (and the allocation)."""
    if fill is None:
        buf = cp.random.RandomState(seed).randint(0, 256, L * rows * item, dtype=cp.int32).astype(cp.uint8)
    else:
        buf = cp.full(L * rows * item, fill, cp.uint8)
    return [buf[l * rows * item:(l + 1) * rows * item].reshape(rows, item) for l in range(L)], buf


@pytest.mark.parametrize("item", [1152, 656])
def test_pack_rows_one_buffer_layers_use_one_stacked_source(item):
    layers, _ = _one_buffer(512, item, 5, 1)
    word = np.dtype(np.uint32 if item % 4 == 0 else np.uint16)
    assert device.stacked_words(layers, word) is not None
    # The same bytes with a gap after each layer (separate allocations may well lie back to
    # back in CuPy's pool: then they ARE one buffer, and take the stacked view too).
    gapped = cp.zeros(5 * (512 + 1) * item, cp.uint8)
    separate = [gapped[l * 513 * item:(l * 513 + 512) * item].reshape(512, item) for l in range(5)]
    for s, a in zip(separate, layers):
        s[...] = a
    assert device.stacked_words(separate, word) is None
    idx = np.random.default_rng(item).integers(0, 512, 300)
    got = cp.full(5 * 300 * item + 128, 0xA5, cp.uint8)
    want = got.copy()
    pack_rows(layers, idx, got, offset=64)
    pack_rows(separate, idx, want, offset=64)
    assert bool(cp.array_equal(got, want))
    ref = cp.concatenate([a[cp.asarray(idx)].reshape(-1) for a in separate])
    assert bool(cp.array_equal(got[64:64 + ref.size], ref))
    before = compile_count()
    for seed in range(3):  # fresh indices of the same bucket: no new kernel
        idx = np.random.default_rng(seed).integers(0, 512, 290)
        pack_rows(layers, idx, got, offset=64 + 16 * seed)
        ref = cp.concatenate([a[cp.asarray(idx)].reshape(-1) for a in separate])
        assert bool(cp.array_equal(got[64 + 16 * seed:64 + 16 * seed + ref.size], ref))
    assert compile_count() == before


def test_pack_windows_one_buffer_layers_match_pack_rows():
    layers, _ = _one_buffer(700, 1152, 4, 2)
    rng = np.random.default_rng(3)
    wins = [(rng.integers(0, 700, n), off) for n, off in ((100, 0), (0, 600_000), (257, 1_000_000))]
    got = cp.full(1_000_000 + 257 * 4 * 1152 + 64, 0x11, cp.uint8)
    want = got.copy()
    pack_windows(layers, wins, got)
    for idx, off in wins:
        pack_rows([cp.array(a) for a in layers], idx, want, offset=off)
    assert bool(cp.array_equal(got, want))


@pytest.mark.parametrize("src_form", ["one buffer", "separate"])
@pytest.mark.parametrize("dst_form", ["one buffer", "separate"])
def test_row_copier_bit_exact_in_place(src_form, dst_form):
    L, item = 6, 1152
    src, _ = _one_buffer(400, item, L, 4)
    if src_form == "separate":
        src = [cp.array(a) for a in src]
    if dst_form == "one buffer":
        dst, owner = _one_buffer(300, item, L, 0, fill=0x5A)
        mem = cp.cuda.UnownedMemory(owner.data.ptr, owner.nbytes, owner, owner.device.id)
        flat = cp.ndarray(owner.shape, cp.uint8, cp.cuda.MemoryPointer(mem, 0))  # as IPC maps it
        dst = [flat[l * 300 * item:(l + 1) * 300 * item].reshape(300, item) for l in range(L)]
    else:
        dst = [cp.full((300, item), 0x5A, cp.uint8) for _ in range(L)]
    copier = RowCopier(src, dst)
    rng = np.random.default_rng(7)
    want = [cp.array(d) for d in dst]
    before = None
    for call in range(4):
        n = 200 - call
        sidx = rng.integers(0, 400, n)
        didx = rng.permutation(300)[:n]
        for s, w in zip(src, want):
            w[cp.asarray(didx)] = s[cp.asarray(sidx)]
        assert copier.copy(sidx, didx, checked=call % 2 == 1) == n
        if call == 0:
            before = compile_count()
    synchronize(dst)
    for d, w in zip(dst, want):
        assert bool(cp.array_equal(d, w))
    assert compile_count() == before  # one kernel for every later call
    copier.close()


def _flat_foreign(rows, item, L, fill):
    """L layers u8[rows, item] over one allocation, viewed through UnownedMemory (an IPC map)."""
    owner = cp.full(L * rows * item, fill, cp.uint8)
    mem = cp.cuda.UnownedMemory(owner.data.ptr, owner.nbytes, owner, owner.device.id)
    flat = cp.ndarray(owner.shape, cp.uint8, cp.cuda.MemoryPointer(mem, 0))
    return [flat[l * rows * item:(l + 1) * rows * item].reshape(rows, item) for l in range(L)]


def test_copy_fanout_one_launch_for_every_destination():
    """The fused round: one source cache into four decode caches (row counts 300, 300, 200 and
    a per-layer one that cannot share the launch), byte-exact against CuPy fancy indexing, one
    kernel compiled for the fan-out whatever the window sizes of later rounds."""
    L, item = 5, 1152
    src, _ = _one_buffer(600, item, L, 9)
    source = PackSource(src)
    dsts = [_flat_foreign(300, item, L, 0x11), _flat_foreign(300, item, L, 0x22),
            _flat_foreign(200, item, L, 0x33), [cp.full((250, item), 0x44, cp.uint8) for _ in range(L)]]
    copiers = [RowCopier(source, d) for d in dsts]
    assert [c.uniform_rows for c in copiers] == [300, 300, 200, None]
    assert copiers[0].fans_out_with(copiers[1]) and not copiers[3].fans_out_with(copiers[0])
    want = [[cp.array(a) for a in d] for d in dsts]
    rng = np.random.default_rng(4)
    counts = []
    for rnd, sizes in enumerate([(200, 0, 150, 100), (190, 7, 140, 90), (201, 64, 1, 0)]):
        jobs = []
        for c, d, w, n in zip(copiers, dsts, want, sizes):
            sidx = rng.integers(0, 600, n)
            didx = rng.permutation(int(d[0].shape[0]))[:n]
            for s_, w_ in zip(src, w):
                w_[cp.asarray(didx)] = s_[cp.asarray(sidx)]
            jobs.append((c, sidx, didx))
        fan = [j for j in jobs if j[0].uniform_rows is not None]
        before, phases = compile_count(), []
        assert copy_fanout(fan, checked=rnd == 1, on_phase=phases.append) == sum(len(j[1]) for j in fan)
        counts.append(compile_count() - before)
        assert phases == ["checked", "staged"]  # the one-launch path, its host phases in order
        jobs[3][0].copy(jobs[3][1], jobs[3][2])  # the per-layer destination on its own
    for d in dsts:
        synchronize(d)
    for d, w in zip(dsts, want):
        for a, b in zip(d, w):
            assert bool(cp.array_equal(a, b))
    assert counts[0] <= 1 and counts[1:] == [0, 0], counts


def test_warm_copy_fanout_then_no_compile_whichever_ranks_have_rows():
    """`warm_copy_fanout` compiles the launch of these copiers for every bucket up to max_rows
    and writes nothing; later rounds of any sizes, any subset of copiers with rows (the others
    listed with none, as the sender lists them), compile nothing and land byte-exact."""
    from pallas_kernels import compile_log, warm_copy_fanout

    L, item = 4, 1152
    src, _ = _one_buffer(500, item, L, 3)
    source = PackSource(src)
    dsts = [_flat_foreign(256, item, L, 0x10 + k) for k in range(3)]
    copiers = [RowCopier(source, d) for d in dsts]
    want = [[cp.array(a) for a in d] for d in dsts]
    assert warm_copy_fanout(copiers, 700) == [64, 128, 256, 512, 1024]
    synchronize([d[0] for d in dsts])
    for d, w in zip(dsts, want):
        for a, b in zip(d, w):
            assert bool(cp.array_equal(a, b))
    count = compile_count()
    rng = np.random.default_rng()
    empty = np.empty(0, np.int64)
    for sizes in [(200, 0, 0), (0, 5, 256), (64, 64, 64), (1, 0, 1), (256, 256, 100)]:
        jobs = []
        for c, d, w, n in zip(copiers, dsts, want, sizes):
            sidx, didx = rng.integers(0, 500, n), rng.permutation(256)[:n]
            for s_, w_ in zip(src, w):
                w_[cp.asarray(didx)] = s_[cp.asarray(sidx)]
            jobs.append((c, sidx if n else empty, didx if n else empty))
        copy_fanout(jobs, checked=True)
    synchronize([d[0] for d in dsts])
    for d, w in zip(dsts, want):
        for a, b in zip(d, w):
            assert bool(cp.array_equal(a, b))
    assert compile_count() == count, compile_log()[-3:]


def test_copy_fanout_one_launch_for_a_source_past_2_31_words():
    """A source stack of 9.2 GB (61 layers x 131,072 rows x 1,152 B: 2.30e9 words, the 128k-token
    job's prefill cache) is read as two layer groups, one fan-out launch each (it fell back to
    one launch per destination before), byte-exact in every layer of both groups, rows at both
    ends of the source included."""
    L, R, item = 61, 131072, 1152
    src = cp.random.randint(0, 256, (L, R, item), dtype=cp.uint8)
    source = PackSource([src[l] for l in range(L)])
    assert [int(g.shape[0]) for g in source.stacked_groups()] == [31, 30]
    dsts = [_flat_foreign(rows, item, L, 0x60 + k) for k, rows in enumerate((512, 300, 64))]
    copiers = [RowCopier(source, d) for d in dsts]
    rng = np.random.default_rng()
    jobs = []
    for c, d in zip(copiers, dsts):
        n = min(len(d[0]), 257)
        sidx = np.r_[R - 1, 0, rng.integers(0, R, n - 2)]
        jobs.append((c, sidx, rng.permutation(len(d[0]))[:n]))
    want = [[cp.array(a) for a in d] for d in dsts]
    for (_, s, t), w in zip(jobs, want):
        for l in range(L):
            w[l][cp.asarray(t)] = src[l][cp.asarray(s)]
    phases = []
    assert copy_fanout(jobs, checked=True, on_phase=phases.append) == sum(len(j[1]) for j in jobs)
    assert phases == ["checked", "staged"]  # the fan-out path, not one launch per destination
    synchronize([d[0] for d in dsts])
    for d, w in zip(dsts, want):
        for l in range(L):
            assert bool(cp.array_equal(d[l], w[l])), f"layer {l}"
