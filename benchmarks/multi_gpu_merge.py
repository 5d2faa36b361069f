"""The DCP decode merge across devices: ``ag_rs``, ``ag_ar``, ``a2a`` over a JAX mesh, vs one device.

    python benchmarks/multi_gpu_merge.py --json out/merge_mesh.json --md out/merge_mesh.md

A mesh of N devices (default: every device JAX sees, N reduced to the largest divisor of the head
count; on a GPU host the GPUs, the collectives then NCCL; on CPU, ``XLA_FLAGS=
--xla_force_host_platform_device_count=8`` gives 8). For one DeepSeek-V3 decode step (absorbed
MLA, H heads, latent 512 + rope 64, B requests of ``--kv-len`` cached tokens, paged with
``--page-size`` tokens per page, token round-robin over the N ranks) and each combine:

- ``decode step``: `dcp_jax.attention.dcp_mla_decode` (all-gather of the query heads, each rank's
  partial attention over its own pages, the merge); equal to the single-device float64
  reference `mla_decode_reference` within rtol 1e-5, atol 1e-5 * max|ref| (the merge tests'
  float32 tolerance);
- ``merge only``: `dcp_jax.merge.ag_rs` / `ag_ar` / `a2a` of N stacked float32 partials [N, B, H,
  512] (one per device), equal to `merge_states_reference` within rtol 1e-5, atol 1e-5.

Time: median over ``--reps`` of the mean of ``--iters`` back-to-back calls on inputs already on the
mesh (microseconds per decode step). ``--emulate N`` adds the same step with N ranks emulated on
device 0 (`dcp_mla_decode_emulated`: the DCP math of N ranks, no collective): with one GPU this is
the rehearsal's DCP8 figure. Exit status 1 when a result is not equal.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dcp_jax import attention, merge  # noqa: E402

DL, DR = 512, 64  # DeepSeek-V3 absorbed MLA: latent and rope widths
TOL = 1e-5  # float32, as tests/gpu/test_merge_gpu.py


def mesh_size(devices: int, heads: int) -> int:
    """The largest N <= ``devices`` that divides ``heads`` (the combines shard heads over N).

    Raises:
        ValueError: ``devices`` or ``heads`` < 1.
    """
    if devices < 1 or heads < 1:
        raise ValueError(f"devices={devices} and heads={heads} must be >= 1")
    return max(n for n in range(1, devices + 1) if heads % n == 0)


def _median_us(fn, *, iters: int, reps: int) -> float:
    jax.block_until_ready(fn())  # compile, warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            res = fn()
        jax.block_until_ready(res)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times) * 1e6


def _rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def _close(got, ref) -> bool:
    return bool(np.allclose(np.asarray(got, np.float64), ref, rtol=TOL, atol=TOL * np.abs(ref).max()))


def run(n: int, *, batch: int, kv_len: int, heads: int, page_size: int, forms, iters: int, reps: int,
        emulate: int = 0, seed: int = 0) -> dict:
    """Every combine on a mesh of the first ``n`` devices; see the module doc for the rows."""
    rng = np.random.default_rng(seed)
    devs = jax.devices()[:n]
    mesh = merge.make_dcp_mesh(n, devices=devs)
    kv_lens = np.full((batch,), kv_len, np.int64)
    kv_lens[0] = max(1, kv_len // 3)  # unequal requests: ranks hold different token counts
    kv = rng.standard_normal((batch, kv_len, DL + DR), dtype=np.float32)
    ql = rng.standard_normal((batch, 1, heads, DL), dtype=np.float32)
    qr = rng.standard_normal((batch, 1, heads, DR), dtype=np.float32)
    scale = 1 / np.sqrt(DL // 4 + DR)  # 1/sqrt(192): DeepSeek-V3's qk head dim
    ref_o, _ = attention.mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=scale)
    cache, pt = attention.paginate_kv(kv, kv_lens, dcp_size=n, page_size=page_size, fill=np.nan, shuffle_seed=seed)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731 - inputs live on the mesh
    args = (put(ql, P(None, None, "dcp")), put(qr, P(None, None, "dcp")), put(cache, P("dcp")), put(pt, P("dcp")),
            put(jnp.asarray(kv_lens, jnp.int32), P()))
    # Merge-only inputs: N float32 partials of the B decode tokens, one per device, some ranks empty.
    part = rng.standard_normal((n, batch, heads, DL), dtype=np.float32)
    lse = (rng.standard_normal((n, batch, heads)) * 5).astype(np.float32)
    if n > 1:
        lse[1, 0] = -np.inf
    ref_mo, _ = merge.merge_states_reference(part.astype(np.float64), lse)
    mparts = (put(part, P("dcp")), put(lse, P("dcp")))
    rows = []
    for form in forms:
        o, _ = attention.dcp_mla_decode(*args[:4], args[4], softmax_scale=scale, mesh=mesh, merge=form)  # checked once
        # Timed jitted, as a serving step runs it: the eager call also checks the page table on the host.
        jstep = jax.jit(lambda *a, f=form: attention.dcp_mla_decode(*a, softmax_scale=scale, mesh=mesh, merge=f))
        step = lambda j=jstep: j(*args[:5])  # noqa: E731
        mfn = getattr(merge, form)
        mo, _ = mfn(*mparts, mesh=mesh)
        rows.append({"combine": form, "devices": n, "step_us": _median_us(step, iters=iters, reps=reps),
                     "step_rel_err": _rel_err(o, ref_o), "step_equal": _close(o, ref_o),
                     "merge_us": _median_us(lambda f=mfn: f(*mparts, mesh=mesh), iters=iters, reps=reps),
                     "merge_rel_err": _rel_err(mo, ref_mo),
                     "merge_equal": bool(np.allclose(np.asarray(mo, np.float64), ref_mo, rtol=TOL, atol=TOL))})
    out = {"rows": rows, "shape": {"batch": batch, "kv_len": kv_len, "kv_lens": kv_lens.tolist(), "heads": heads,
                                   "latent": DL, "rope": DR, "page_size": page_size, "dtype": "float32"}}
    if emulate:
        ecache, ept = attention.paginate_kv(kv, kv_lens, dcp_size=emulate, page_size=page_size, fill=np.nan)
        eargs = [jax.device_put(x, devs[0]) for x in (ql, qr, ecache, ept, jnp.asarray(kv_lens, jnp.int32))]
        o, _ = attention.dcp_mla_decode_emulated(*eargs, softmax_scale=scale)  # checked once
        jestep = jax.jit(lambda *a: attention.dcp_mla_decode_emulated(*a, softmax_scale=scale))
        estep = lambda: jestep(*eargs)  # noqa: E731
        out["emulated"] = {"ranks": emulate, "device": str(devs[0]), "step_us": _median_us(estep, iters=iters, reps=reps),
                           "step_rel_err": _rel_err(o, ref_o), "step_equal": _close(o, ref_o)}
    out["all_equal"] = all(r["step_equal"] and r["merge_equal"] for r in rows) and \
        out.get("emulated", {}).get("step_equal", True)
    return out


def table(res: dict) -> str:
    lines = ["| combine | devices | decode step us | step rel err | equal | merge only us | merge rel err | equal |",
             "|---|---:|---:|---:|---|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['combine']} | {r['devices']} | {r['step_us']:,.1f} | {r['step_rel_err']:.1e} | "
                     f"{'yes' if r['step_equal'] else 'NO'} | {r['merge_us']:,.1f} | {r['merge_rel_err']:.1e} | "
                     f"{'yes' if r['merge_equal'] else 'NO'} |")
    e = res.get("emulated")
    if e:
        lines.append(f"| (emulated, {e['ranks']} ranks on {e['device']}) | 1 | {e['step_us']:,.1f} | "
                     f"{e['step_rel_err']:.1e} | {'yes' if e['step_equal'] else 'NO'} | - | - | - |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=None, help="mesh devices (default: all; reduced to divide --heads)")
    ap.add_argument("--batch", type=int, default=4, help="requests B in the decode step")
    ap.add_argument("--kv-len", type=int, default=8192, help="cached tokens per request (the first has a third)")
    ap.add_argument("--heads", type=int, default=128, help="attention heads H (DeepSeek-V3: 128)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--forms", default=",".join(merge.MERGE_FORMS), help="comma list of ag_rs, ag_ar, a2a")
    ap.add_argument("--emulate", type=int, default=0, help="also N ranks emulated on device 0 (0: no)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    forms = [f.strip() for f in args.forms.split(",")]
    if any(f not in merge.MERGE_FORMS for f in forms):
        ap.error(f"--forms={args.forms!r} must name {', '.join(merge.MERGE_FORMS)}")
    for name in ("batch", "kv_len", "heads", "page_size", "iters", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    have = len(jax.devices())
    if args.devices is not None and not 1 <= args.devices <= have:
        ap.error(f"--devices={args.devices}: JAX sees {have} device(s)")
    n = mesh_size(args.devices or have, args.heads)
    res = run(n, batch=args.batch, kv_len=args.kv_len, heads=args.heads, page_size=args.page_size, forms=forms,
              iters=args.iters, reps=args.reps, emulate=args.emulate)
    d0 = jax.devices()[0]
    res["meta"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "platform": d0.platform, "device_kind": d0.device_kind, "devices_seen": have, "mesh_devices": n,
                   "jax": jax.__version__, "python": platform.python_version(), "iters": args.iters, "reps": args.reps}
    text = (f"# DCP decode merge over a mesh of {n} {d0.device_kind} device(s) ({res['meta']['date']}, jax "
            f"{jax.__version__})\n\nB={args.batch}, kv_len={args.kv_len}, H={args.heads}, page {args.page_size}, "
            f"float32; median of {args.reps} x {args.iters} calls.\n\n{table(res)}\n")
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print("all equal" if res["all_equal"] else "NOT EQUAL")
    return 0 if res["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
