"""CUDA MPS for the main job's processes (``dcp-jax transfer --device gpu --mps``).

Without MPS the nine processes of the 32k job on one GPU (one prefill, eight decode ranks) each
own a CUDA context, and the GPU time-slices between them: each decode rank's 0.2 ms unpack ran
after the previous rank's with 0.09-0.19 ms of idle GPU between (the device's own timeline,
`benchmarks/gpu/cupti_probe.sh`, H100, 2026-12-07). Under MPS their kernels share one server
context and may overlap: +10-19 % on the whole request (H100, two sessions of 2026-12-07). Serving stacks
that put several processes on one GPU run them so; the job offers it for the same reason.

`MpsDaemon` starts a private MPS control daemon (its own pipe and log directories, so the job's
processes do not join a daemon the machine may already run; whether a second MPS server may share
a GPU with another user's depends on the GPU's compute mode and is not tried here), hands the job
its environment for the children (set before their first CUDA call:
`dcp_jax.job.gpus.enter_gpu`), counts the clients that connected (the proof the processes went
through it) and quits it at the end, within bounded waits: a daemon that ignores ``quit`` is
killed by the pid it wrote. `dcp_jax.job.run_job` turns a SIGTERM into an exit while it holds one,
so a job stopped that way still quits it.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time

__all__ = ["MpsDaemon", "CONTROL", "check_mps"]

logger = logging.getLogger(__name__)

#: The MPS control program (shipped with the NVIDIA driver's utilities).
CONTROL = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 20.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's process of that pid
        return False
    return True


#: Why ``--mps`` cannot run where `CONTROL` is not on PATH (`check_mps` and `MpsDaemon.start`).
_NOT_ON_PATH = f"needs {CONTROL} on PATH (CUDA MPS comes with the NVIDIA driver's utilities); run without --mps"


def check_mps(cfg) -> None:
    """Checks before a run that a `JobConfig` with ``mps`` can start its daemon here.

    Raises:
        ValueError: ``cfg.mps`` and no ``nvidia-cuda-mps-control`` on PATH (names ``--mps``).
    """
    if cfg.mps and shutil.which(CONTROL) is None:
        raise ValueError(f"mps=True (--mps) {_NOT_ON_PATH}")


class MpsDaemon:
    """One private CUDA MPS control daemon: `start`, `env` for the children, `clients`, `close`.

    Raises (`start`):
        RuntimeError: ``nvidia-cuda-mps-control`` is not on PATH, or the daemon did not start
            (its exit status and output, or no control pipe within ``timeout_s`` seconds).
    """

    def __init__(self):
        self.dir: str | None = None
        self.env: dict[str, str] = {}  # CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY for the children
        self._exe: str | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "MpsDaemon":
        exe = shutil.which(CONTROL)
        if exe is None:
            raise RuntimeError(f"--mps {_NOT_ON_PATH}")
        self.dir = tempfile.mkdtemp(prefix="dcp-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}
        for d in self.env.values():
            os.makedirs(d)
        try:
            try:
                done = subprocess.run([exe, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True,
                                      timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise RuntimeError(f"--mps: {CONTROL} -d did not start: {exc}") from None
            if done.returncode != 0:
                raise RuntimeError(f"--mps: {CONTROL} -d exited {done.returncode}: "
                                   f"{(done.stderr or done.stdout).strip()[:500]}")
            self._exe = exe
            control = os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], "control")
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(control):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"--mps: {CONTROL} made no control pipe within {timeout_s:g} s")
                time.sleep(0.02)
        except BaseException:
            self.close()
            raise
        return self

    def clients(self) -> int:
        """Client connections the daemon logged so far (each process's CUDA start is one)."""
        if not self.env:
            return 0
        try:
            with open(os.path.join(self.env["CUDA_MPS_LOG_DIRECTORY"], "control.log"), errors="replace") as f:
                return sum(1 for line in f if "new client" in line.lower())
        except OSError:
            return 0

    def _pid(self) -> int | None:
        """The daemon's pid, from the file it writes into its pipe directory (None if none)."""
        try:
            with open(os.path.join(self.env["CUDA_MPS_PIPE_DIRECTORY"], f"{CONTROL}.pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError, KeyError):
            return None

    def close(self, timeout_s: float = QUIT_TIMEOUT_S) -> None:
        """Quits the daemon (its server ends with it), waits up to ``timeout_s`` for it to exit
        (then SIGKILLs it by its pid, logged), and removes its directories; idempotent."""
        if self._exe is not None:
            pid = self._pid()
            deadline = time.monotonic() + timeout_s
            try:
                subprocess.run([self._exe], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                               text=True, timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired) as exc:
                logger.warning("--mps: the MPS daemon did not take quit: %s", exc)
            while pid is not None and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid is not None and _alive(pid):
                logger.warning("--mps: the MPS daemon (pid %d) did not exit after quit; killing it", pid)
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            self._exe = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
