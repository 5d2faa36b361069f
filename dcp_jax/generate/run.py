"""Orchestration of ``dcp-jax generate``: start the processes, time the request, check the tokens.

`run_generate` spawns ``prefill_dcp_size`` prefill processes and ``dcp_size`` decode processes
(`dcp_jax.generate.workers`), releases the prefill once every decode rank expects the request and
has compiled its step, collects the timings, then runs the single-process reference
(`reference_generate`: the same model, prefill and a one-device decode in this process, no
connector) and compares tokens and logits.

Timing (one monotonic clock for the machine): ``prefill_s`` from the prefill's start to its rows
sitting in its pages (slowest prefill rank); ``transfer_s`` from there to the last decode rank's
SUCCESS; ``first_decode_s`` from there to the first new token on rank 0 (the receivers hand the
pages over, then one decode step); ``ttft_s`` is their sum. ``tpot_s`` is the mean step time
after the first.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import platform
import socket
import time

import numpy as np

from dcp_jax.generate.config import TOLERANCES, GenerateConfig
from dcp_jax.generate.workers import decode_main, prefill_main
from dcp_jax.child_process import Child

__all__ = ["run_generate", "reference_generate", "compare_logits", "make_prompt"]


def make_prompt(cfg: GenerateConfig) -> np.ndarray:
    """The request's token ids (seeded), i32[prompt_tokens]."""
    vocab = cfg.model_config().vocab_size
    return np.random.default_rng(cfg.seed + 7).integers(0, vocab, cfg.prompt_tokens).astype(np.int32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes(cfg: GenerateConfig, prompt: np.ndarray) -> dict:
    ctx = mp.get_context("spawn")  # engines and JAX want fresh processes
    coordinator = f"127.0.0.1:{_free_port()}"
    prefills, decodes = [], []
    ok = False
    try:
        prefills = [Child(ctx, f"prefill {m}", prefill_main, cfg, m, prompt) for m in range(cfg.prefill_dcp_size)]
        decodes = [Child(ctx, f"decode rank {r}", decode_main, cfg, r, coordinator, prompt)
                   for r in range(cfg.dcp_size)]
        t = cfg.timeout_s
        addresses = [p.recv("address", t) for p in prefills]
        for d in decodes:
            d.send("open", dict(addresses=addresses))
        ready = [d.recv("ready", t) for d in decodes]
        for p in prefills:
            p.recv("ready", t)
        for p in prefills:
            p.send("go", None)
        done = [p.recv("done", t) for p in prefills]
        results = [d.recv("result", t) for d in decodes]
        for p in prefills:
            p.send("close", None)
            p.recv("closed", 30)
        ok = True
        return dict(prefill=done, decode=results, ready=ready)
    finally:
        for c in prefills + decodes:
            c.stop(10 if ok else 0)  # after an error or Ctrl-C: killed at once (it took 20 s)


def reference_generate(cfg: GenerateConfig, prompt: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Single-process generation of the same model and prompt: prefill, then a one-device decode
    (no connector, no DCP). Returns ``(tokens, logits f32[new_tokens, vocab])``."""
    import dataclasses

    from dcp_jax.generate.inprocess import generate_in_process

    one = dataclasses.replace(cfg, dcp_size=1, interleave_size=1, prefill_dcp_size=1, corrupt_rank=None)
    return generate_in_process(one, prompt)


def compare_logits(dtype: str, tokens, ref_tokens, logits, ref_logits) -> dict:
    """Token agreement and ``max |l - l_ref| / max |l_ref|`` per step over the steps whose inputs
    agree (step k is compared when tokens ``< k`` are equal); the verdict uses `TOLERANCES`."""
    tol, lead = TOLERANCES[dtype]
    steps = len(ref_tokens)
    same = [a == b for a, b in zip(tokens, ref_tokens)]
    prefix = next((k for k, s in enumerate(same) if not s), steps)
    compared = min(steps, prefix + 1)
    err = [float(np.max(np.abs(logits[k] - ref_logits[k])) / np.max(np.abs(ref_logits[k]))) for k in range(compared)]
    need = steps if lead is None else min(lead, steps)
    passed = prefix >= need and max(err[:need], default=0.0) <= tol
    return dict(tokens_match=prefix == steps, matching_prefix=prefix, steps_compared=compared,
                max_logit_rel_err=max(err, default=0.0), logit_rel_err_per_step=err, tolerance=tol,
                tokens_required=need, passed=passed)


def run_generate(cfg: GenerateConfig, *, with_reference: bool = True) -> dict:
    """Runs one disaggregated generation and (by default) its single-process reference.

    Returns the report dict (the JSON of ``dcp-jax generate --json``).

    Raises:
      RuntimeError: a process failed or went silent (message names it and carries its traceback).
    """
    import jax

    prompt = make_prompt(cfg)
    t_wall = time.monotonic()
    out = _processes(cfg, prompt)
    bad = [r for r in out["decode"] + out["prefill"] if r["status"] != "SUCCESS"]
    if bad:
        raise RuntimeError("transfer failed: " + "; ".join(f"{r['status']}: {r['reason']}" for r in bad))
    dec, pre = out["decode"], out["prefill"]
    t_start = min(p["t_start"] for p in pre)
    t_rows = max(p["t_sent"] for p in pre)
    t_success = max(d["t_success"] for d in dec)
    marks = dec[0]["step_done"]
    parts = dict(prefill_s=t_rows - t_start, transfer_s=t_success - t_rows, first_decode_s=marks[0] - t_success)
    steps_s = np.diff(marks).tolist()
    rep = dict(
        config=cfg.as_dict(), model=dict(vars(cfg.model_config())),
        tokens=dec[0]["tokens"], ranks_agree=all(d["tokens"] == dec[0]["tokens"] for d in dec),
        ttft_s=sum(parts.values()), ttft_parts_s=parts,
        tpot_s=float(np.mean(steps_s)) if steps_s else None,
        tpot_median_s=float(np.median(steps_s)) if steps_s else None,
        receiver_close_s=max(d["t_closed"] - d["t_success"] for d in dec),
        kv_in_place=all(d["kv_in_place"] for d in dec),
        decode_compile_s=max(r["compile_s"] for r in out["ready"]),
        transfer_stats=[p["stats"] for p in pre], processes_s=time.monotonic() - t_wall,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(platform=platform.platform(), cpus=__import__("os").cpu_count(), jax=jax.__version__),
    )
    if with_reference:
        ref_tokens, ref_logits = reference_generate(cfg, prompt)
        rep["reference_tokens"] = ref_tokens
        rep.update(compare_logits(cfg.dtype, rep["tokens"], ref_tokens, dec[0]["logits"], ref_logits))
        rep["passed"] = rep["passed"] and rep["ranks_agree"]
    return rep
