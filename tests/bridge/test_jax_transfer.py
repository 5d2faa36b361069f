"""CPU: `bridge.jax_transfer` (jax.experimental.transfer) between two processes, byte-exact.

The owner runs in a spawned process (tests/bridge/_jax_transfer_worker.py) and offers arrays;
this process pulls them. bf16 arrays go through every staging kind: sglang-jax reports that
unpinned host staging corrupts bf16 strides in this engine (not reproduced on CPU with jax
0.11.2: all three kinds are exact here; the engine stages through pinned_host by default).
About 10 s (one spawned JAX process).
"""

import multiprocessing as mp

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.errors import PeerError, TransferTimeout
from bridge.jax_transfer import JaxTransferServer

from ._jax_transfer_worker import case_arrays, owner_main

CASES = ("mla-bf16", "gqa-interleaved-bf16", "mla-sliced-from-640-bf16", "pack-u8")


@pytest.fixture(scope="module")
def owner():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=owner_main, args=(child,), daemon=True)
    proc.start()

    def call(*cmd, timeout_s=60.0):
        parent.send(cmd)
        if not parent.poll(timeout_s):
            raise TimeoutError(f"owner did not answer {cmd[0]!r} in {timeout_s} s")
        reply = parent.recv()
        assert reply[0] == "ok", reply[1]
        return reply[1:]

    yield call
    try:
        call("close", timeout_s=10.0)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.fixture(scope="module")
def puller():
    with JaxTransferServer("puller") as eng:
        yield eng


def _bits(a) -> np.ndarray:
    """Raw bytes of an array (bf16 compared as bits, never as floats)."""
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("staging", ["pinned_host", "unpinned_host", "device"])
@pytest.mark.parametrize("case", CASES)
def test_pull_is_byte_exact(owner, puller, case, staging):
    uuid = 1000 + CASES.index(case) * 10 + ["pinned_host", "unpinned_host", "device"].index(staging)
    address, specs = owner("offer", uuid, staging, case)
    out = puller.pull(address, uuid, [(tuple(s), jnp.dtype(d)) for s, d in specs], timeout_s=30)
    want = case_arrays(case)
    assert len(out) == len(want)
    for got, w in zip(out, want):
        assert got.shape == w.shape and got.dtype == w.dtype
        assert got.sharding.memory_kind == "device"
        np.testing.assert_array_equal(_bits(got), _bits(w))
    assert owner("release", uuid) == (True,)
    assert owner("release", uuid) == (False,)  # released once


def test_pull_of_a_missing_offer_times_out(owner, puller):
    address, _ = owner("offer", 7, "pinned_host", "mla-bf16")
    with pytest.raises(TransferTimeout, match="pull of offer 8 timed out"):
        puller.pull(address, 8, [((1000, 576), jnp.bfloat16)], timeout_s=1.0)
    owner("release", 7)


def test_offer_rules_in_process():
    with JaxTransferServer("local") as eng:
        specs = eng.offer(5, [np.arange(10, dtype=np.uint8)])
        assert specs[0].shape == (10,) and eng.live_offers == 1
        with pytest.raises(ValueError, match="uuid=5 is already offered"):
            eng.offer(5, [np.zeros(3, np.uint8)])
        assert eng.release(5) and not eng.release(5)
        with pytest.raises(ValueError, match="uuid=-1 must be an int"):
            eng.offer(-1, [np.zeros(3, np.uint8)])
        with pytest.raises(ValueError, match="arrays must be a non-empty list"):
            eng.offer(6, [])
        with pytest.raises(TypeError, match="arrays\\[0\\] must be a numpy or JAX array"):
            eng.offer(6, [b"abc"])
        with pytest.raises(ValueError, match="timeout_s=0 must be a positive"):
            eng.pull(eng.address, 6, [((3,), jnp.uint8)], timeout_s=0)
        with pytest.raises(ValueError, match="specs must be a non-empty list"):
            eng.pull(eng.address, 6, [])
        info = eng.peer_info()
        assert JaxTransferServer.peer_address(info) == eng.address
        with pytest.raises(PeerError, match="not a 'jax-transfer' peer_info"):
            JaxTransferServer.peer_address({"engine": "nixl", "address": "x:1"})
        with pytest.raises(PeerError, match="must be a 'host:port' str"):
            JaxTransferServer.peer_address({"engine": "jax-transfer", "address": 5})
    with pytest.raises(ValueError, match="staging='hbm' must be one of"):
        JaxTransferServer("x", staging="hbm")
    with pytest.raises(RuntimeError, match="is closed"):
        eng.offer(1, [np.zeros(1, np.uint8)])


def test_offer_copies_so_the_caller_may_reuse_its_buffer():
    with JaxTransferServer("copy", staging="pinned_host") as eng:
        src = np.arange(64, dtype=np.uint8)
        eng.offer(1, [src])
        staged = eng._offers[1][0]
        assert staged.sharding.memory_kind == "pinned_host"
        src[:] = 0  # the pack buffer is reused for the next request
        np.testing.assert_array_equal(np.asarray(staged), np.arange(64, dtype=np.uint8))
        assert jax.device_get(staged).sum() == sum(range(64))
    with JaxTransferServer("copy-device", staging="device") as eng:
        pack = jnp.arange(64, dtype=jnp.uint8)
        eng.offer(2, [pack])
        assert eng._offers[2][0].unsafe_buffer_pointer() != pack.unsafe_buffer_pointer()
