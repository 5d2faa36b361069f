"""The sender's ``timeout_s`` against one long engine batch, and `send` after a full prefix hit,
found by a fresh-user trial (real engines on loopback):

- a request whose single engine batch took longer than the sender's ``timeout_s`` FAILED while
  its bytes were still moving (Mooncake, direct: one descriptor per page run per layer; ~120k
  descriptors a rank with ``timeout_s=10``): the clock only moved when a batch was posted or
  completed. A batch the engine still reports live now counts as progress up to ``timeout_s`` +
  its size allowance (`_sender_endings.batch_allowance`); past that it still FAILS;
- `send` of a chunk past the ranks' ``num_tokens`` on a request that ended SUCCESS by a full
  prefix hit (nothing was ever sent) was accepted silently.
"""
import time

import numpy as np
import pytest

from _long_batch import (DESCRIPTORS, TIMEOUT_S, TOKENS, bound_text, long_batch_cluster, needs_mooncake,
                         ship_one_long_batch)
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus
from dcp_jax.transfer import _sender_endings

S = TransferStatus


def _long_batch_cluster(direction):
    return long_batch_cluster(direction, rank_timeout_s=30.0)  # the sender's clock only


@needs_mooncake
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_one_batch_longer_than_timeout_s_ends_success_byte_exact(direction):
    # Before: FAILED after ~0.3 s, "no progress for 0.3 s; windows still in flight (no
    # completion from the engine) to decode rank(s) 0 (1)", while the engine was moving the batch.
    c = _long_batch_cluster(direction)
    try:
        ship_one_long_batch(c)  # longer than the sender's timeout_s: SUCCESS, byte-exact
    finally:
        c.close()


@needs_mooncake
def test_a_batch_past_its_size_bound_still_fails(monkeypatch):
    # A batch the engine still reports live is no stall only within timeout_s + its size
    # allowance: with a (test-only) allowance of 1 us a descriptor (0.1 s here) the same batch
    # is past its bound long before it completes, and the request FAILS on both sides.
    monkeypatch.setattr(_sender_endings, "BATCH_DESCRIPTOR_S", 1e-6)
    c = _long_batch_cluster("push")
    try:
        src, dst = c.tables(TOKENS)
        c.expect("stuck", dst, TOKENS)
        t0 = time.monotonic()
        c.sender.send("stuck", src, 0, TOKENS)
        assert c.wait("stuck", timeout_s=30) == [S.FAILED, S.FAILED], c.reasons("stuck")
        reason = c.sender.failure_reason("stuck")
        assert reason.startswith(f"no progress for {TIMEOUT_S:g} s; an engine batch to decode rank 0 "
                                 f"({DESCRIPTORS:,} descriptors"), reason
        assert "has not completed in" in reason and bound_text(1e-6) in reason, reason
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 30  # the engine stops the batch after its current window
        while not c.sender.is_drained("stuck") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.sender.is_drained("stuck")
    finally:
        c.close()


def test_allowance_scales_with_the_batch():
    assert _sender_endings.batch_allowance(0, 0) == 0
    assert _sender_endings.batch_allowance(120_000, 0) == pytest.approx(120.0)
    assert _sender_endings.batch_allowance(1, 64 << 20) == pytest.approx(1e-3 + (64 << 20) / 10e6)


def test_send_past_num_tokens_after_a_full_prefix_hit_is_refused(engine):
    # Before: the request ended SUCCESS with nothing sent (every rank held all 16 tokens), and a
    # send of tokens [16, 20) was accepted silently although no rank has room for them.
    items = (48, 16)
    rng = np.random.default_rng(5)
    src = [rng.integers(0, 256, (16, 4, il), dtype=np.uint8) for il in items]
    dst = [np.full((16, 4, il), 0xA5, np.uint8) for il in items]
    spec = KVCacheSpec(2, items, 4)
    with KVSender(spec, src, engine=engine) as s, KVReceiver(spec, dst, engine=engine) as r:
        r.connect(s.address)
        r.expect("hit", np.arange(4), 16, prefix_tokens=16)
        assert r.wait("hit", 5) is S.SUCCESS
        deadline = time.monotonic() + 10
        while s.stats["requests"] == 0 and time.monotonic() < deadline:  # its announcement arrived
            time.sleep(0.01)
        assert s.wait("hit", 5) is S.SUCCESS
        with pytest.raises(ValueError, match=r"stop=20 passes the 16 tokens .* request_id='hit', which is SUCCESS"):
            s.send("hit", np.arange(5), 16, 20)
        with pytest.raises(ValueError, match=r"stop=17 passes"):
            s.send("hit", np.arange(5), 8, 17)
        assert s.send("hit", np.arange(4), 0, 16) is None  # within num_tokens: the documented no-op
        assert s.send("hit", np.arange(4), 4, 8) is None
        assert s.poll("hit") is S.SUCCESS and r.poll("hit") is S.SUCCESS
        assert all((d == 0xA5).all() for d in dst)  # nothing was written
