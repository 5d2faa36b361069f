"""Diagnostic: cProfile one method inside every process of a job (the main job's prefill and
decode processes are spawned interpreters, so a profiler has to start in each).

    PYTHONPATH=benchmarks/gpu/profile_hook:$PYTHONPATH \\
    DCP_PROFILE_DIR=/tmp/prof \\
    DCP_PROFILE_TARGET=dcp_jax.transfer._sender_region:SenderRegion._copy_fused \\
    python -m dcp_jax.cli transfer --device gpu --path fused ...

Each call of the target is profiled on its own and written to
``$DCP_PROFILE_DIR/<Class.method>_<pid>_<n>.pstats`` (`pstats.Stats` reads it); the dump happens
after the call returns, so it delays what follows, not the call. Does nothing without both
variables; a target that cannot be imported is reported on stderr and left alone.
"""
import os
import sys

_DIR, _TARGET = os.environ.get("DCP_PROFILE_DIR"), os.environ.get("DCP_PROFILE_TARGET")


def _install(directory: str, target: str) -> None:
    import cProfile
    import importlib

    module, _, attr = target.partition(":")
    cls_name, _, meth = attr.partition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    orig = getattr(cls, meth)
    calls = [0]

    def wrapped(*args, **kwargs):
        prof = cProfile.Profile()
        prof.enable()
        try:
            return orig(*args, **kwargs)
        finally:
            prof.disable()
            calls[0] += 1
            prof.dump_stats(os.path.join(directory, f"{attr}_{os.getpid()}_{calls[0]}.pstats"))

    setattr(cls, meth, wrapped)


if _DIR and _TARGET:
    os.makedirs(_DIR, exist_ok=True)
    for _one in _TARGET.split(","):  # several targets: a comma list
        try:
            _install(_DIR, _one.strip())
        except Exception as exc:  # noqa: BLE001 - a diagnostic never breaks the job
            print(f"profile_hook: {_one} not profiled: {type(exc).__name__}: {exc}", file=sys.stderr)
