"""DCP decode of the tiny model over a mesh of 8 CPU devices in one process (no connector):
the issue's matrix against the single-device reference (= DCP 1). fp32: DCP 2, 4, 8 x interleave 1
and the page size at 1,000 tokens, two of them at 3,001 (the full matrix runs multi-process in
`dcp_jax.generate.matrix`, results in benchmarks/results/generate_matrix_cpu.json): 32 new tokens
equal and logits within 1e-5 relative at every step; bf16: the first 8 tokens and 2e-2. Slow
(about 1.5 CPU-minutes on 2 cores): one compile per configuration."""
import dataclasses
import functools

import pytest

from dcp_jax.generate.config import GenerateConfig
from dcp_jax.generate.inprocess import generate_in_process, prefill_rows
from dcp_jax.generate.run import compare_logits, make_prompt

PAGE = 16


@functools.lru_cache(maxsize=None)
def _reference(prompt_tokens: int, dtype: str, model: str):
    cfg = GenerateConfig(dcp_size=1, prompt_tokens=prompt_tokens, dtype=dtype, model=model, page_size=PAGE)
    prompt = make_prompt(cfg)
    rows = prefill_rows(cfg, prompt)
    return cfg, prompt, rows, generate_in_process(cfg, prompt, rows)


def _check(dcp_size, prompt_tokens, dtype="fp32", model="mla", **kw):
    cfg, prompt, rows, (ref_tokens, ref_logits) = _reference(prompt_tokens, dtype, model)
    cfg = dataclasses.replace(cfg, dcp_size=dcp_size, **kw)
    tokens, logits = generate_in_process(cfg, prompt, rows)
    rep = compare_logits(dtype, tokens, ref_tokens, logits, ref_logits)
    assert rep["passed"], rep
    return rep


@pytest.mark.slow
@pytest.mark.parametrize("dcp_size,interleave_size,prompt_tokens",
                         [(n, i, 1000) for n in (2, 4, 8) for i in (1, PAGE)] + [(8, 1, 3001), (4, PAGE, 3001)])
def test_fp32_tokens_and_logits_equal_single_device(dcp_size, interleave_size, prompt_tokens):
    rep = _check(dcp_size, prompt_tokens, interleave_size=interleave_size)
    assert rep["tokens_match"] and rep["steps_compared"] == 32


@pytest.mark.slow
@pytest.mark.parametrize("dcp_size", [8])
def test_bf16_first_8_tokens(dcp_size):
    rep = _check(dcp_size, 3001, dtype="bf16")
    assert rep["matching_prefix"] >= 8 and rep["max_logit_rel_err"] > 0  # bf16 rounding is visible


@pytest.mark.slow
@pytest.mark.parametrize("merge", ["ag_ar", "a2a"])
def test_other_merge_forms(merge):
    _check(4, 1000, merge=merge, interleave_size=3)


@pytest.mark.slow
def test_gqa_variant():
    _check(8, 1000, model="gqa", interleave_size=PAGE)


def test_a_changed_row_is_seen():
    """One changed element of one token's row (a transfer bug) moves the logits past 1e-5.
    (Swapping two rows would not: each row carries its roped key, attention is order-free.)"""
    cfg, prompt, rows, (ref_tokens, ref_logits) = _reference(1000, "fp32", "mla")
    bad = [r.copy() for r in rows]
    bad[0][10, 0] += 1.0  # token 10 lives on rank 0 at DCP 2
    tokens, logits = generate_in_process(dataclasses.replace(cfg, dcp_size=2), prompt, bad)
    rep = compare_logits("fp32", tokens, ref_tokens, logits, ref_logits)
    assert not rep["passed"] and rep["max_logit_rel_err"] > 1e-5
