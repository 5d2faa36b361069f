"""End-to-end variants of `benchmarks/pack.py`: the public calls on CuPy buffers, as a caller
(the connector) makes them, timed beside the bare kernels of the same run.

Each variant is a `(name, kind, config, note, make)` entry of pack.py's final table, `make()`
returning `(step, sync, final)`: `step` is one public call, `sync` what completes it, `final`
checks the bytes. pack.py reports kernel time (CUPTI: every kernel and copy the call launched)
and wall time per call over back-to-back calls; `wall_over_kernel` is their ratio, the fixed
host cost of the call (issue 13 item 4 wants <= 1.3 for the per-rank `pack_rows`).
"""

from __future__ import annotations

import numpy as np


def e2e_variants(*, cp, jax, layers_cp, idx_np, P, n, L, W, cfg, poison, check_words, stacked=None):
    """The end-to-end entries for one geometry (layers_cp: CuPy u8[R, 4W] per layer; ``stacked``:
    the same rows as one [L, R, W] u32 device array, viewed (not copied) for the one-buffer
    variants: a copy of a 61-layer DeepSeek-V3 cache is 18.4 GB, past an 80 GB H100's memory
    beside the others)."""
    from pallas_kernels import copy_rows, pack_rows, synchronize, unpack_rows

    finals = []
    item = 4 * W

    def pack_variant(sync, host_idx, layers=layers_cp):
        pack_cp = cp.full(P, poison, dtype=cp.uint32).view(cp.uint8)
        idx = idx_np if host_idx else cp.asarray(idx_np)
        ptr0 = pack_cp.data.ptr

        def step():
            pack_rows(layers, idx, pack_cp, offset=0, config=cfg, sync=sync)
        done = None if sync else (lambda: synchronize([pack_cp]))
        return step, done, (lambda: (synchronize([pack_cp]), pack_cp.data.ptr == ptr0
                                     and check_words(jax.dlpack.from_dlpack(
                                         pack_cp.view(cp.uint32))))[1])

    finals.append(("pack_rows e2e, host idx, async", "e2e", repr(cfg),
                   "numpy indices (as the connector passes them), sync=False: back-to-back "
                   "calls, one synchronize at the end", lambda: pack_variant(False, True)))
    finals.append(("pack_rows e2e, host idx, sync", "e2e", repr(cfg),
                   "sync=True: every call waits for its kernel", lambda: pack_variant(True, True)))
    finals.append(("pack_rows e2e, cupy idx, sync", "e2e", repr(cfg),
                   "CuPy indices: checked on the device (one sync)",
                   lambda: pack_variant(True, False)))

    # Destinations: layers of ONE CuPy buffer (as a decode rank's cache is allocated), each viewed
    # through UnownedMemory as IPC-mapped pages of another process arrive
    # (bridge.cuda_ipc.IpcMapping); rows idx of each are written. Every variant below writes the
    # same rows with the same bytes, so they share it (a second 18.4 GB buffer for the RowCopier
    # ran an 80 GB H100 out of memory).
    R = int(layers_cp[0].shape[0])
    dst_owner = cp.full(L * R * item, 0x5A, cp.uint8)
    owners = [dst_owner[l * R * item:(l + 1) * R * item].reshape(R, item) for l in range(L)]

    def foreign(a):
        mem = cp.cuda.UnownedMemory(a.data.ptr, a.nbytes, a, a.device.id)
        return cp.ndarray(a.shape, a.dtype, cp.cuda.MemoryPointer(mem, 0))

    dst = [foreign(a) for a in owners]
    region = cp.empty(L * n * item, cp.uint8)
    pack_rows(layers_cp, idx_np, region, config=cfg)
    idx_cp = cp.asarray(idx_np)

    def rows_match():
        synchronize(dst)
        return all(bool(cp.array_equal(d[idx_cp], s[idx_cp])) for d, s in zip(dst, layers_cp))

    def unpack_variant(sync):
        def step():
            unpack_rows(region, dst, idx_np, config=cfg)
            if sync:
                synchronize(dst)
        return step, (lambda: synchronize(dst)), rows_match

    def copy_variant(sync):
        def step():
            copy_rows(layers_cp, idx_np, dst, idx_np, config=cfg)
            if sync:
                synchronize(dst)
        return step, (lambda: synchronize(dst)), rows_match

    finals.append(("unpack_rows e2e, async", "e2e", repr(cfg),
                   "receive region -> UnownedMemory layers, numpy indices (unique: checked)",
                   lambda: unpack_variant(False)))
    finals.append(("unpack_rows e2e, sync", "e2e", repr(cfg), "+ synchronize per call",
                   lambda: unpack_variant(True)))
    finals.append(("copy_rows e2e, async", "e2e", repr(cfg),
                   "prefill layers -> UnownedMemory layers, one kernel for all layers",
                   lambda: copy_variant(False)))
    finals.append(("copy_rows e2e, sync", "e2e", repr(cfg), "+ synchronize per call",
                   lambda: copy_variant(True)))

    # A layer-major cache (every layer a view of one buffer, as the connector's job and most
    # engines allocate it): pack_rows reads ONE stacked source view, and a RowCopier copies
    # into a one-buffer destination through one flat handle (the fused path's per-rank call).
    from pallas_kernels import RowCopier

    if stacked is not None:  # read only: the one-buffer variants never write their source
        one = cp.from_dlpack(stacked).view(cp.uint8).reshape(-1)
    else:
        one = cp.concatenate([a.reshape(-1) for a in layers_cp])
    layers_one = [one[l * R * item:(l + 1) * R * item].reshape(R, item) for l in range(L)]
    finals.append(("pack_rows e2e, one-buffer layers, host idx, async", "e2e", repr(cfg),
                   "layers are views of one buffer: one stacked source argument",
                   lambda: pack_variant(False, True, layers_one)))
    from pallas_kernels import PackSource

    source_one = PackSource(layers_one)
    finals.append(("pack_rows e2e, PackSource of one-buffer layers, host idx, async", "e2e", repr(cfg),
                   "a PackSource (checked and imported once, as the connector holds its cache): "
                   "the per-call work is the indices, the offset and the dispatch",
                   lambda: pack_variant(False, True, source_one)))
    dst_one = dst  # the layers of the one buffer above

    def copier_variant():
        copier = RowCopier(layers_one, dst_one, config=cfg)

        def step():
            copier.copy(idx_np, idx_np, checked=True)

        def match():
            synchronize(dst_one)
            return all(bool(cp.array_equal(d[idx_cp], s[idx_cp])) for d, s in zip(dst_one, layers_cp))
        return step, (lambda: synchronize(dst_one)), match

    finals.append(("RowCopier e2e, one-buffer src + dst, async", "e2e", repr(cfg),
                   "the fused path's per-rank call: stacked source, flat destination, checks once",
                   copier_variant))

    def cupy_copy_variant():
        def step():
            copy_rows(layers_cp, idx_cp, dst, idx_cp, backend="cupy", checked=True)
        return step, (lambda: synchronize(dst)), rows_match

    finals.append(("copy_rows cupy fancy-index (reference)", "peer", None,
                   "one CuPy gather + scatter per layer", cupy_copy_variant))
    return finals


def e2e_claims(geo_rows) -> dict:
    """wall / kernel of each end-to-end row, and the item-4 target on the async pack."""
    out = {}
    kernel_list = [r["ms"] for r in geo_rows if r.get("variant", "").startswith(
        "pallas-triton list") and "ms" in r]
    for r in geo_rows:
        if r.get("kind") == "e2e" and "ms" in r:
            out[r["variant"]] = {"wall_ms": r["wall_ms"], "kernel_ms": r["ms"],
                                 "wall_over_kernel": r["wall_ms"] / r["ms"],
                                 "wall_gbps": r["wall_gbps"], "bit_exact": r["bit_exact"]}
            if kernel_list:
                out[r["variant"]]["wall_over_bare_list_kernel"] = r["wall_ms"] / min(kernel_list)
    key = "pack_rows e2e, host idx, async"
    if key in out:
        out["pack_rows_wall_over_kernel_le_1_3"] = out[key]["wall_over_kernel"] <= 1.3
    key = "pack_rows e2e, one-buffer layers, host idx, async"
    if key in out:
        out["pack_rows_one_buffer_wall_over_kernel_le_1_3"] = out[key]["wall_over_kernel"] <= 1.3
    key = "pack_rows e2e, PackSource of one-buffer layers, host idx, async"
    if key in out:
        out["pack_rows_pack_source_wall_over_kernel_le_1_3"] = out[key]["wall_over_kernel"] <= 1.3
    return out


__all__ = ["e2e_claims", "e2e_variants", "np"]
