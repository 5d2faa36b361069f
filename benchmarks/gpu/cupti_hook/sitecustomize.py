"""Diagnostic (GPU): the device's own timeline of every job process, from CUPTI (torch.profiler).

    PYTHONPATH=benchmarks/gpu/cupti_hook:$PYTHONPATH DCP_CUPTI_DIR=/tmp/cupti \\
    python -m dcp_jax.cli transfer --device gpu --path region ...
    python benchmarks/gpu/cupti_summary.py /tmp/cupti

The job's host timelines say when each process asked for work; this says when the GPU did it.
Each job process (`dcp_jax.job.workers.prefill_main` / `decode_main`, wrapped when the fork
server imports that module, so the forked children run the wrapped targets) runs its whole life
under ``torch.profiler`` with CUDA activities: every kernel and copy of its CUDA context, JAX's,
Triton's and the ones NIXL/UCX's cuda_ipc transport issues in it alike. At its end it writes
``$DCP_CUPTI_DIR/gpu_<role>_<pid>.json``: ``{"role", "events": [[cat, name, start_s, end_s]]}``
on ``time.monotonic()`` (the clock of the job's timelines, shared by the host's processes),
aligned through two ``record_function`` markers that carry the monotonic time they were made at.
"""
import functools
import importlib
import importlib.util
import json
import os
import sys
import time

_DIR = os.environ.get("DCP_CUPTI_DIR")
_MODULE = "dcp_jax.job.workers"
_TARGETS = ("prefill_main", "decode_main")
_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _marker(record_function) -> None:
    with record_function(f"dcp_mono_{time.monotonic():.9f}"):
        pass


def _export(prof, role: str) -> None:
    path = os.path.join(_DIR, f"trace_{role}_{os.getpid()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.remove(path)
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [(float(e["name"][len("dcp_mono_"):]), e["ts"] * 1e-6) for e in evs if e.get("name", "").startswith("dcp_mono_")]
    if not marks:
        print(f"cupti_hook: {role}: no markers in the trace", file=sys.stderr)
        return
    offset = sum(ts - mono for mono, ts in marks) / len(marks)  # kineto seconds - monotonic seconds
    drift = max(ts - mono for mono, ts in marks) - min(ts - mono for mono, ts in marks)
    out = [[e["cat"], e["name"][:80], e["ts"] * 1e-6 - offset, (e["ts"] + e.get("dur", 0)) * 1e-6 - offset]
           for e in evs if e.get("cat") in _CATS]
    with open(os.path.join(_DIR, f"gpu_{role}_{os.getpid()}.json"), "w") as f:
        json.dump(dict(role=role, drift_s=drift, markers=len(marks), events=out), f)


def _wrap(fn, kind: str):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        from torch.profiler import ProfilerActivity, profile, record_function

        role = f"{kind}{args[1] if len(args) > 1 else ''}"
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
        _marker(record_function)
        try:
            return fn(*args, **kwargs)
        finally:
            _marker(record_function)
            prof.__exit__(None, None, None)
            try:
                _export(prof, role)
            except Exception as exc:  # noqa: BLE001 - a diagnostic never breaks the job
                print(f"cupti_hook: {role}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return traced


class _Finder:
    """Wraps the job's process targets right after `dcp_jax.job.workers` is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            for t in _TARGETS:
                setattr(module, t, _wrap(getattr(module, t), t.split("_")[0]))

        spec.loader.exec_module = exec_module
        return spec


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
