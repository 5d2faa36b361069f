"""Benchmark the LSE merge (and DCP MLA decode attention) on one device.

One command on the GPU machine::

    python benchmarks/merge.py --json benchmarks/results/merge_h200.json \
        --md benchmarks/results/merge_h200.md

Default shapes: N = 8 partials, H = 128 heads, D = 512 (MLA latent), T in 1..256 tokens, bf16 and
float32. For each shape it reports the median time of ``dcp_jax.merge.merge_states`` (jitted), the
merge's bandwidth (bytes read + written: ``N*T*H*(D*s + 4)`` in, ``T*H*(D*s + 4)`` out, ``s`` =
bytes per element), a device-to-device copy moving the same number of bytes (JAX ``jnp.copy``
and, if torch is present, ``torch.Tensor.copy_``), and the same merge in PyTorch (the project's
reference, ``dcp_jax.crosscheck.torch_merge_reference``, eager) on the same device, plus the
cross-check error of our result against it.

``--small`` runs tiny shapes so the script can be tested on a CPU-only machine. torch is
optional (columns left empty without it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Let torch and JAX share the GPU: no 75% up-front grab by XLA.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dcp_jax import attention, merge  # noqa: E402

FULL = dict(n=8, h=128, d=512, tokens=(1, 8, 32, 64, 128, 256))
SMALL = dict(n=8, h=16, d=64, tokens=(1, 4, 16))
ATTN_FULL = dict(batch=(1, 32), kv_len=4096, h=128, page_size=64)
ATTN_SMALL = dict(batch=(2,), kv_len=64, h=16, page_size=8)
TARGET_COPY_FRACTION = 0.70  # issue 5: merge >= 70% of the copy bandwidth at the largest shape


def _try_torch():
    try:
        import torch
    except ModuleNotFoundError:
        return None
    return torch


def _median_seconds(fn, block, *, iters: int, reps: int) -> float:
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls (launches overlap)."""
    block(fn())  # compile / warm up
    block(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            res = fn()
        block(res)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _jax_block(x):
    jax.block_until_ready(x)


def merge_bytes(n: int, t: int, h: int, d: int, itemsize: int) -> int:
    """Bytes read + written by one merge: N partials in, one state out (LSE float32)."""
    return n * t * h * (d * itemsize + 4) + t * h * (d * itemsize + 4)


def bench_merge_row(n, t, h, d, dtype, *, iters, reps, torch, seed=0):
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    out = jax.random.normal(k1, (n, t, h, d), jnp.float32).astype(dtype)
    lse = jax.random.normal(k2, (n, t, h), jnp.float32) * 5.0
    lse = lse.at[1].set(-jnp.inf)  # one empty rank, as with short requests
    fn = jax.jit(lambda o, l: merge.merge_states(o, l))
    t_merge = _median_seconds(lambda: fn(out, lse), _jax_block, iters=iters, reps=reps)
    nbytes = merge_bytes(n, t, h, d, jnp.dtype(dtype).itemsize)

    # A device-to-device copy moving the same bytes (read + write = nbytes).
    src = jnp.ones((max(1, nbytes // 8),), jnp.float32)
    copy = jax.jit(jnp.copy)
    t_copy_jax = _median_seconds(lambda: copy(src), _jax_block, iters=iters, reps=reps)
    row = {
        "N": n, "T": t, "H": h, "D": d, "dtype": jnp.dtype(dtype).name, "bytes_rw": nbytes,
        "merge_us": t_merge * 1e6, "merge_GBps": nbytes / t_merge / 1e9,
        "copy_jax_us": t_copy_jax * 1e6, "copy_jax_GBps": nbytes / t_copy_jax / 1e9,
    }
    if torch is not None:
        from dcp_jax.crosscheck import crosscheck_merge, torch_merge_reference

        sync = (lambda x: torch.cuda.synchronize()) if torch.cuda.is_available() else (lambda x: None)
        out_t, lse_t = torch.from_dlpack(out), torch.from_dlpack(lse)  # same memory, same device
        t_torch = _median_seconds(lambda: torch_merge_reference(out_t, lse_t), sync,
                                  iters=iters, reps=reps)
        src_t = torch.from_dlpack(src)
        dst_t = torch.empty_like(src_t)
        t_copy_t = _median_seconds(lambda: dst_t.copy_(src_t), sync, iters=iters, reps=reps)
        rep = crosscheck_merge(out_t, lse_t)
        row.update({
            "torch_us": t_torch * 1e6, "speedup_vs_torch": t_torch / t_merge,
            "copy_torch_us": t_copy_t * 1e6, "copy_torch_GBps": nbytes / t_copy_t / 1e9,
            "crosscheck_max_rel_err": rep.max_rel_err, "crosscheck_passed": rep.passed(
                1e-6 if row["dtype"] == "float32" else 1e-2),
        })
    copy_bw = max(row["copy_jax_GBps"], row.get("copy_torch_GBps", 0.0))
    row["copy_GBps"] = copy_bw
    row["merge_frac_of_copy"] = row["merge_GBps"] / copy_bw
    return row


def bench_attention_row(batch, kv_len, h, page_size, dtype, *, n, iters, reps, seed=0):
    """DCP MLA decode (all N ranks emulated on this device) at one decode step, Q = 1."""
    rng = np.random.default_rng(seed)
    dl, dr = 512, 64
    kv_lens = np.full((batch,), kv_len, np.int64)
    kv = rng.standard_normal((batch, kv_len, dl + dr), dtype=np.float32)
    cache, pt = attention.paginate_kv(kv, kv_lens, dcp_size=n, page_size=page_size, shuffle_seed=seed)
    cache = jnp.asarray(cache, dtype)
    ql = jnp.asarray(rng.standard_normal((batch, 1, h, dl)), dtype)
    qr = jnp.asarray(rng.standard_normal((batch, 1, h, dr)), dtype)
    pt, kv_lens_j = jnp.asarray(pt), jnp.asarray(kv_lens, jnp.int32)
    scale = 1 / np.sqrt(192)
    o, _ = attention.dcp_mla_decode_emulated(ql, qr, cache, pt, kv_lens_j, softmax_scale=scale)  # checked once
    # Timed jitted, as a serving step runs it: the eager call also checks the page table on the host.
    jf = jax.jit(lambda *a: attention.dcp_mla_decode_emulated(*a, softmax_scale=scale))
    f = lambda: jf(ql, qr, cache, pt, kv_lens_j)  # noqa: E731
    t = _median_seconds(f, _jax_block, iters=iters, reps=reps)
    ref_o, _ = attention.mla_decode_reference(ql[:1], qr[:1], np.asarray(jnp.asarray(kv[:1], dtype)),
                                              kv_lens[:1], softmax_scale=scale)
    err = float(np.abs(np.asarray(o[:1], np.float64) - ref_o).max() / np.abs(ref_o).max())
    kv_bytes = batch * kv_len * (dl + dr) * jnp.dtype(dtype).itemsize
    return {"N": n, "B": batch, "kv_len": kv_len, "H": h, "dtype": jnp.dtype(dtype).name,
            "attn_us": t * 1e6, "kv_GBps": kv_bytes / t / 1e9, "rel_err_vs_f64": err}


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def merge_table(rows) -> str:
    head = ("| dtype | N | T | H | D | MB r+w | merge us | merge GB/s | copy GB/s | % of copy "
            "| torch us | x vs torch | xcheck rel err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['N']} | {r['T']} | {r['H']} | {r['D']} | {r['bytes_rw'] / 1e6:.1f} "
            f"| {r['merge_us']:.1f} | {r['merge_GBps']:.0f} | {r['copy_GBps']:.0f} "
            f"| {100 * r['merge_frac_of_copy']:.0f}% | {_fmt(r.get('torch_us'), '.1f')} "
            f"| {_fmt(r.get('speedup_vs_torch'), '.2f')} | {_fmt(r.get('crosscheck_max_rel_err'), '.1e')} |")
    return "\n".join(lines)


def attention_table(rows) -> str:
    lines = ["| dtype | N | B | kv_len | H | time us | KV GB/s | rel err vs f64 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['N']} | {r['B']} | {r['kv_len']} | {r['H']} "
                     f"| {r['attn_us']:.1f} | {r['kv_GBps']:.0f} | {r['rel_err_vs_f64']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--json", type=Path, help="write all rows as JSON here")
    ap.add_argument("--md", type=Path, help="write the tables as Markdown here")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", default=None, help="comma-separated T values (default per mode)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing sample")
    ap.add_argument("--reps", type=int, default=None, help="timing samples (median taken)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch columns")
    ap.add_argument("--no-attention", action="store_true", help="skip the DCP attention rows")
    args = ap.parse_args(argv)

    shapes = dict(SMALL if args.small else FULL)
    if args.tokens:
        shapes["tokens"] = tuple(int(x) for x in args.tokens.split(","))
    attn = ATTN_SMALL if args.small else ATTN_FULL
    iters = args.iters or (3 if args.small else 20)
    reps = args.reps or (3 if args.small else 15)
    torch = None if args.no_torch else _try_torch()
    dtypes = [jnp.dtype(s) for s in args.dtypes.split(",")]
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"torch {getattr(torch, '__version__', None)}", flush=True)

    rows = []
    for dtype in dtypes:
        for t in shapes["tokens"]:
            rows.append(bench_merge_row(shapes["n"], t, shapes["h"], shapes["d"], dtype,
                                        iters=iters, reps=reps, torch=torch))
            print(f"  merge {dtype.name} T={t}: {rows[-1]['merge_us']:.1f} us, "
                  f"{rows[-1]['merge_GBps']:.0f} GB/s ({100 * rows[-1]['merge_frac_of_copy']:.0f}% of copy)",
                  flush=True)
    attn_rows = []
    if not args.no_attention:
        for dtype in dtypes:
            for b in attn["batch"]:
                attn_rows.append(bench_attention_row(b, attn["kv_len"], attn["h"], attn["page_size"],
                                                     dtype, n=shapes["n"], iters=max(1, iters // 4),
                                                     reps=max(3, reps // 3)))
    print("\nLSE merge (merge_states, jitted)\n" + merge_table(rows))
    if attn_rows:
        print("\nDCP MLA decode, N ranks emulated on one device\n" + attention_table(attn_rows))

    largest = [r for r in rows if r["T"] == max(shapes["tokens"])]
    verdicts = {r["dtype"]: r["merge_frac_of_copy"] >= TARGET_COPY_FRACTION for r in largest}
    for r in largest:
        ok = "PASS" if verdicts[r["dtype"]] else "FAIL"
        print(f"{ok}: {r['dtype']} T={r['T']} merge at {100 * r['merge_frac_of_copy']:.0f}% of copy "
              f"bandwidth (target {100 * TARGET_COPY_FRACTION:.0f}%)")

    meta = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "torch": getattr(torch, "__version__", None), "python": platform.python_version(),
            "small": args.small, "iters": iters, "reps": reps,
            "target_copy_fraction": TARGET_COPY_FRACTION, "largest_shape_pass": verdicts}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "merge": rows, "attention": attn_rows},
                                        indent=1))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(f"# LSE merge benchmark ({dev.device_kind})\n\n"
                           f"jax {jax.__version__}, torch {meta['torch']}; median of {reps} x "
                           f"{iters} calls.\n\n{merge_table(rows)}\n\n"
                           f"## DCP MLA decode (N ranks emulated on one device)\n\n"
                           f"{attention_table(attn_rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
