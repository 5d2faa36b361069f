"""CPU side of ``--device``: option checks, clear errors without a GPU, and the host buffer selection.

The device (CuPy) branch itself runs in ``tests/gpu/test_transfer_job_gpu.py``; here the same helpers
of ``dcp_jax.job.kv`` are exercised with host buffers and the CPU job is run with ``device="cpu"``
explicitly.
"""

import importlib.util
import mmap

import numpy as np
import pytest
from typer.testing import CliRunner

from dcp_jax.cli import app
from dcp_jax.kv_data import rows_checksum
from dcp_jax.job import DEVICES, JobConfig, check_device, run_job
from dcp_jax.job.kv import alloc_buffer, buffer_addr, checksum, flip_first_byte, layer_views, to_host

HAS_CUPY = importlib.util.find_spec("cupy") is not None
no_cupy = pytest.mark.skipif(HAS_CUPY, reason="this machine has CuPy: the no-GPU error cannot be shown")


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())  # undo rich's box and line wrapping


def test_devices_and_default():
    assert DEVICES == ("cpu", "gpu")
    assert JobConfig().device == "cpu"
    check_device("cpu")  # always available


@pytest.mark.parametrize("bad", ["tpu", "GPU", "", "cuda"])
def test_unknown_device_is_rejected(bad):
    with pytest.raises(ValueError, match=r"device=.*--device"):
        JobConfig(device=bad)
    with pytest.raises(ValueError, match=r"--device"):
        check_device(bad)


def test_gpu_with_mooncake_is_accepted_and_auto_means_nixl():
    assert JobConfig(device="gpu", engine="mooncake").engine_kind == "mooncake"  # nvlink_intra (CUDA build)
    assert JobConfig(device="gpu", engine="auto").engine_kind == "nixl"
    assert JobConfig(device="gpu", engine="nixl").engine_kind == "nixl"
    assert JobConfig(device="cpu", engine="auto").engine_kind == "auto"
    assert JobConfig(device="cpu", engine="mooncake").engine_kind == "mooncake"


@no_cupy
def test_gpu_without_cupy_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device='gpu' \(--device gpu\) needs CuPy"):
        check_device("gpu")
    # run_job checks before it starts any process.
    with pytest.raises(ValueError, match=r"--device gpu"):
        run_job(JobConfig(model="tiny", prompt_tokens=64, page_size=4, dcp_size=2, device="gpu", timeout_s=5))


@no_cupy
def test_cli_device_gpu_fails_clearly_here(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["transfer", "--device", "gpu", "--model", "tiny", "--prompt-tokens", "64",
                                   "--page-size", "4", "--dcp-size", "2", "--no-progress", "--json", str(out)])
    assert res.exit_code == 2, res.output
    flat = _flat(res.output)
    assert "--device gpu" in flat and "CuPy" in flat, res.output
    assert not out.exists()  # nothing ran


@pytest.mark.parametrize("args,text", [
    (["--device", "tpu"], "--device='tpu' must be one of cpu, gpu"),
])
def test_cli_bad_device_options(args, text):
    res = CliRunner().invoke(app, ["transfer", "--model", "tiny", "--no-progress", *args])
    assert res.exit_code == 2, res.output
    assert text in _flat(res.output), res.output


def test_cli_help_documents_device():
    res = CliRunner().invoke(app, ["transfer", "--help"])
    assert res.exit_code == 0
    flat = _flat(res.output)
    assert "--device" in flat and "VRAM" in flat


@pytest.mark.parametrize("nbytes", [1, 4097, 3 * mmap.PAGESIZE + 5])
def test_host_buffer_selection(nbytes):
    buf, region = alloc_buffer(nbytes, "cpu")
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.shape == (nbytes,)
    assert region is buf  # host arrays are registered as themselves (DRAM)
    assert buffer_addr(buf) == buf.ctypes.data and buffer_addr(buf) % mmap.PAGESIZE == 0
    assert not buf.any()
    assert to_host(buf) is buf
    rng = np.random.default_rng(nbytes)
    like = rng.integers(0, 256, nbytes, dtype=np.uint8)
    buf2, region2 = alloc_buffer(nbytes, "cpu", like=like)
    assert buf2 is like and region2 is like  # the host copy is the buffer: no second allocation


def test_host_buffer_selection_bad_input():
    with pytest.raises(ValueError, match="device="):
        alloc_buffer(16, "tpu")
    with pytest.raises(ValueError, match="nbytes=16"):
        alloc_buffer(16, "cpu", like=np.zeros(8, np.uint8))


def test_checksum_and_flip_on_host_rows():
    rng = np.random.default_rng(7)
    layer = rng.integers(0, 256, (50, 24), dtype=np.uint8)
    rows = rng.permutation(50)[:17]
    assert checksum(layer, rows) == rows_checksum(layer, rows)
    # The device branch checksums gathered rows with slice(None): the same CRC as the gather itself.
    assert rows_checksum(np.ascontiguousarray(layer[rows]), slice(None)) == rows_checksum(layer, rows)
    before = layer.copy()
    flip_first_byte(layer, rows[3])
    diff = np.argwhere(layer != before)
    assert diff.tolist() == [[int(rows[3]), 0]]
    assert layer[rows[3], 0] == before[rows[3], 0] ^ 0xFF
    assert checksum(layer, rows) != rows_checksum(before, rows)


def test_job_with_device_cpu_verifies_and_reports_device():
    cfg = JobConfig(model="tiny", prompt_tokens=256, page_size=4, dcp_size=2, chunk_tokens=128, engine="nixl",
                    verify=True, device="cpu", timeout_s=60)
    res = run_job(cfg)
    assert res["config"]["device"] == "cpu"
    assert res["verified"], res
    for run in res["runs"]:
        assert run["engine"] == "nixl" and run["bytes"] == 256 * 3 * 64
        assert all(r["bytes_exact"] and r["checksum_ok"] for r in run["ranks"])


@pytest.mark.parametrize("item_lens", [(48, 16, 96, 8), (1152,) * 3])
def test_layer_views_are_the_connectors_page_layout_without_copies(item_lens):
    """One layer-major buffer, one ``[num_pages, page_size, item]`` view per layer entry: what the
    connector registers (KVSender / KVReceiver ``kv_layers``), at the buffer's own addresses."""
    pages, p = 5, 4
    buf, _ = alloc_buffer(pages * p * sum(item_lens), "cpu")
    views = layer_views(buf, pages, p, item_lens)
    off = 0
    for v, il in zip(views, item_lens):
        assert v.shape == (pages, p, il) and v.dtype == np.uint8 and v.flags.c_contiguous
        assert buffer_addr(v) == buffer_addr(buf) + off
        off += pages * p * il
    views[-1][pages - 1, p - 1, il - 1] = 7
    assert buf[-1] == 7  # a view, not a copy
    with pytest.raises(ValueError, match="cannot hold"):
        layer_views(buf, pages + 1, p, item_lens)
