"""The heterogeneous plan over real engines (NIXL, Mooncake over loopback): direct cache-to-cache
descriptors for random pairs of sides (page sizes, DCP sizes and interleaves, TP splits, every
layout pair), byte-exact against the per-token reference mover; plus hand cases and errors.
"""
from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from bridge import available_engines, make_engine  # noqa: E402
from dcp_jax.hetero import HeteroSide, build_hetero_plan  # noqa: E402
from dcp_jax.hetero.engine_path import execute_over_engines, stream_descriptors  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hetero_reference import reference_move  # noqa: E402
from test_hetero_plan import _caches, sides  # noqa: E402

ENGINES = list(available_engines())


@pytest.fixture(scope="module")
def pairs():
    made = {k: (make_engine(k, f"het-{k}-ini"), make_engine(k, f"het-{k}-tgt")) for k in ENGINES}
    yield made
    for a, b in made.values():
        a.close()
        b.close()


def _run(pair_sides, start, length, num_layers, seed, engines, mla_src=0):
    p, d = pair_sides
    rng = np.random.default_rng(seed)
    stop = start + length
    src_tables, src = _caches(rng, p, stop, num_layers, True)
    dst_tables, dst = _caches(rng, d, stop, num_layers, False)
    ref = {k: [a.copy() for a in v] for k, v in dst.items()}
    plan = build_hetero_plan(p, d, start, stop, src_tables, dst_tables, mla_source_tp_rank=mla_src % p.tp_size)
    stats = execute_over_engines(plan, src, dst, num_layers, engines=engines)
    reference_move(p, d, start, stop, src_tables, dst_tables, src, ref, num_layers,
                   mla_source_tp_rank=mla_src % p.tp_size)
    bad = [k for k in dst if not all(np.array_equal(a, b) for a, b in zip(dst[k], ref[k]))]
    assert not bad, f"decode ranks {bad} differ from the per-token reference"
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                 HealthCheck.function_scoped_fixture])
@given(pair=sides(), start=st.integers(0, 40), length=st.integers(1, 24), num_layers=st.integers(1, 2),
       seed=st.integers(0, 2**32 - 1), mla_src=st.integers(0, 7))
def test_random_pairs_over_the_engine_equal_the_reference(pairs, kind, pair, start, length, num_layers, seed,
                                                          mla_src):
    _run(pair, start, length, num_layers, seed, pairs[kind], mla_src)


@pytest.mark.parametrize("kind", ENGINES)
def test_llama_like_gqa_tp2_page16_to_tp4_dcp2_page64_hnd(pairs, kind):
    """The issue's example pair (8 KV heads of 128, bf16): prefill TP2 page 16 NHD, decode TP4,
    DCP2, page 64, HND; 2 layers, 300 tokens."""
    p = HeteroSide(16, 1, 1, 2, "nhd", 8, 128, "bfloat16")
    d = HeteroSide(64, 2, 1, 4, "hnd", 8, 128, "bfloat16")
    stats = _run((p, d), 0, 300, 2, 7, pairs[kind])
    assert stats["bytes"] == 300 * 8 * 128 * 2 * 2 * 2  # tokens x heads x dim x bf16 x K,V x layers
    assert set(stats["descriptors_per_dst"]) == {(r, t) for r in range(2) for t in range(4)}


@pytest.mark.parametrize("kind", ENGINES)
def test_mla_page128_to_page32_and_tpu_mla(pairs, kind):
    """MLA rows, prefill page 128 -> decode page 32 (sglang layout), and sglang -> TPU MLA (two
    bf16 tokens per row, lanes padded 576 -> 640) with an odd token count."""
    _run((HeteroSide(128, 1, 1, 1, "sglang_mla", 1, 576), HeteroSide(32, 2, 1, 1, "sglang_mla", 1, 576)),
         0, 333, 2, 3, pairs[kind])
    _run((HeteroSide(16, 1, 1, 1, "sglang_mla", 1, 576), HeteroSide(32, 3, 32, 1, "tpu_mla", 1, 576)),
         5, 77, 1, 4, pairs[kind])


def test_descriptors_merge_page_runs_and_name_missing_caches():
    p = HeteroSide(16, 1, 1, 1, "sglang_mla", 1, 8)
    d = HeteroSide(16, 1, 1, 1, "sglang_mla", 1, 8)
    src = {(0, 0): [np.zeros((4, 16, 8), np.uint16)]}
    dst = {(0, 0): [np.zeros((4, 16, 8), np.uint16)]}
    plan = build_hetero_plan(p, d, 0, 48, [np.array([2, 0, 1])], [np.array([0, 1, 2])])
    descs = stream_descriptors(plan, src, dst, 1)[(0, 0, 0, 0)]
    # page 2 -> 0, then pages 0,1 -> 1,2 continue on both sides: two descriptors (in source-address
    # order: source pages 0,1 first)
    assert descs.tolist() == [[src[(0, 0)][0].ctypes.data, dst[(0, 0)][0].ctypes.data + 16 * 16, 2 * 16 * 16],
                              [src[(0, 0)][0].ctypes.data + 2 * 16 * 16, dst[(0, 0)][0].ctypes.data, 16 * 16]]
    with pytest.raises(ValueError, match=r"dst_caches\[\(0, 0\)\] must hold 2 layer caches"):
        stream_descriptors(plan, {(0, 0): src[(0, 0)] * 2}, dst, 2)
