"""``dcp-jax`` command line: ``transfer`` (the main job, here), ``plan`` (the cost report,
`dcp_jax.cli_plan`), ``load`` (the connector's load generator, `dcp_jax.cli_load`) and ``generate``
(disaggregated generation, `dcp_jax.generate.cli`). A TP or layout option sends ``transfer`` and
``plan`` to `dcp_jax.cli_hetero`; what the commands share is `dcp_jax.cli_options`."""

from __future__ import annotations

if __name__ == "__main__":  # python -m dcp_jax.cli: the installed command's entry point, whose guard
    # turns a bad DCP_JAX_* switch (read while the imports below run) into one error line, exit 2.
    from dcp_jax.cli_entry import main as _entry

    _entry()  # runs the app (a second import of this module) and always exits

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dcp_jax.cli_load import load
from dcp_jax.cli_options import (_MODES, _check_out_path, _fail, _job_config, _json_default, _one_list,
                                 uses_hetero_job)
from dcp_jax.cli_plan import plan
from dcp_jax.generate.cli import generate
from dcp_jax.geometry import DEFAULT_GEOMETRY, geometry_names

app = typer.Typer(
    help="Move and merge the KV cache of long-context LLM serving under decode context parallelism.",
    no_args_is_help=True,
    add_completion=False,
    # Plain help: rich's option table cut long option names at 80 columns ("--prefill-interleave-s…").
    rich_markup_mode=None,
)



def _size_text(nbytes: int) -> str:
    """Bytes in decimal units, three significant digits: "2.30 GB", "393 kB", "1.00 MB" (a tiny
    model's request read "0.00 GB")."""
    units = (("kB", 1e3), ("MB", 1e6), ("GB", 1e9))
    k = max([i for i, (_, scale) in enumerate(units) if nbytes >= scale], default=-1)
    if k < 0:
        return f"{nbytes} B"
    x = nbytes / units[k][1]
    if x >= 999.5 and k < len(units) - 1:  # rounds up to 1,000: the next unit
        k, x = k + 1, nbytes / units[k + 1][1]
    text = f"{x:#.3g}".rstrip(".") if x < 999.5 else f"{x:,.0f}"
    return f"{text} {units[k][0]}"


def _descriptor_phrase(ratio: float) -> str:
    """``ratio`` = direct / packed descriptors, in words ("1.0x fewer" for a tiny request read wrong)."""
    if round(ratio, 1) > 1:
        return f"[bold]{ratio:.1f}x[/] fewer descriptors"
    if round(ratio, 1) < 1:
        return f"[bold]{1 / ratio:.1f}x[/] more descriptors"
    return "about as many descriptors"


@app.command()
def transfer(
    model: str = typer.Option(DEFAULT_GEOMETRY, help=f"Model KV geometry: {', '.join(geometry_names())}."),
    prompt_tokens: int = typer.Option(32768, help="Request length in tokens (prefix included)."),
    page_size: int = typer.Option(64, help="Tokens per KV page (decode side; both sides unless "
                                           "--prefill-page-size)."),
    prefill_page_size: Optional[int] = typer.Option(None, help="Tokens per KV page on the prefill side "
                                                               "(default: --page-size)."),
    dcp_size: int = typer.Option(8, help="Decode DCP ranks N (one process each)."),
    prefill_dcp_size: int = typer.Option(1, help="Prefill DCP ranks M (one process each; each holds its shard)."),
    interleave_size: int = typer.Option(1, help="Decode-side interleave I in tokens (1 = token round-robin, "
                                                "page size = page round-robin)."),
    prefill_interleave_size: int = typer.Option(1, help="Prefill-side interleave in tokens; needs "
                                                        "--prefill-dcp-size > 1 (refused with one prefill rank)."),
    chunk_tokens: Optional[int] = typer.Option(None, help="Chunked prefill: send in chunks of this many tokens "
                                                          "(a multiple of --page-size and of --prefill-page-size); packing of chunk k+1 "
                                                          "overlaps the transfer of chunk k."),
    prefix_tokens: int = typer.Option(0, help="Tokens decode already holds (not sent), below --prompt-tokens; "
                                              "a multiple of lcm(P*N, I*N) with P --page-size, N --dcp-size, "
                                              "I --interleave-size."),
    mode: str = typer.Option("both", help="direct (descriptors straight from the KV buffers), packed (gather "
                                          "each rank's rows into its pack region first) or both."),
    path: Optional[list[str]] = typer.Option(None, metavar="PATHS", help="Transfer paths to run, one comma list "
                                                  "of auto, direct, packed, region (one descriptor per window "
                                                  "into the decode rank's receive region, sized for its share "
                                                  "of a chunk) and fused (GPU: a kernel writing through CUDA "
                                                  "IPC); one run each, in order. Wins over --mode."),
    engine: str = typer.Option("nixl", help="Transfer engine: nixl, mooncake, jax-transfer "
                                             "(jax.experimental.transfer, every batch a pull, host "
                                             "memory) or auto (NIXL, else Mooncake)."),
    device: str = typer.Option("cpu", help="Where the KV, the pack buffer and the decode pools live: cpu (host "
                                           "memory) or gpu (CuPy device memory of GPU 0 registered as VRAM, "
                                           "the Pallas gather packing in place; needs CuPy, a CUDA GPU and "
                                           "--engine nixl, or mooncake with its CUDA build)."),
    prefill_gpus: Optional[str] = typer.Option(None, help="With --device gpu: GPUs of the prefill ranks, round-robin "
                                                          "(e.g. 0 or 0,1); default: the visible GPU 0."),
    decode_gpus: Optional[str] = typer.Option(None, help="With --device gpu: GPUs of the decode ranks, round-robin "
                                                         "(e.g. 1-7 or 0,2,4). Each process sees its GPU as "
                                                         "device 0 (CUDA_VISIBLE_DEVICES, its GPU first)."),
    direction: str = typer.Option("push", help="push (the sender WRITEs into the decode ranks) or pull (each "
                                               "decode rank READs its rows and reports on the control plane; "
                                               "with --engine jax-transfer: a pull of the rank's pack)."),
    staging: str = typer.Option("auto", help="The connector's staging, given to every sender and receiver: "
                                             "auto: each side stages through pinned host memory where its "
                                             "engine cannot register its KV (jax-transfer on the GPU); host: "
                                             "always (the KV stays in unregistered device memory: windows "
                                             "gathered on the device into a registered pinned-host pack, "
                                             "landed in a pinned-host receive region and copied into the "
                                             "device KV; path region); none: never."),
    pack_backend: str = typer.Option("auto", help="The senders' pack backend (KVSender(pack_backend=...)), "
                                                  "staged or not: auto, xla, host, tpu, tpu-interpret, "
                                                  "gpu-triton, gpu-triton-interpret, gpu-mosaic, "
                                                  "gpu-mosaic-interpret."),
    max_batch_indices: Optional[int] = typer.Option(None, help="Split each (chunk, rank) batch into windows "
                                                               "of at most this many rows."),
    pack_tokens: Optional[int] = typer.Option(None, help="Size the pack buffer for this many tokens "
                                                         "(default: the whole request); smaller forces sliced "
                                                         "packing (gather, send, wait, repeat)."),
    round_rows: Optional[int] = typer.Option(None, help="The most rows one sender round packs or copies in one "
                                                        "kernel launch (KVSender.warm_up(round_rows=...)); "
                                                        "default: the bucket of one window (a 32k chunk to 8 ranks: 4 launches); "
                                                        "on the region path with round notices, the whole request."),
    region_notify: str = typer.Option("auto", help="Region path: how a decode rank learns its window landed "
                                                   "(KVSender(region_notify=...)): 'write' (the engine's notification "
                                                   "with each write), 'round' (told once every write of the round "
                                                   "landed) or 'auto' ('round' when every process shares one GPU)."),
    mps: bool = typer.Option(False, "--mps", help="Needs --device gpu: run every process as a client of a private CUDA MPS "
                                                  "daemon the job starts and quits (processes on one GPU share "
                                                  "one context instead of time-slicing it); needs "
                                                  "nvidia-cuda-mps-control on PATH."),
    verify: bool = typer.Option(False, "--verify", help="Also send a CRC-32 per (chunk, rank, layer) with each "
                                                        "completion and check it on arrival. The full byte-for-"
                                                        "byte check of every rank's pool against the "
                                                        "deterministic pattern always runs and decides the "
                                                        "exit status."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON to this path."),
    seed: int = typer.Option(0, help="Seeds the KV bytes and the page allocators."),
    timeout_s: float = typer.Option(300.0, help="Deadline of any single wait (an engine batch, a notification, a control message; the senders' kernel compiles before the first request may take up to 600 s), seconds; a dead peer is reported as soon as the engine or the pipe notices."),
    requests: int = typer.Option(1, help="Timed requests per mode, one after another through the same "
                                         "connectors, each filled, shipped and verified (1-100); the table "
                                         "is the median one (the lower middle one for an even count), and "
                                         "the whole-request times of all are printed."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    corrupt_rank: Optional[int] = typer.Option(None, hidden=True, help="Test hook: this rank damages one "
                                                                       "received byte."),
    prefill_tp_size: int = typer.Option(1, help="Heterogeneous run: prefill TP ranks (GQA heads split)."),
    tp_size: int = typer.Option(1, help="Heterogeneous run: decode TP ranks."),
    prefill_layout: Optional[str] = typer.Option(None, help="Heterogeneous run: prefill cache layout "
                                                            "(sglang_mla, tpu_mla, nhd, hnd, tpu_gqa)."),
    decode_layout: Optional[str] = typer.Option(None, help="Heterogeneous run: decode cache layout."),
) -> None:
    """Ship one request's KV from prefill to decode-rank processes through a real engine; verify every byte.

    Prints one table per mode: descriptors, bytes, engine calls, seconds, GB/s, verified per rank.
    Then the packed/direct ratios. Exit status 1 if any byte is wrong, 2 for bad options.
    """
    from dcp_jax.job import DEVICES, check_device, check_host_memory, run_job
    from dcp_jax.job.gpus import check_gpus, parse_gpu_list
    from dcp_jax.job.mps import check_mps

    path = _one_list(path, "--path")  # repeatable only so that a second --path is refused
    if uses_hetero_job(model, prefill_tp_size=prefill_tp_size, tp_size=tp_size, prefill_layout=prefill_layout,
                       decode_layout=decode_layout):
        # TP / layout pairs: through the connector, one process per rank (dcp_jax.hetero.connector_job)
        from dcp_jax.cli_hetero import hetero_transfer

        # That job runs push, on host memory, whole requests: an option it would ignore is refused
        # (a run on --device gpu must not report host figures as if they were the GPU's).
        ignored = [name for name, given in (
            ("--device", device != "cpu"), ("--prefill-gpus", prefill_gpus is not None),
            ("--decode-gpus", decode_gpus is not None), ("--direction", direction != "push"),
            ("--staging", staging not in ("auto", "none")), ("--pack-backend", pack_backend != "auto"),
            ("--chunk-tokens", chunk_tokens is not None), ("--prefix-tokens", prefix_tokens != 0),
            ("--mode", mode != "both"), ("--max-batch-indices", max_batch_indices is not None),
            ("--pack-tokens", pack_tokens is not None), ("--round-rows", round_rows is not None),
            ("--region-notify", region_notify != "auto"), ("--mps", mps), ("--verify", verify),
            ("--corrupt-rank", corrupt_rank is not None), ("--requests", requests != 1)) if given]
        if ignored:
            _fail(f"{', '.join(ignored)}: not taken by a TP/layout run (--prefill-tp-size, --tp-size, "
                  "--prefill-layout, --decode-layout: push, host memory, whole requests, --path direct,region)")
        if engine == "jax-transfer" and path not in (None, "direct"):
            _fail(f"--path={path!r}: a TP/layout run through jax-transfer takes only the direct path")

        return hetero_transfer(model, prompt_tokens, dict(
            page_size=page_size if prefill_page_size is None else prefill_page_size, dcp_size=prefill_dcp_size,
            interleave_size=prefill_interleave_size, tp_size=prefill_tp_size, layout=prefill_layout), dict(
            page_size=page_size, dcp_size=dcp_size, interleave_size=interleave_size, tp_size=tp_size,
            layout=decode_layout), engine, seed, timeout_s, json_path, path)
    if mode not in _MODES:
        _fail(f"--mode={mode!r} must be one of {', '.join(_MODES)}")
    if device not in DEVICES:
        _fail(f"--device={device!r} must be one of {', '.join(DEVICES)}")
    try:
        placed = {name: None if text is None else parse_gpu_list(text, f"--{name.replace('_', '-')}")
                  for name, text in (("prefill_gpus", prefill_gpus), ("decode_gpus", decode_gpus))}
    except ValueError as exc:
        _fail(str(exc))
    cfg = _job_config(
        mode, path, model=model, prompt_tokens=prompt_tokens, page_size=page_size, dcp_size=dcp_size,
        prefill_dcp_size=prefill_dcp_size, interleave_size=interleave_size,
        prefill_interleave_size=prefill_interleave_size, chunk_tokens=chunk_tokens,
        prefix_tokens=prefix_tokens, engine=engine, max_batch_indices=max_batch_indices,
        pack_tokens=pack_tokens, round_rows=round_rows, region_notify=region_notify, verify=verify, seed=seed,
        timeout_s=timeout_s, corrupt_rank=corrupt_rank,
        requests=requests, device=device, staging=staging, pack_backend=pack_backend, direction=direction,
        prefill_page_size=prefill_page_size, mps=mps, **placed,
    )
    try:
        check_device(cfg.device)
        check_gpus(cfg)
        check_host_memory(cfg)
        check_mps(cfg)
    except ValueError as exc:
        _fail(str(exc))
    _check_out_path(json_path, "--json")
    console = Console()
    geo = cfg.geometry
    console.print(
        f"[bold]dcp-jax transfer[/]: {geo.name} ({geo.num_layers} layers, {geo.row_bytes:,} B/token), "
        f"{cfg.prompt_tokens:,} tokens (prefix {cfg.prefix_tokens:,}), page {cfg.page_size}"
        f"{f' (prefill {cfg.src_page_size})' if cfg.src_page_size != cfg.page_size else ''}, "
        f"prefill DCP{cfg.prefill_dcp_size} -> decode DCP{cfg.dcp_size}, I={cfg.interleave_size}, "
        f"{len(cfg.chunks())} chunk(s), engine {cfg.engine_kind}, device {cfg.device}; {_size_text(geo.request_bytes(cfg.send_tokens))} to move"
        + (f"; prefill on GPU {_gpus(cfg.prefill_gpus)}, decode on GPU {_gpus(cfg.decode_gpus)}"
           if cfg.prefill_gpus is not None or cfg.decode_gpus is not None else "")
    )
    if progress:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            tasks: dict[str, int] = {}

            def on_progress(md: str, done: int, total: int) -> None:
                if md not in tasks:
                    tasks[md] = bar.add_task(f"{md} (chunk, rank) batches", total=total)
                bar.update(tasks[md], completed=done, total=total)

            result = run_job(cfg, on_progress=on_progress)
    else:
        result = run_job(cfg)
    for run in result["runs"]:
        console.print(_run_table(run))
        if run.get("repeats"):
            console.print(_repeats_line(run))
        for f in run["failures"]:
            console.print(f"[red]failure:[/] {f}")
    console.print(f"[dim]{_COUNTS_NOTE}[/]")
    if result.get("mps"):
        console.print(f"CUDA MPS: {result['mps']['clients']} client connections to the job's daemon")
    if "comparison" in result:
        c = result["comparison"]
        ratio = c["total_seconds_ratio"]
        speed = (f"[bold]{ratio:.2f}x[/] faster" if ratio >= 1
                 else f"[bold]{1 / ratio:.2f}x[/] slower")
        console.print(f"packed vs direct: {_descriptor_phrase(c['descriptor_ratio'])}, {speed} end to end")
    elif {"direct", "packed"} <= {r["mode"] for r in result["runs"]}:
        console.print("packed vs direct: no comparison, a mode did not complete verified")
    if json_path is not None:
        result["legend"] = dict(batches=_BATCHES_NOTE, engine_calls=_ENGINE_CALLS_NOTE)
        json_path.write_text(json.dumps(result, indent=2, default=_json_default))
        console.print(f"wrote {json_path}")
    if not result["verified"]:
        console.print("[red bold]NOT VERIFIED[/]: some rank did not receive its bytes exactly")
        raise typer.Exit(1)
    console.print("[green bold]verified[/]: every rank byte-exact in every mode")


def _repeats_line(run: dict) -> str:
    """The whole-request times of a run's timed requests: median (the table's request), range,
    each one in order."""
    secs = [r["request_seconds"] for r in run["repeats"]]
    ms = ", ".join(f"{x * 1e3:.3f}" for x in secs)
    good = sorted(x for x in secs if math.isfinite(x))
    if not good:
        return f"{run['mode']}: {len(secs)} requests, no whole-request time"
    med = run["request_seconds"]
    gb = run["bytes"] / 1e9
    return (f"{run['mode']}: {len(secs)} requests, first byte to last SUCCESS median {med * 1e3:.3f} ms "
            f"({gb / med:.2f} GB/s), min {good[0] * 1e3:.3f}, max {good[-1] * 1e3:.3f}; each (ms): {ms}")


def _gpus(g) -> str:
    return ",".join(map(str, g or (0,)))


def _run_table(run: dict) -> Table:
    t = Table(title=f"mode {run['mode']} / engine {run['engine']}"
              + (f" / path {','.join(run['paths'])}" if run.get("paths") else ""), show_footer=True)
    tot_s = run["total_seconds"]
    cols = [
        ("rank", "all"),
        ("descriptors", f"{run['descriptors']:,}"),
        ("bytes", f"{run['bytes']:,}"),
        ("batches (engine calls)", f"{run['batches']:,} ({run['engine_calls']:,})"),
        ("strategy", ""),
        ("verified", "yes" if run["verified"] else "NO"),
    ]
    for name, footer in cols:
        t.add_column(name, footer=footer, justify="right")
    for r in run["ranks"]:
        ok = r.get("verified")
        t.add_row(str(r["dcp_rank"]), f"{r.get('descriptors', 0):,}", f"{r.get('bytes', 0):,}",
                  f"{r.get('batches', 0):,} ({r.get('engine_calls', 0):,})", r.get("strategy", ""),
                  "[green]yes[/]" if ok else f"[red]NO[/] {r.get('bad_rows', '?')} rows")
    timing = (f"plan {run['plan_seconds']:.3f} s | pack {run['pack_seconds']:.3f} s | "
              f"transfer {run['transfer_seconds']:.3f} s | total {tot_s:.3f} s | {run['gbps']:.2f} GB/s"
              if math.isfinite(tot_s) else "no timing")
    st = run.get("staging") or {}
    if "staged" in st.values():
        timing += (f" | prefill {st['prefill']} (stage {run.get('stage_seconds', 0.0):.3f} s), decode "
                   f"{st['decode']} (unstage {run.get('unstage_seconds', 0.0):.3f} s)")
    timing += f" | pack backend {run.get('pack_backend', 'auto')}"
    req_s = run.get("request_seconds", float("nan"))
    if math.isfinite(tot_s) and math.isfinite(req_s):
        timing += f" | first byte to last rank's SUCCESS {req_s:.3f} s"
    t.caption = timing
    return t


# What the two counts of a run mean (table caption and JSON "legend").
_BATCHES_NOTE = ("transfer_batch calls: one per (chunk, prefill rank, decode rank) window with rows, all "
                 "layer entries in one")
_ENGINE_CALLS_NOTE = ("submit calls into the engine library: NIXL one per batch; Mooncake one per "
                      "1024-descriptor window of a batch (plus one per notification)")
_COUNTS_NOTE = f"batches = {_BATCHES_NOTE}; engine calls = {_ENGINE_CALLS_NOTE}"

# In this order in ``--help``.
app.command(name="plan")(plan)
app.command(name="load")(load)
app.command(name="generate")(generate)
