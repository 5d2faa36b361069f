"""``dcp-jax load``: the options of the connector's load generator (`dcp_jax.loadgen`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dcp_jax.geometry import geometry_names

__all__ = ["load"]


def load(
    engine: str = typer.Option("nixl", help="Transfer engine of every side: nixl or mooncake."),
    requests: int = typer.Option(1000, help="Requests in the run (warm-up included)."),
    concurrency: int = typer.Option(64, help="At most this many requests in flight."),
    abort_fraction: float = typer.Option(0.05, help="Fraction of requests aborted on purpose (sender or a "
                                                    "decode rank, before the last chunk is sent), in [0, 1]."),
    direction: str = typer.Option("push", help="push (the sender WRITEs) or pull (decode ranks READ)."),
    dcp_size: int = typer.Option(2, help="Decode ranks (one receiver process each)."),
    model: str = typer.Option("tiny", help=f"KV geometry: {', '.join(geometry_names())}."),
    max_tokens: int = typer.Option(512, help="Longest request; lengths are uniform in [1, max]."),
    page_size: int = typer.Option(16, help="Tokens per KV page (both sides)."),
    interleave_size: int = typer.Option(1, help="Decode-side interleave I (tokens)."),
    mode: str = typer.Option("auto", help="Sender mode: auto, packed, direct or region (each receiver gets a "
                                          "receive region of one longest request's share)."),
    seed: int = typer.Option(0, help="Seeds request lengths, chunking, aborts, page tables and KV bytes."),
    timeout_s: float = typer.Option(30.0, help="Connector no-progress timeout per request (seconds)."),
    warmup: int = typer.Option(16, help="Requests run before the measured phase (compiles and RSS are "
                                        "read after them)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON to this path."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar (on a terminal)."),
    netns: bool = typer.Option(False, "--netns", help="Sender and receivers on two hosts: network namespaces "
                                                      "joined by a veth link (needs root)."),
    duration_s: float = typer.Option(0.0, help="Stop issuing after this many seconds of the measured phase "
                                               "(0: run all --requests)."),
    faults: str = typer.Option("", help="With --netns: faults injected at random, comma-separated: "
                                        "link_flap (the link down, then up), pause (a receiver stopped, "
                                        "then resumed), sender_pause (the sender stopped for longer than "
                                        "the peer timeout: the receivers drop it and connect again)."),
    fault_every_s: float = typer.Option(10.0, help="Mean seconds between injected faults."),
    peer_timeout_s: float = typer.Option(5.0, help="Connector peer timeout (seconds); link_flap and pause "
                                                   "last less, sender_pause 1.2-1.6 x it."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write RSS and registered bytes over time (PNG; "
                                                             "with --netns or --duration-s)."),
) -> None:
    """Load generator for the KV connector: one KVSender and --dcp-size KVReceiver processes move
    random requests, every byte and every free page's sentinel checked; exit 1 if anything failed."""
    from dcp_jax.loadgen import LoadConfig, load_command
    from dcp_jax.loadgen.command import check_outputs

    try:
        cfg = LoadConfig(engine=engine, requests=requests, concurrency=concurrency, abort_fraction=abort_fraction,
                         direction=direction, dcp_size=dcp_size, model=model, max_tokens=max_tokens,
                         page_size=page_size, interleave_size=interleave_size, mode=mode, seed=seed,
                         timeout_s=timeout_s, warmup=warmup, netns=netns, duration_s=duration_s, faults=faults,
                         fault_every_s=fault_every_s, peer_timeout_s=peer_timeout_s)
        check_outputs(cfg, json_path, plot)
        if netns:
            from dcp_jax.netns import needs_root_reason

            if needs_root_reason():
                raise ValueError(f"--netns: {needs_root_reason()}")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    raise typer.Exit(load_command(cfg, json_path, progress=progress, plot_path=plot))
