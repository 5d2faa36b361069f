"""One long engine batch (shared by the sender- and rank-side batch timeout tests).

Mooncake, direct, page_size 1, dcp 1: every token of every layer is its own page run, so its own
descriptor, and ``TOKENS * LAYERS`` = 100,000 go in ONE batch (no ``max_batch_indices``), which
takes ~1.2 s on a quiet host of 2026-12-07 (40,000 took 0.47 s there, under the 0.6 s the tests
need; 1.3-3 s on the 2-core machine of earlier sessions): far longer than ``TIMEOUT_S``. Tests
that shrink the sender's per-descriptor allowance use `TEST_DESCRIPTOR_S`, so the bound stays
well under the batch.
"""
import numpy as np
import pytest

from dcp_jax.transfer import TransferStatus

from bridge.mooncake import mooncake_available
from conftest import Cluster

TOKENS, LAYERS = 25000, 4
DESCRIPTORS = TOKENS * LAYERS
TIMEOUT_S = 0.3
#: A test-only sender allowance a descriptor: bound = TIMEOUT_S + 0.2 s, long before the batch ends.
TEST_DESCRIPTOR_S = 2e-6

needs_mooncake = pytest.mark.skipif(not mooncake_available(), reason="Mooncake is not installed")


def long_batch_cluster(direction, *, rank_timeout_s=TIMEOUT_S, tokens=TOKENS, **kw):
    """A `Cluster` whose sender has ``timeout_s=TIMEOUT_S`` and whose rank has ``rank_timeout_s``."""
    c = Cluster("mooncake", dcp_size=1, item_lens=(8,) * LAYERS, page_size=1, pages=tokens, mode="direct",
                direction=direction, timeout_s=rank_timeout_s, seed=3, **kw)
    c.sender.timeout_s = TIMEOUT_S
    return c


def bound_text(descriptor_s: float) -> str:
    """The bound a failure reason names for the long batch: ``timeout_s`` + the allowance per
    descriptor + 1 s per 10 MB (rows of 8 bytes), as the sender rounds it."""
    return f"past its bound of {TIMEOUT_S + DESCRIPTORS * descriptor_s + DESCRIPTORS * 8 / 1e7:.1f} s"


def check_bytes(c, src, dst):
    """Every token byte-exact at the one rank (page_size 1, one rank: row j of the table is token j)."""
    for layer in range(LAYERS):
        np.testing.assert_array_equal(c.dst[0][layer][dst[0], 0], c.src[layer][src, 0], err_msg=f"layer {layer}")


def batch_seconds(timeline):
    """Seconds from the batch's post to its completion, from the sender's timeline."""
    at = {name: t for name, _, t in timeline}
    return at["complete"] - at["post"]


def ship_one_long_batch(c, rid="long"):
    """Sends ``TOKENS`` tokens to the one rank as ONE engine batch and checks the outcome: both
    sides SUCCESS, every byte exact, and the batch outlived twice ``TIMEOUT_S`` (else the test
    meant nothing). Returns the sender's `request_stats`."""
    src, dst = c.tables(TOKENS)
    c.expect(rid, dst, TOKENS)
    c.sender.send(rid, src, 0, TOKENS)
    assert c.wait(rid, timeout_s=60) == [TransferStatus.SUCCESS] * 2, c.reasons(rid)
    stats = c.sender.request_stats(rid)
    assert stats["ranks"][0]["descriptors"] == DESCRIPTORS and stats["ranks"][0]["batches"] == 1
    assert batch_seconds(stats["timeline"]) > 2 * TIMEOUT_S, stats["timeline"]
    check_bytes(c, src, dst)
    return stats
