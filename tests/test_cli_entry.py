"""The ``dcp-jax`` command's entry point (`dcp_jax.cli_entry.main`, also behind
``python -m dcp_jax.cli``): an unknown ``DCP_JAX_*`` switch, read while the CLI is imported, is one
error line and exit status 2, not a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ENTRY = [sys.executable, "-c", "from dcp_jax.cli_entry import main; main()"]
MODULE = [sys.executable, "-m", "dcp_jax.cli"]


def _run(args, entry=ENTRY, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DCP_JAX_")}
    return subprocess.run([*entry, *args], env={**clean, "JAX_PLATFORMS": "cpu", **env},
                          capture_output=True, text=True, timeout=100)


def test_the_installed_command_is_the_guarded_entry_point():
    """The ``dcp-jax`` script pip wrote beside this interpreter (``[project.scripts]``)."""
    script = Path(sys.executable).with_name("dcp-jax")
    if not script.exists():
        pytest.skip(f"no installed dcp-jax script beside {sys.executable} (run scripts/setup.sh)")
    assert "from dcp_jax.cli_entry import main" in script.read_text()
    res = _run(["--help"], [str(script)], DCP_JAX_DIRECT_LAUNCH="maybe")
    assert res.returncode == 2 and res.stderr.startswith("dcp-jax: error: DCP_JAX_DIRECT_LAUNCH="), res.stderr


@pytest.mark.parametrize("var, value, says", [
    ("DCP_JAX_DIRECT_ON", "window", "not among the kinds"),
    ("DCP_JAX_DIRECT_OFF", "unpack,bogus", "['bogus']"),
    ("DCP_JAX_DIRECT_LAUNCH", "maybe", "must be one of"),
    ("DCP_JAX_FUSED_FLAG_GATE", "2", "must be one of"),
    ("DCP_JAX_PACK_TICKET_EACH", "yes please", "must be one of"),
])
@pytest.mark.parametrize("entry", [ENTRY, MODULE], ids=["entry", "python-m"])
def test_an_unknown_switch_is_one_error_line_and_status_2(var, value, says, entry):
    res = _run(["transfer", "--help"], entry, **{var: value})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"dcp-jax: error: {var}={value!r}"), res.stderr
    assert says in lines[0] and res.stdout == ""


@pytest.mark.parametrize("entry", [ENTRY, MODULE], ids=["entry", "python-m"])
def test_known_switches_reach_the_app(entry):
    res = _run(["--help"], entry, DCP_JAX_DIRECT_ON=" Windows ", DCP_JAX_DIRECT_LAUNCH="off")
    assert res.returncode == 0, res.stderr
    assert "transfer" in res.stdout and "Traceback" not in res.stderr


def test_a_kind_both_on_and_off_is_refused():
    res = _run(["--help"], DCP_JAX_DIRECT_ON="windows", DCP_JAX_DIRECT_OFF="windows")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == "dcp-jax: error: DCP_JAX_DIRECT_ON and DCP_JAX_DIRECT_OFF both name ['windows']"
