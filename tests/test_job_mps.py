"""``dcp-jax transfer --mps`` (`dcp_jax.job.mps`): what can be checked without a GPU. The option
is refused off the GPU and without the MPS control program, naming it; a daemon that fails to
start raises with its own output and leaves no directory behind. (A real daemon runs in the GPU
test `tests/gpu/test_transfer_job_gpu.py`.)"""
import glob
import os
import tempfile

import pytest

from dcp_jax.job import JobConfig
from dcp_jax.job.mps import CONTROL, MpsDaemon, check_mps


def test_mps_needs_the_gpu_and_a_bool():
    with pytest.raises(ValueError, match=r"--mps\) needs --device gpu"):
        JobConfig(mps=True)
    with pytest.raises(ValueError, match=r"mps='yes' \(--mps\) must be a bool"):
        JobConfig(mps="yes", device="gpu")
    assert JobConfig().mps is False


def _mps_dirs():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "dcp-mps-*")))


def _fake(tmp_path, body):
    """A stand-in ``nvidia-cuda-mps-control`` (the real one needs a GPU) running ``body``."""
    fake = tmp_path / CONTROL
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)


def _daemon_fake(tmp_path, on_quit):
    """A stand-in that daemonises as MPS does: ``-d`` leaves a ``sleep`` running, its pid in the
    pipe folder's pid file (and in ``$PIDFILE`` when set), and makes the control pipe; otherwise it
    reads ``quit`` from stdin and runs ``on_quit``."""
    _fake(tmp_path,
          'if [ "$1" = "-d" ]; then\n'
          '  sleep 120 > /dev/null 2>&1 & echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"\n'
          '  [ -n "$PIDFILE" ] && echo $! > "$PIDFILE"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0\n'
          "fi\n"
          f"read line; {on_quit}\n")


def _gone(pid, timeout_s):
    """Whether process ``pid`` has ended within ``timeout_s`` seconds."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_without_the_control_program_mps_is_refused_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: nothing to find
    with pytest.raises(ValueError, match=CONTROL):
        check_mps(JobConfig(mps=True, device="gpu"))
    check_mps(JobConfig())  # without --mps nothing is needed
    before = _mps_dirs()
    with pytest.raises(RuntimeError, match=CONTROL):
        MpsDaemon().start()
    assert _mps_dirs() == before


def test_a_daemon_that_does_not_start_raises_its_output_and_cleans_up(monkeypatch, tmp_path):
    # A stand-in that fails the way a driver without MPS does: the error names its exit and words.
    _fake(tmp_path, "echo 'MPS not supported on this device' >&2\nexit 3\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    before = _mps_dirs()
    with pytest.raises(RuntimeError, match="exited 3: MPS not supported"):
        MpsDaemon().start()
    assert _mps_dirs() == before


def test_a_daemon_that_makes_no_control_pipe_times_out_and_cleans_up(monkeypatch, tmp_path):
    _fake(tmp_path, "exit 0\n")  # "started", but no pipe ever appears
    monkeypatch.setenv("PATH", str(tmp_path))
    before = _mps_dirs()
    d = MpsDaemon()
    with pytest.raises(RuntimeError, match="no control pipe within 0.2 s"):
        d.start(timeout_s=0.2)
    assert _mps_dirs() == before and d.dir is None and d.clients() == 0
    d.close()  # idempotent


def test_the_cli_refuses_mps_on_the_cpu():
    from typer.testing import CliRunner

    from dcp_jax.cli import app

    res = CliRunner().invoke(app, ["transfer", "--mps", "--no-progress", "--model", "tiny", "--prompt-tokens", "64"])
    assert res.exit_code == 2, res.output
    assert "--mps" in res.output and "--device gpu" in res.output


def test_a_daemon_start_that_hangs_raises_runtime_error(monkeypatch, tmp_path):
    _fake(tmp_path, "sleep 5\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    before = _mps_dirs()
    with pytest.raises(RuntimeError, match="did not start"):
        MpsDaemon().start(timeout_s=0.3)
    assert _mps_dirs() == before


def test_close_kills_a_daemon_that_ignores_quit(monkeypatch, tmp_path):
    """A stand-in daemon (the real one needs a GPU) that writes its pid where MPS does and never
    takes ``quit``: `close` waits its bound, kills it by that pid and removes the folders."""
    _daemon_fake(tmp_path, "cat > /dev/null")  # ignores quit
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("PIDFILE", raising=False)
    before = _mps_dirs()
    d = MpsDaemon().start()
    pid = int(open(os.path.join(d.env["CUDA_MPS_PIPE_DIRECTORY"], f"{CONTROL}.pid")).read())
    os.kill(pid, 0)  # running
    d.close(timeout_s=0.5)
    assert _gone(pid, 5), f"the stand-in daemon {pid} still runs after close"
    assert _mps_dirs() == before and d.dir is None


_SIGTERM_JOB = r"""
import sys, time
from dcp_jax.job import run as jr
from dcp_jax.job.config import JobConfig
jr.check_device = lambda device: None
jr.gpus.check_gpus = lambda cfg: None
jr.kv.check_host_memory = lambda cfg: None
def slow_start(cfg, **kw):  # stands in for the processes' start: the job is held here
    print("started", flush=True)
    time.sleep(30)
jr.start_processes = slow_start
jr.run_job(JobConfig(mps=True, device="gpu", model="tiny", prompt_tokens=64))
"""


def test_two_sigterms_still_quit_the_daemon(monkeypatch, tmp_path):
    """A job holding its MPS daemon gets SIGTERM, then another while it cleans up: the clean-up
    ignores the second, so the daemon (a stand-in that takes a second to quit) is gone and so
    are its folders."""
    import signal
    import subprocess
    import sys
    import time

    _daemon_fake(tmp_path, 'sleep 1; kill "$(cat "$PIDFILE")"')  # takes quit, slowly
    pidfile = tmp_path / "daemon.pid"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PIDFILE": str(pidfile)}
    before = _mps_dirs()
    job = subprocess.Popen([sys.executable, "-c", _SIGTERM_JOB], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "started"
        pid = int(pidfile.read_text())
        job.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # inside the clean-up's wait for the daemon
        job.send_signal(signal.SIGTERM)
        assert job.wait(60) == 128 + signal.SIGTERM
    finally:
        if job.poll() is None:
            job.kill()
    assert _gone(pid, 10), f"the stand-in daemon {pid} still runs"
    assert _mps_dirs() == before
