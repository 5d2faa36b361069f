"""One long engine batch (shared by the sender- and rank-side batch timeout tests).

Mooncake, direct, page_size 1, dcp 1: every token of every layer is its own page run, so its own
descriptor, and ``TOKENS * LAYERS`` = 40,000 go in ONE batch (no ``max_batch_indices``), which
takes ~1.3-3 s on this 2-core machine: far longer than ``TIMEOUT_S``.
"""
import numpy as np
import pytest

from dcp_jax.transfer import TransferStatus

from bridge.mooncake import mooncake_available
from conftest import Cluster

TOKENS, LAYERS = 10000, 4
DESCRIPTORS = TOKENS * LAYERS
TIMEOUT_S = 0.3

needs_mooncake = pytest.mark.skipif(not mooncake_available(), reason="Mooncake is not installed")


def long_batch_cluster(direction, *, rank_timeout_s=TIMEOUT_S, tokens=TOKENS, **kw):
    """A `Cluster` whose sender has ``timeout_s=TIMEOUT_S`` and whose rank has ``rank_timeout_s``."""
    c = Cluster("mooncake", dcp_size=1, item_lens=(8,) * LAYERS, page_size=1, pages=tokens, mode="direct",
                direction=direction, timeout_s=rank_timeout_s, seed=3, **kw)
    c.sender.timeout_s = TIMEOUT_S
    return c


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
