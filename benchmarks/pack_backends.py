"""Pack backends of the registry side by side, and the staged path's GB/s beside the direct one.

    python benchmarks/pack_backends.py --md benchmarks/results/pack_backends_cpu.md \
        --json benchmarks/results/pack_backends_cpu.json
    # on a GPU (source scripts/gpu_env.sh first): --device gpu --backends xla,gpu-triton,gpu-mosaic
    # scripts/gpu_suite.sh runs part 1 alone (--part backends, step pack_backends)

Part 1, backends: for one DeepSeek-V3 rank pack (61 layers of 1,152-byte rows gathered by a
shuffled index into one layer-major region), each named backend of `pallas_kernels.registry`
runs `pack_region` on arrays of its kind on this device; median wall time per call over
``--repeats`` calls after one warm-up call (the compile), every result compared byte for byte with
the numpy gather of the whole pack and, first, with `reference_region` on a small slice. Times
are synchronised wall seconds per call (kernel + dispatch). GB/s counts bytes read + written
(2 x the pack).

Part 2, paths: the main job (`dcp_jax.job.run_job`, real processes and engines) once with
``staging="none"`` and once with ``staging="host"`` per engine, both on the region path (the one
path two staged sides take), so the rows differ only by staging; GB/s as the job reports it
(bytes / the prefill's total seconds, staging included), with the stage and unstage seconds.
Every run is verified byte for byte by the decode ranks.

The JSON is rewritten after every row (a run stopped at its time limit keeps what it measured);
exit status 1 when a backend failed, differed from the reference, or a run was not verified.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import numpy as np


def _arrays(kind: str, device: str, layers_np, pack_bytes: int):
    if kind == "numpy":
        return layers_np, np.zeros(pack_bytes, np.uint8)
    if kind == "cupy":
        import cupy as cp

        return [cp.asarray(a) for a in layers_np], cp.zeros(pack_bytes, cp.uint8)
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    return [jax.device_put(a, dev) for a in layers_np], jax.device_put(jnp.zeros(pack_bytes, jnp.uint8), dev)


def _host(a) -> np.ndarray:
    if type(a).__module__.split(".")[0] == "cupy":
        return a.get()
    return np.asarray(a)


def _sync(a) -> None:
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()
    elif hasattr(a, "block_until_ready"):
        a.block_until_ready()


def bench_backends(names, device: str, rows: int, pool_rows: int, layers: int, item: int, repeats: int,
                   out: list | None = None, saved=lambda: None) -> list[dict]:
    from pallas_kernels import pack_region
    from pallas_kernels.registry import get_backend, reference_region

    rng = np.random.default_rng(0)
    layers_np = [rng.integers(0, 256, (pool_rows, item), dtype=np.uint8) for _ in range(layers)]
    idx = rng.permutation(pool_rows)[:rows].astype(np.int64)
    nbytes = rows * item * layers
    small = reference_region(layers_np[:2], idx[:64], np.zeros(64 * item * 2, np.uint8))
    want = None
    out = [] if out is None else out
    for name in names:
        try:
            b = get_backend(name)
        except ValueError as exc:  # a name that does not exist: an error row, the others still run
            out.append(dict(backend=name, kind="-", error=str(exc)[:300]))
            print(out[-1], flush=True)
            saved()
            continue
        kinds = b.kinds
        kind = ("cupy" if "cupy" in kinds else "jax") if device == "gpu" else ("jax" if "jax" in kinds else "numpy")
        row = dict(backend=name, kind=kind)
        why = b.unavailable()
        if why:
            out.append(dict(row, error=why))
            print(out[-1], flush=True)
            saved()
            continue
        try:
            src, pack = _arrays(kind, device, layers_np, nbytes)
            s2, p2 = _arrays(kind, device, layers_np[:2], 64 * item * 2)
            if not np.array_equal(_host(pack_region(s2, idx[:64], p2, backend=name)), small):
                raise AssertionError("differs from reference_region")
            t0 = time.perf_counter()
            res = pack_region(src, idx, pack, backend=name)
            _sync(res)
            first = time.perf_counter() - t0
            got = _host(res)
            if want is None:
                want = np.concatenate([a[idx].reshape(-1) for a in layers_np])
            if not np.array_equal(got, want):
                raise AssertionError("pack differs from the numpy gather")
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = pack_region(src, idx, pack, backend=name)
                _sync(res)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            out.append(dict(row, first_call_s=first, median_s=med, min_s=min(times), bytes=nbytes,
                            gbps=2 * nbytes / med / 1e9, exact=True))
        except Exception as exc:  # noqa: BLE001 - one backend failing must not hide the others
            out.append(dict(row, error=f"{type(exc).__name__}: {exc}"[:300]))
        print(out[-1], flush=True)
        saved()
    return out


def bench_paths(engines, device: str, tokens: int, dcp: int, out: list | None = None, saved=lambda: None,
                timeout_s: float = 120.0) -> list[dict]:
    from dcp_jax.job import JobConfig, run_job

    out = [] if out is None else out
    for engine in engines:
        for staging in ("none", "host"):
            row = dict(engine=engine, staging=staging)
            try:
                cfg = JobConfig(model="deepseek-v3", prompt_tokens=tokens, page_size=64, dcp_size=dcp,
                                modes=("region",), engine=engine, device=device, staging=staging,
                                timeout_s=timeout_s)
                run = run_job(cfg)["runs"][0]
                row.update(verified=run["verified"], bytes=run["bytes"], total_s=run["total_seconds"],
                           gbps=run["gbps"], stage_s=run["stage_seconds"], unstage_s=run["unstage_seconds"],
                           path=run["staging"])
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(row, flush=True)
            out.append(row)
            saved()
    return out


def _versions() -> dict:
    import jax

    return dict(python=platform.python_version(), jax=jax.__version__, numpy=np.__version__,
                machine=platform.machine(), device=str(jax.devices()[0].device_kind))


def failures(res: dict) -> list[str]:
    """Backends that failed or differed, runs not verified (empty: all good)."""
    bad = [f"backend {r['backend']}: {r['error']}" for r in res.get("backends", []) if "error" in r]
    bad += [f"job {r['engine']} staging={r['staging']}: {r.get('error', 'not verified')}"
            for r in res.get("paths", []) if "error" in r or not r.get("verified")]
    return bad


def _md(res: dict) -> str:
    lines = [f"# Pack backends and staged vs direct ({res['date']}, {res['versions']['device']})", "",
             f"versions: {res['versions']}", ""]
    if "backends" in res:
        lines += [f"## Backends: {res['pack']}", "",
                  "| backend | arrays | first call s | median s | min s | GB/s (read+write) | exact |",
                  "|---|---|---|---|---|---|---|"]
    for r in res.get("backends", []):
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['kind']} | - | - | - | - | {r['error']} |")
        else:
            lines.append(f"| {r['backend']} | {r['kind']} | {r['first_call_s']:.3f} | {r['median_s']:.4f} | "
                         f"{r['min_s']:.4f} | {r['gbps']:.2f} | yes |")
    if "paths" in res:
        lines += ["", f"## Paths: {res['job']}", "", "| engine | staging | path (prefill / decode) | bytes | "
                  "total s | GB/s | stage s | unstage s | verified |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("paths", []):
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['staging']} | {r['error']} | | | | | | no |")
        else:
            lines.append(f"| {r['engine']} | {r['staging']} | {r['path']['prefill']} / {r['path']['decode']} | "
                         f"{r['bytes']:,} | {r['total_s']:.3f} | {r['gbps']:.3f} | {r['stage_s']:.3f} | "
                         f"{r['unstage_s']:.3f} | {'yes' if r['verified'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--backends", default="xla,host,tpu-interpret,gpu-triton-interpret")
    ap.add_argument("--rows", type=int, default=4096, help="rows of the pack (one rank's share)")
    ap.add_argument("--pool-rows", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", default="nixl,mooncake,jax-transfer")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the job runs")
    ap.add_argument("--dcp-size", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="each job run's connector timeout")
    ap.add_argument("--part", default="all", choices=("all", "backends", "paths"))
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args()
    from dcp_jax.job.config import engine_env

    engine_env(a.device)
    layers, item = 61, 1152
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               versions=_versions(),
               pack=f"DeepSeek-V3 rank pack: {a.rows} rows of {layers} x {item} B from {a.pool_rows} rows, "
                    f"{a.rows * layers * item / 1e6:.0f} MB",
               job=f"dcp-jax transfer, deepseek-v3, {a.tokens} tokens, page 64, DCP{a.dcp_size}, region path, "
                   f"device {a.device}")
    def saved() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2, default=str)

    if a.part in ("all", "backends"):
        res["backends"] = []
        bench_backends([x for x in a.backends.split(",") if x], a.device, a.rows, a.pool_rows, layers, item,
                       a.repeats, res["backends"], saved)
    if a.part in ("all", "paths"):
        res["paths"] = []
        bench_paths([x for x in a.engines.split(",") if x], a.device, a.tokens, a.dcp_size, res["paths"], saved,
                    a.timeout_s)
    saved()
    text = _md(res)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    print(text)
    bad = failures(res)
    if bad:
        print("FAILED: " + "; ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
