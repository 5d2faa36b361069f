"""Diagnostic: wall-clock time of chosen methods in every process of a job (no profiler overhead).

    PYTHONPATH=benchmarks/gpu/time_hook:$PYTHONPATH DCP_TIME_DIR=/tmp/times \\
    DCP_TIME_TARGETS=dcp_jax.transfer._sender_region:SenderRegion._write_region,bridge.nixl:NixlEngine._post \\
    python -m dcp_jax.cli transfer --device gpu --path region ...

Each target (``module:Class.method``, or ``module:function`` for a module-level callable that its
callers look up in that module at call time) is wrapped to record every call's perf_counter duration and
thread name; at exit each process writes ``$DCP_TIME_DIR/times_<pid>.json``: {target: [[seconds,
thread], ...]} for the targets it called. benchmarks/gpu/time_summary.py prints medians.
Targets import lazily: one whose module is not imported yet is wrapped when it is first imported.
"""
import atexit
import importlib
import json
import os
import sys
import threading
import time

_DIR, _TARGETS = os.environ.get("DCP_TIME_DIR"), os.environ.get("DCP_TIME_TARGETS", "")
_calls: dict = {}


def _wrap(target: str) -> bool:
    module, _, attr = target.partition(":")
    if module not in sys.modules:
        return False
    if target == _PJIT:  # JAX's Python dispatch path, recorded per jitted function's name
        return _wrap_pjit(sys.modules[module])
    cls_name, _, meth = attr.partition(".")
    if not meth:  # "module:function": a module-level callable (callers must look it up there)
        cls, meth = sys.modules[module], cls_name
    else:
        cls = getattr(sys.modules[module], cls_name)
    orig = getattr(cls, meth)
    rec = _calls.setdefault(target, [])
    cur = threading.current_thread

    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            rec.append((time.perf_counter() - t0, cur().name))
            if _dumper[0] != os.getpid():
                _start_dumper()

    setattr(cls, meth, wrapped)
    return True


#: With DCP_TIME_PJIT=1: every call of JAX's Python dispatch (a jitted call the C++ fast path did
#: not take) is recorded as "pjit:<function name>".
_PJIT = "jax._src.pjit:_run_python_pjit"


def _wrap_pjit(mod) -> bool:
    orig, cur = mod._run_python_pjit, threading.current_thread

    def wrapped(p, args_flat, fun, args, kwargs):
        t0 = time.perf_counter()
        try:
            return orig(p, args_flat, fun, args, kwargs)
        finally:
            name = "pjit:" + str(getattr(fun, "__name__", fun))
            _calls.setdefault(name, []).append((time.perf_counter() - t0, cur().name))
            if _dumper[0] != os.getpid():
                _start_dumper()

    mod._run_python_pjit = wrapped
    return True


class _Finder:
    """Wraps a pending target right after its module is imported."""

    def __init__(self, pending):
        self.pending = pending

    def find_spec(self, name, path=None, target=None):
        if not any(t.partition(":")[0] == name for t in self.pending):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, finder = spec.loader, self

        class _Loader(type(loader)):
            pass

        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            for t in [t for t in finder.pending if t.partition(":")[0] == name]:
                try:
                    if _wrap(t):
                        finder.pending.remove(t)
                except Exception as exc:  # noqa: BLE001 - a diagnostic never breaks the job
                    print(f"time_hook: {t}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    finder.pending.remove(t)

        loader.exec_module = exec_module
        return spec


_dumper = [None]


def _start_dumper() -> None:
    """Forked job processes end in os._exit (no atexit): a daemon thread writes every 0.5 s."""
    _dumper[0] = os.getpid()

    def loop():
        while True:
            time.sleep(0.5)
            _dump()

    threading.Thread(target=loop, name="time_hook", daemon=True).start()


def _dump():
    if any(_calls.values()):
        with open(os.path.join(_DIR, f"times_{os.getpid()}.json"), "w") as f:
            json.dump(_calls, f)


if _DIR and _TARGETS:
    import importlib.util

    os.makedirs(_DIR, exist_ok=True)
    _targets = [t for t in _TARGETS.split(",") if t]
    if os.environ.get("DCP_TIME_PJIT") == "1":
        _targets.append(_PJIT)
    sys.meta_path.insert(0, _Finder(_targets))
    atexit.register(_dump)
    os.register_at_fork(after_in_child=lambda: [v.clear() for v in _calls.values()])
