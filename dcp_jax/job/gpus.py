"""Placing the main job's processes on GPUs (``--prefill-gpus`` / ``--decode-gpus``).

GPU numbers are CUDA ordinals as the orchestrator sees them (inside its own
``CUDA_VISIBLE_DEVICES``, if set). Prefill rank k runs on ``prefill_gpus[k % len]``, decode process
r on ``decode_gpus[r % len]`` (round-robin). Each child gets a ``CUDA_VISIBLE_DEVICES`` that lists
its own GPU first and every other visible GPU after it (:func:`visible_devices`): its device 0 is
its GPU (the job's buffers, CuPy's and JAX's default device), and the peers stay visible, which
CUDA IPC needs to map another GPU's memory (the fused path, the engines' NVLink transports).
JAX in the child is kept to that one device (``jax_cuda_visible_devices = "0"``: no context on
the other GPUs). Without placement
(both None), nothing is changed: every process uses device 0 of the inherited environment.
"""

from __future__ import annotations

import os
import re

__all__ = ["parse_gpu_list", "place", "visible_devices", "gpu_count", "check_gpus", "child_env", "enter_gpu",
           "device_info", "host_placement"]

_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_GPU = 1023  # far above any host; bounds a typo such as 0-100000


def parse_gpu_list(text: str, option: str) -> tuple[int, ...]:
    """``"0"``, ``"1,3"``, ``"1-7"``, ``"0,2-3"`` -> GPU ordinals in that order (ranges inclusive).

    Raises:
        ValueError: empty, malformed, a descending range, a repeated GPU, or > ``MAX_GPU``; the
            message names ``option``.
    """
    out: list[int] = []
    for part in str(text).split(","):
        m = _ITEM.match(part.strip())
        if not m:
            raise ValueError(f"{option}={text!r}: {part.strip()!r} is not a GPU number or range "
                             "(write e.g. 0, 1-7 or 0,2,4)")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise ValueError(f"{option}={text!r}: range {part.strip()!r} goes down")
        if hi > MAX_GPU:
            raise ValueError(f"{option}={text!r}: GPU {hi} is past {MAX_GPU}")
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise ValueError(f"{option}={text!r} names a GPU twice")
    return tuple(out)


def place(n: int, gpus: tuple[int, ...] | None) -> list[int | None]:
    """GPU of each of ``n`` processes: ``gpus`` round-robin, or ``[None] * n`` without placement."""
    if gpus is None:
        return [None] * n
    if not gpus:
        raise ValueError("gpus must name at least one GPU (or be None)")
    return [gpus[i % len(gpus)] for i in range(n)]


def _outer_ids(count: int) -> list[str]:
    """The names of this process's visible GPUs as CUDA_VISIBLE_DEVICES entries, ordinal order."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in env.split(",")] if env is not None else [str(i) for i in range(count)]
    return ids[:count]


def visible_devices(gpu: int, count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a child placed on ordinal ``gpu`` of ``count`` visible GPUs: its
    GPU first, then the others in order (entries of the inherited ``CUDA_VISIBLE_DEVICES`` if set).

    Raises:
        ValueError: ``gpu`` not in ``[0, count)``.
    """
    if not 0 <= gpu < count:
        raise ValueError(f"GPU {gpu} does not exist: {count} visible")
    ids = _outer_ids(count)
    return ",".join([ids[gpu]] + ids[:gpu] + ids[gpu + 1:])


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CuPy or a driver)."""
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver: no GPU
        return 0


def _can_access_peer(a: int, b: int) -> bool:
    import cupy as cp

    return a == b or bool(cp.cuda.runtime.deviceCanAccessPeer(a, b))


def check_gpus(cfg, count: int | None = None, can_access_peer=None) -> None:
    """Checks ``cfg.prefill_gpus`` / ``cfg.decode_gpus`` against this host before any process starts.

    ``count`` (default :func:`gpu_count`) and ``can_access_peer(a, b)`` (default CuPy's
    ``deviceCanAccessPeer``) are parameters so the rule runs without a GPU.

    Raises:
        ValueError: a named GPU does not exist (the message names the option and the GPUs seen), or
            the fused path would write from a prefill GPU into a decode GPU without peer access.
    """
    if cfg.prefill_gpus is None and cfg.decode_gpus is None:
        return
    count = gpu_count() if count is None else count
    for option, gpus in (("--prefill-gpus", cfg.prefill_gpus), ("--decode-gpus", cfg.decode_gpus)):
        bad = [g for g in gpus or () if g >= count]
        if bad:
            raise ValueError(f"{option}={','.join(map(str, gpus))}: GPU {bad[0]} does not exist "
                             f"(this host shows {count} GPU(s): 0-{count - 1})" if count else
                             f"{option}: this host shows no CUDA GPU")
    if "fused" in cfg.modes:
        peer = can_access_peer or _can_access_peer
        pre, dec = place(cfg.prefill_dcp_size, cfg.prefill_gpus), place(cfg.dcp_size, cfg.decode_gpus)
        for a in sorted({g or 0 for g in pre}):
            for b in sorted({g or 0 for g in dec}):
                if not peer(a, b):
                    raise ValueError(f"--path fused: GPU {a} (prefill) has no peer access to GPU {b} (decode) "
                                     "on this host (cudaDeviceCanAccessPeer = 0), and the fused kernel writes "
                                     "through CUDA IPC into the decode ranks' memory; drop fused from --path "
                                     "or place the ranks on GPUs with peer access (nvidia-smi topo -p2p r)")


def child_env(gpu: int | None, count: int) -> dict[str, str]:
    """Environment a child placed on ``gpu`` sets before CUDA starts (empty without placement)."""
    if gpu is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": visible_devices(gpu, count)}


def enter_gpu(env: dict[str, str]) -> None:
    """In a freshly forked child, before anything touches CUDA: applies :func:`child_env`'s
    ``env`` (and the job's MPS variables, `dcp_jax.job.mps`) and, where it places the child, keeps
    JAX to device 0 (the child's own GPU). No-op for an empty ``env``."""
    if not env:
        return
    os.environ.update(env)
    if "CUDA_VISIBLE_DEVICES" not in env:  # MPS only (`dcp_jax.job.mps`): no placement to keep JAX to
        return
    import jax

    jax.config.update("jax_cuda_visible_devices", "0")


def device_info(device: str) -> dict:
    """Where this process's buffers are (its device 0) for the report: ``{"pci_bus_id": str}`` on
    ``device="gpu"``, ``{}`` on the CPU. Makes the placement visible: each GPU has its own bus id."""
    if device != "gpu":
        return {}
    import cupy as cp

    return {"pci_bus_id": cp.cuda.Device(0).pci_bus_id}


def host_placement(count: int, dcp_size: int) -> tuple[str, str]:
    """``(--prefill-gpus, --decode-gpus)`` for a host of ``count`` GPUs (``scripts/multi_gpu.sh``):
    prefill on GPU 0; decode over ``1..count-1``, or ``0..count-1`` once ``count >= dcp_size`` (one
    rank per GPU at most), or ``0`` with one GPU.

    Raises:
        ValueError: ``count`` or ``dcp_size`` < 1.
    """
    if count < 1 or dcp_size < 1:
        raise ValueError(f"count={count} and dcp_size={dcp_size} must be >= 1")
    if count == 1:
        return "0", "0"
    return "0", (f"0-{count - 1}" if count >= dcp_size else f"1-{count - 1}")
