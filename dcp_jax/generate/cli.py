"""``dcp-jax generate``: disaggregated generation end to end, checked against one process."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from dcp_jax.cli_options import _check_out_path, _rank_failed

__all__ = ["generate"]


def generate(
    dcp_size: int = typer.Option(2, help="Decode DCP ranks N (one process each, merged through jax.distributed)."),
    prompt_tokens: int = typer.Option(3001, help="Prompt length (at most 131,072); the prefill ships the KV of all "
                                                 "but the last token, which the first decode step consumes."),
    new_tokens: int = typer.Option(32, help="Tokens to generate greedily (at most 4,096)."),
    engine: str = typer.Option("nixl", help="Transfer engine: nixl or mooncake."),
    dtype: str = typer.Option("fp32", help="fp32 or bf16 (weights, activations, KV cache)."),
    model: str = typer.Option("mla", help="mla (DeepSeek MLA: latent 512 + rope 64) or gqa."),
    interleave_size: int = typer.Option(1, help="Decode-side interleave I (1 = token round-robin; the page "
                                                "size = page round-robin)."),
    page_size: int = typer.Option(16, help="Tokens per KV page of the decode ranks (and of the prefill, "
                                           "unless --prefill-page-size)."),
    prefill_page_size: Optional[int] = typer.Option(None, help="Tokens per KV page of the prefill ranks "
                                                               "(default: --page-size)."),
    prefill_dcp_size: int = typer.Option(1, help="Prefill DCP ranks M (each holds its shard of the KV)."),
    prefill_interleave_size: int = typer.Option(1, help="Prefill-side interleave; needs --prefill-dcp-size > 1."),
    merge: str = typer.Option("ag_rs", help="Partial-attention merge: ag_rs, ag_ar or a2a."),
    seed: int = typer.Option(0, help="Seeds the weights, the prompt and the page tables."),
    timeout_s: float = typer.Option(600.0, help="Deadline of any wait (seconds)."),
    device: str = typer.Option("cpu", help="cpu, or gpu: decode rank r on GPU r (needs --dcp-size GPUs; NCCL), "
                                           "prefill (CuPy pages) and reference on GPU 0."),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Compare against a "
                                                                            "single-process run."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON to this path."),
    corrupt_rank: Optional[int] = typer.Option(None, hidden=True, help="Test hook: this decode rank changes "
                                                                       "one received row."),
) -> None:
    """Prefill a random prompt, ship its KV through the connector to DCP decode processes, decode greedily.

    Prints the tokens, the time to first token (prefill / transfer / first decode step), the time
    per output token, and whether tokens and logits equal a single-process run (fp32: all tokens,
    logits within 1e-5 relative; bf16: the first 8 tokens, 2e-2). Exit 1 if not, 2 for bad options.
    """
    from dcp_jax.generate.config import GenerateConfig
    from dcp_jax.generate.run import run_generate

    try:
        cfg = GenerateConfig(dcp_size=dcp_size, prompt_tokens=prompt_tokens, new_tokens=new_tokens, engine=engine,
                             dtype=dtype, model=model, interleave_size=interleave_size, page_size=page_size,
                             prefill_page_size=prefill_page_size, prefill_dcp_size=prefill_dcp_size, prefill_interleave_size=prefill_interleave_size,
                             merge=merge, seed=seed, timeout_s=timeout_s, device=device,
                             corrupt_rank=corrupt_rank)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    _check_out_path(json_path, "--json")  # as `transfer` and `plan`: refused before the run, exit status 2
    from dcp_jax.job.config import check_device, engine_env

    try:
        check_device(device)  # CuPy and a CUDA device, before any process starts
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    engine_env(device)  # (no JAX preallocation on a GPU: several processes share GPU 0)
    console = Console()
    console.print(f"[bold]dcp-jax generate[/]: {model} {dtype}, prompt {prompt_tokens:,} tokens, prefill "
                  f"DCP{prefill_dcp_size} -> decode DCP{dcp_size} (I={interleave_size}, page {page_size}, "
                  f"{merge}), engine {engine}, device {device}, {new_tokens} new tokens")
    try:
        rep = run_generate(cfg, with_reference=reference)
    except (RuntimeError, TimeoutError) as exc:  # a rank failed or hung: its own error, exit 1
        _rank_failed(exc)
    console.print(f"tokens:    {rep['tokens']}")
    if reference:
        console.print(f"reference: {rep['reference_tokens']}")
    t = Table(title="time to first token and per output token")
    for col in ("ttft", "prefill", "transfer", "first decode step", "tpot (mean)", "tpot (median)"):
        t.add_column(col, justify="right")
    p = rep["ttft_parts_s"]
    ms = lambda v: "-" if v is None else f"{v * 1e3:,.1f} ms"  # noqa: E731
    t.add_row(ms(rep["ttft_s"]), ms(p["prefill_s"]), ms(p["transfer_s"]), ms(p["first_decode_s"]),
              ms(rep["tpot_s"]), ms(rep["tpot_median_s"]))
    t.caption = (f"first decode step includes the receivers' hand-over of the pages "
                 f"({rep['receiver_close_s'] * 1e3:.1f} ms); KV appended in place: {rep['kv_in_place']}")
    console.print(t)
    if json_path is not None:
        json_path.write_text(json.dumps(rep, indent=2, default=_plain))
        console.print(f"wrote {json_path}")
    if not reference:
        return
    verdict = "[green bold]match[/]" if rep["passed"] else "[red bold]MISMATCH[/]"
    console.print(f"{verdict}: tokens equal {rep['matching_prefix']}/{new_tokens} (need {rep['tokens_required']}), "
                  f"max logit rel err {rep['max_logit_rel_err']:.2e} (tolerance {rep['tolerance']:g}) over "
                  f"{rep['steps_compared']} steps; ranks agree: {rep['ranks_agree']}")
    if not rep["passed"]:
        raise typer.Exit(1)


def _plain(o):
    import numpy as np

    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    return str(o)
