"""Placement of the main job's processes on GPUs (dcp_jax.job.gpus, --prefill-gpus / --decode-gpus), on CPU."""
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dcp_jax.cli import app
from dcp_jax.job import JobConfig
from dcp_jax.job.gpus import check_gpus, child_env, parse_gpu_list, place, visible_devices


@pytest.mark.parametrize("text,want", [("0", (0,)), ("1-7", (1, 2, 3, 4, 5, 6, 7)), ("0,2,4", (0, 2, 4)),
                                       (" 3 , 0-1", (3, 0, 1)), ("5-5", (5,))])
def test_parse_gpu_list(text, want):
    assert parse_gpu_list(text, "--decode-gpus") == want


@pytest.mark.parametrize("text,why", [("", "not a GPU number"), ("1-x", "not a GPU number"), ("-1", "not a GPU"),
                                      ("3-1", "goes down"), ("0,1,1", "twice"), ("0-2,2", "twice"),
                                      ("0-5000", "past"), ("1,,2", "not a GPU number")])
def test_parse_gpu_list_refuses(text, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_gpu_list(text, "--decode-gpus")
    assert "--decode-gpus" in str(e.value)


def test_place_round_robin():
    assert place(8, (1, 2, 3)) == [1, 2, 3, 1, 2, 3, 1, 2]
    assert place(8, tuple(range(8))) == list(range(8))
    assert place(2, (0,)) == [0, 0]
    assert place(3, None) == [None] * 3
    with pytest.raises(ValueError):
        place(2, ())


def test_visible_devices_own_gpu_first(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices(0, 4) == "0,1,2,3"
    assert visible_devices(2, 4) == "2,0,1,3"
    assert visible_devices(3, 4) == "3,0,1,2"
    # inside an outer CUDA_VISIBLE_DEVICES the ordinals index its entries
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,GPU-abc")
    assert visible_devices(1, 3) == "6,4,GPU-abc"
    assert child_env(2, 3) == {"CUDA_VISIBLE_DEVICES": "GPU-abc,4,6"}
    assert child_env(None, 3) == {}
    with pytest.raises(ValueError, match="GPU 3 does not exist"):
        visible_devices(3, 3)


def _cfg(**kw):
    return JobConfig(prompt_tokens=1024, device="gpu", **kw)


def test_jobconfig_placement_fields():
    c = _cfg(decode_gpus=[1, 2], prefill_gpus=(0,))
    assert c.decode_gpus == (1, 2) and c.prefill_gpus == (0,)
    assert JobConfig(**c.to_dict()) == c  # crosses the process boundary unchanged
    for bad in ((), (1, 1), (-1,), (0.5,)):
        with pytest.raises(ValueError, match=r"--decode-gpus"):
            _cfg(decode_gpus=bad)
    with pytest.raises(ValueError, match="needs --device gpu"):
        JobConfig(prompt_tokens=1024, prefill_gpus=(0,))


def test_check_gpus_existence_and_peer_access():
    check_gpus(_cfg(), count=0)  # no placement: nothing to check, even without a GPU
    check_gpus(_cfg(prefill_gpus=(0,), decode_gpus=tuple(range(1, 8))), count=8)
    with pytest.raises(ValueError, match=r"--decode-gpus=1,2,3,4: GPU 4 does not exist \(this host shows 4"):
        check_gpus(_cfg(decode_gpus=(1, 2, 3, 4)), count=4)
    with pytest.raises(ValueError, match="--prefill-gpus: this host shows no CUDA GPU"):
        check_gpus(_cfg(prefill_gpus=(0,)), count=0)
    asked = []

    def no_peer_to_3(a, b):
        asked.append((a, b))
        return a == b or b != 3

    fused = _cfg(modes=("packed", "fused"), prefill_gpus=(0,), decode_gpus=(1, 2, 3))
    with pytest.raises(ValueError, match=r"--path fused: GPU 0 \(prefill\) has no peer access to GPU 3"):
        check_gpus(fused, count=4, can_access_peer=no_peer_to_3)
    assert asked == [(0, 1), (0, 2), (0, 3)]
    check_gpus(_cfg(modes=("packed", "region"), prefill_gpus=(0,), decode_gpus=(1, 2, 3)), count=4,
               can_access_peer=no_peer_to_3)  # no fused: the engines own their paths
    # decode placed only: the prefill stays on GPU 0, which is what is asked
    asked.clear()
    check_gpus(_cfg(modes=("fused",), decode_gpus=(0, 1)), count=2, can_access_peer=no_peer_to_3)
    assert asked == [(0, 0), (0, 1)]


def test_cli_refuses_bad_gpu_lists():
    r = CliRunner().invoke(app, ["transfer", "--device", "gpu", "--decode-gpus", "1-", "--no-progress"])
    assert r.exit_code == 2 and "--decode-gpus" in r.output
    r = CliRunner().invoke(app, ["transfer", "--prefill-gpus", "0", "--prompt-tokens", "1024", "--no-progress"])
    assert r.exit_code == 2 and "needs --device gpu" in r.output


def test_enter_gpu_in_a_fresh_process():
    """The child's side: its GPU first in CUDA_VISIBLE_DEVICES, JAX kept to its device 0."""
    code = ("import json, os; from dcp_jax.job.gpus import enter_gpu; from jax._src import xla_bridge; "
            "enter_gpu({'CUDA_VISIBLE_DEVICES': '2,0,1'}); "
            "print(json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], xla_bridge.CUDA_VISIBLE_DEVICES.value]))")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["2,0,1", "0"]


@pytest.mark.parametrize("device, pre, dec, shares", [
    ("cpu", None, None, False),
    ("gpu", None, None, True),  # no placement: every process on visible GPU 0
    ("gpu", (0,), (0,), True),
    ("gpu", None, (1,), False),  # the prefill stays on GPU 0
    ("gpu", (1,), (1,), True),
    ("gpu", (0,), (0, 1), False),
])
def test_region_notify_auto_is_round_only_where_every_process_shares_one_gpu(device, pre, dec, shares):
    cfg = JobConfig(device=device, prefill_gpus=pre, decode_gpus=dec)
    assert cfg.shares_one_gpu is shares
    assert cfg.sender_region_notify == ("round" if shares else "write")
    for given in ("write", "round"):  # named: taken as given
        assert JobConfig(device=device, prefill_gpus=pre, decode_gpus=dec, modes=("region",),
                         region_notify=given).sender_region_notify == given


@pytest.mark.parametrize("bad", ["held", "", None])
def test_region_notify_is_checked_naming_the_option(bad):
    with pytest.raises(ValueError, match="region_notify=.*--region-notify"):
        JobConfig(region_notify=bad)
    r = CliRunner().invoke(app, ["transfer", "--region-notify", str(bad), "--prompt-tokens", "64", "--dcp-size", "2"])
    assert r.exit_code != 0 and "--region-notify" in r.output


def test_region_notify_only_where_a_region_push_can_run():
    assert JobConfig(device="gpu", direction="pull").sender_region_notify == "write"  # a pull ignores it
    for kw in (dict(modes=("packed",)), dict(modes=("direct", "fused"), device="gpu"), dict(direction="pull")):
        with pytest.raises(ValueError, match="--region-notify.*region pushes only"):
            JobConfig(region_notify="round", **kw)
    JobConfig(region_notify="write", modes=("auto",))  # auto may take the region path
    with pytest.raises(ValueError, match=r"left out: the default paths.*add --path region"):
        JobConfig(region_notify="round")  # the message says the paths were the defaults


def test_report_names_region_notify_for_region_pushes_only(tmp_path):
    for args, want in ((["--path", "region"], "write"), (["--path", "region", "--region-notify", "round"], "round"),
                       (["--path", "region", "--direction", "pull"], None), (["--path", "packed"], None)):
        out = tmp_path / "r.json"
        r = CliRunner().invoke(app, ["transfer", "--no-progress", "--model", "tiny", "--prompt-tokens", "256",
                                     "--dcp-size", "2", "--json", str(out), *args])
        assert r.exit_code == 0, r.output
        run = json.loads(out.read_text())["runs"][0]
        assert run["region_notify"] == want, args
        assert isinstance(run["first_byte_at"], float)
