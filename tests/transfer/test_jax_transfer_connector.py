"""The connector (KVSender / KVReceiver) over ``engine="jax-transfer"``, unchanged, on the CPU.

The connector's engine-parametrized tests are imported here with an `engine` fixture that gives
"jax-transfer" (it overrides tests/transfer/conftest.py's), so push and pull, packed and direct,
prefix hits, empty ranks, a small arena, id reuse and close run against
`bridge.jax_engine.JaxTransferEngine` exactly as against NIXL and Mooncake. Then a bf16 cache
(sglang-jax's staging warning) through both directions, compared bit for bit.
"""
import ml_dtypes
import numpy as np
import pytest

from conftest import TransferStatus
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender
from test_connector import (  # noqa: F401 - collected here, run with the fixture below
    test_chunked_request_lands_byte_exact, test_close_releases_registrations_and_is_bounded,
    test_jax_arrays_as_caller_kv, test_many_concurrent_requests_small_arena, test_prefix_hit_sends_only_the_tail,
    test_rank_with_no_tokens_still_completes, test_send_before_expect_and_release_reuse)


@pytest.fixture
def engine():
    return "jax-transfer"


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_bf16_mla_cache_lands_bit_exact(direction):
    """A bf16 [pages, 16, 576] cache (DeepSeek MLA rows), DCP-2, token round-robin: every row of
    every rank equals the sender's bits; untouched pages keep their sentinel."""
    pages, p, n, tokens = 12, 16, 2, 150
    rng = np.random.default_rng(5)
    bits = ((rng.integers(0, 2**16, (pages, p, 576), dtype=np.uint16) & 0xBFFF) | 0x2000).astype(np.uint16)
    src = [bits.view(ml_dtypes.bfloat16)]
    spec = KVCacheSpec(1, [576 * 2], p)
    sender = KVSender(spec, src, engine="jax-transfer", timeout_s=20, peer_timeout_s=5)
    dst = [np.full((pages, p, 576), 0xFFFF, np.uint16).view(ml_dtypes.bfloat16) for _ in range(n)]
    recvs = []
    try:
        for r in range(n):
            recvs.append(KVReceiver(KVCacheSpec(1, [576 * 2], p, n, r), [dst[r]], engine="jax-transfer",
                                    direction=direction, timeout_s=20, peer_timeout_s=5))
            recvs[-1].connect(sender.address)
        src_table = np.array([3, 7, 1, 0, 9, 2, 11, 4, 5, 6], np.int64)  # 10 pages hold 150 tokens
        dst_tables = [np.array([8, 2, 5, 0, 10], np.int64), np.array([1, 9, 4, 6, 3], np.int64)]
        for r in range(n):
            recvs[r].expect("bf16", dst_tables[r], tokens)
        sender.send("bf16", src_table, 0, tokens)
        for side in [sender] + recvs:
            while not side.poll("bf16").terminal:
                pass
            assert side.poll("bf16") is TransferStatus.SUCCESS, side.failure_reason("bf16")
        flat_src = bits.reshape(-1, 576)
        for t in range(tokens):
            r, j = t % n, t // n
            got = dst[r].view(np.uint16)[dst_tables[r][j // p], j % p]
            np.testing.assert_array_equal(got, flat_src[src_table[t // p] * p + t % p], err_msg=f"token {t}")
        for r in range(n):
            unused = np.setdiff1d(np.arange(pages), dst_tables[r])
            assert (dst[r].view(np.uint16)[unused] == 0xFFFF).all()
    finally:
        for recv in recvs:
            recv.close()
        sender.close()
