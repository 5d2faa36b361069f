"""``dcp-jax transfer`` for heterogeneous pairs (TP or layout differing) through the connector,
one process per rank.

Every prefill (DCP, TP) rank is a process holding a `dcp_jax.transfer.KVSender` over its own
caches in its layout; every decode (DCP, TP) rank a process holding a `KVReceiver` over
sentinel-filled caches in its layout, connected to every prefill rank (the pairs move head
pieces, `dcp_jax.transfer.views`). One request of ``prompt_tokens`` tokens moves, pushed direct.

Oracle, independent of the plan and of the connector's row maths: element ``e`` of head ``h``
(global), plane ``k`` (K, V; MLA: the latent), layer ``l`` of token ``t`` holds `pattern`
``(t, l, k, h, e)``. Each prefill rank writes it for the tokens it owns at its page-table rows
through its own layout (`dcp_jax.hetero.layouts.place_from_wire`; its other bytes random), and
each decode rank builds the cache it must end with the same way from the sentinel (its tokens,
its heads) and compares the whole cache byte for byte: the heads, the layout conversion, the
sentinel bytes around them, tpu_mla's padding lanes.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time

import numpy as np

from dcp_jax.hetero.cost import hetero_sides, rank_pages, rank_tables
from dcp_jax.hetero.layouts import cache_shape, place_from_wire
from dcp_jax.hetero.plan import HeteroSide
from dcp_jax.child_process import Child, exit_with_parent, report_error
from dcp_jax.layout import owner_np, local_index_np
from dcp_jax.transfer._worker import check_seconds

__all__ = ["run_connector_job", "check_job_size", "spec_of", "pattern", "fill_side", "expected_cache", "SENTINEL"]

SENTINEL = 0xA5
RID = "hetero-0"
_GROUP = "hetero-decode"


def spec_of(side: HeteroSide, dcp_rank: int, tp_rank: int, num_layers: int):
    """The `KVCacheSpec` of one rank of ``side`` (item_lens: its layout's bytes per token)."""
    from dcp_jax.transfer import KVCacheSpec

    g = side.geometry(tp_rank, 1)
    item = int(np.prod(cache_shape(g))) * g.itemsize // g.page_size
    return KVCacheSpec(num_layers, (item,) * num_layers, side.page_size, side.dcp_size, dcp_rank, side.interleave_size,
                       side.dtype, side.layout, side.tp_size, tp_rank, side.num_kv_heads, side.head_dim)


def _etype(side: HeteroSide):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[side.geometry(0, 1).itemsize]


def pattern(tokens: np.ndarray, layer: int, planes: int, heads: np.ndarray, head_dim: int, etype) -> np.ndarray:
    """Wire-order elements ``[planes, n, len(heads), head_dim]`` of the oracle's pattern, as bytes."""
    t = np.asarray(tokens, np.int64)[None, :, None, None]
    k = np.arange(planes, dtype=np.int64)[:, None, None, None]
    h = np.asarray(heads, np.int64)[None, None, :, None]
    e = np.arange(head_dim, dtype=np.int64)[None, None, None, :]
    v = (t * 2654435761 + layer * 40503 + k * 9973 + h * 131 + e) % (251 if etype is np.uint8 else 65521)
    return np.ascontiguousarray(v.astype(etype)).view(np.uint8).reshape(-1)


def _rank_tokens(side: HeteroSide, dcp_rank: int, tokens: int, table):
    t = np.arange(tokens, dtype=np.int64)
    t = t[owner_np(t, side.dcp_size, side.interleave_size) == dcp_rank]
    j = local_index_np(t, side.dcp_size, side.interleave_size)
    table = np.asarray(table, np.int64)
    return t, table[j // side.page_size], j % side.page_size


def _place(side: HeteroSide, tp_rank: int, caches, dcp_rank: int, tokens: int, table) -> None:
    t, pages, slots = _rank_tokens(side, dcp_rank, tokens, table)
    g = side.geometry(tp_rank, caches[0].shape[1 if side.layout in ("nhd", "hnd") else 0])
    h0, nh = side.heads(tp_rank)
    for layer, cache in enumerate(caches):
        place_from_wire(g, cache, pattern(t, layer, g.planes, np.arange(h0, h0 + nh), g.head_dim, _etype(side)),
                        pages, slots)


def _new_caches(side: HeteroSide, tp_rank: int, num_pages: int, num_layers: int, fill):
    shape = cache_shape(side.geometry(tp_rank, num_pages))
    return [fill(shape) for _ in range(num_layers)]


def fill_side(side: HeteroSide, dcp_rank: int, tp_rank: int, num_pages: int, num_layers: int, tokens: int, table,
              seed: int = 0) -> list[np.ndarray]:
    """A prefill rank's caches: random bytes, then the pattern at its tokens' rows and heads."""
    rng = np.random.default_rng(seed)
    et = _etype(side)
    caches = _new_caches(side, tp_rank, num_pages, num_layers,
                         lambda s: rng.integers(0, np.iinfo(et).max, s, dtype=np.int64).astype(et))
    _place(side, tp_rank, caches, dcp_rank, tokens, table)
    return caches


def expected_cache(side: HeteroSide, dcp_rank: int, tp_rank: int, num_pages: int, num_layers: int, tokens: int,
                   table) -> list[np.ndarray]:
    """What a decode rank must hold after the transfer: the sentinel, and the pattern at its
    tokens' rows for the heads it holds. ``fill_side``'s twin, with sentinel instead of noise."""
    et = _etype(side)
    caches = _new_caches(side, tp_rank, num_pages, num_layers, lambda s: _sentinel(s, et))
    _place(side, tp_rank, caches, dcp_rank, tokens, table)
    return caches


def _sentinel(shape, etype) -> np.ndarray:
    return np.full(int(np.prod(shape)) * np.dtype(etype).itemsize, SENTINEL, np.uint8).view(etype).reshape(shape)


def _prefill_main(conn, a: dict) -> None:
    from dcp_jax.job.config import engine_env
    exit_with_parent()
    engine_env("cpu")
    try:
        from dcp_jax.transfer import KVSender
        side = HeteroSide(**a["side"])
        caches = fill_side(side, a["dcp_rank"], a["tp_rank"], a["num_pages"], a["layers"], a["tokens"], a["table"],
                           a["seed"])
        with KVSender(spec_of(side, a["dcp_rank"], a["tp_rank"], a["layers"]), caches, engine=a["engine"],
                      mode=a["mode"], timeout_s=a["timeout_s"]) as sender:
            conn.send(("address", sender.address))
            conn.recv()  # "send"
            sender.send(RID, a["table"], 0, a["tokens"])
            deadline = time.monotonic() + a["timeout_s"]
            while not sender.poll(RID).terminal and time.monotonic() < deadline:
                time.sleep(0.001)
            st = sender.request_stats(RID)
            conn.send(("sent", dict(status=st["status"], reason=st["reason"], pack_seconds=st["pack_seconds"],
                                    ranks={int(k): dict(descriptors=v["descriptors"], bytes=v["bytes"], path=v["path"])
                                           for k, v in st["ranks"].items()})))
            conn.recv()  # "close": every decode rank is done with this sender's writes
    except Exception:  # noqa: BLE001 - the parent reports it
        report_error(conn)


def _decode_main(conn, a: dict) -> None:
    from dcp_jax.job.config import engine_env
    exit_with_parent()
    engine_env("cpu")
    try:
        from dcp_jax.transfer import KVReceiver
        side = HeteroSide(**a["side"])
        want = expected_cache(side, a["dcp_rank"], a["tp_rank"], a["num_pages"], a["layers"], a["tokens"], a["table"])
        caches = _new_caches(side, a["tp_rank"], a["num_pages"], a["layers"], lambda s: _sentinel(s, _etype(side)))
        with KVReceiver(spec_of(side, a["dcp_rank"], a["tp_rank"], a["layers"]), caches, engine=a["engine"],
                        group=_GROUP, timeout_s=a["timeout_s"], region_bytes=a["region_bytes"]) as recv:
            _, addresses = conn.recv()  # ("open", [prefill addresses])
            for address in addresses:
                recv.connect(address, timeout_s=a["timeout_s"])
            recv.expect(RID, a["table"], a["tokens"])
            conn.send(("ready", None))
            deadline = time.monotonic() + a["timeout_s"]
            while not recv.poll(RID).terminal and time.monotonic() < deadline:
                time.sleep(0.001)
            done_at = time.monotonic()
            status, reason = recv.poll(RID).value, recv.failure_reason(RID)
            bad = sum(int((x.view(np.uint8) != y.view(np.uint8)).sum()) for x, y in zip(caches, want))
            unpack_seconds = recv.request_stats(RID).get("unpack_seconds", 0.0)
            conn.send(("done", dict(status=status, reason=reason, done_at=done_at, bad_bytes=bad,
                                    unpack_seconds=unpack_seconds,
                                    bytes=sum(x.nbytes for x in caches))))
            conn.recv()  # "close"
    except Exception:  # noqa: BLE001 - the parent reports it
        report_error(conn)


def check_job_size(prefill: HeteroSide, decode: HeteroSide, layers: int, tokens: int) -> None:
    """Refuses a job this machine cannot hold before any process starts: more than `MAX_RANKS`
    (DCP x TP) processes on a side, or caches past the physical memory (each prefill rank's
    caches once; each decode rank's twice: its caches and the oracle it compares with).

    Raises:
        ValueError: naming the sizes (``--dcp-size`` & co.) and the GiB needed.
    """
    from dcp_jax.job.config import MAX_RANKS
    from dcp_jax.job.kv import physical_memory_bytes

    for side, prefix in ((prefill, "--prefill-"), (decode, "--")):
        if side.dcp_size * side.tp_size > MAX_RANKS:
            raise ValueError(f"{prefix}dcp-size={side.dcp_size} x {prefix}tp-size={side.tp_size} = "
                             f"{side.dcp_size * side.tp_size} processes; at most {MAX_RANKS} a side "
                             "(one process per (DCP, TP) rank)")
    need = 0
    for side, copies in ((prefill, 1), (decode, 2)):
        for _, pages in rank_pages(side, tokens):
            for t in range(side.tp_size):
                g = side.geometry(t, pages)
                need += copies * layers * int(np.prod(cache_shape(g))) * g.itemsize
    have = physical_memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"this job's caches need about {need / 2**30:,.1f} GiB of host memory ({tokens:,} "
                         f"tokens, --page-size {decode.page_size}, prefill page {prefill.page_size}); this "
                         f"machine has {have / 2**30:.1f} GiB")


def run_connector_job(model: str, prompt_tokens: int, prefill: dict, decode: dict, *, engine: str = "nixl",
                      mode: str = "direct", region_bytes: int = 64 << 20, seed: int = 0,
                      timeout_s: float = 120.0) -> dict:
    """Moves one request between a heterogeneous pair through the connector, one process per
    rank, and verifies every decode rank's whole cache against the oracle (module docstring).

    Args:
        model: a key of `dcp_jax.hetero.cost.HETERO_MODELS`.
        prompt_tokens: tokens moved (>= 1).
        prefill, decode: sides as `dcp_jax.hetero.cost.hetero_sides` takes them.
        engine: "nixl" or "mooncake".
        mode: the senders' mode, ``"direct"`` (cache-to-cache descriptors through both layouts) or
            ``"region"`` (each pair's wire block into the decode rank's receive region, placed there
            through its layout; `dcp_jax.transfer.views`).
        region_bytes: each decode rank's receive region (bytes; the region mode's window bound).
        seed: page tables and prefill noise.
        timeout_s: bound on each step (seconds).

    Returns:
        ``{"model", "engine", "mode", "prefill", "decode", "processes", "descriptors", "bytes", "seconds",
        "gbps", "ranks": [{"dcp_rank", "tp_rank", "descriptors", "bytes", "verified"}], "verified"}``;
        ``seconds`` from the first ``send`` to the last decode rank's completion (the host's
        monotonic clock, shared by the processes).

    Raises:
        ValueError: an unknown model, a side the plan refuses, ``prompt_tokens`` < 1,
            ``timeout_s`` outside (0, 86400] (named), or a job past `check_job_size`.
        RuntimeError, TimeoutError: a rank process failed (its traceback included) or hung.
    """
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens!r} must be an int >= 1")
    if engine not in ("nixl", "mooncake"):
        raise ValueError(f"engine={engine!r} must be 'nixl' or 'mooncake' (the connector's pushes)")
    if mode not in ("direct", "region"):
        raise ValueError(f"mode={mode!r} must be 'direct' or 'region'")
    timeout_s = check_seconds("timeout_s", timeout_s)
    p, d, layers = hetero_sides(model, prefill, decode)
    check_job_size(p, d, layers, prompt_tokens)
    from dcp_jax.job.config import engine_env
    engine_env("cpu")  # before the fork server starts: its children inherit the quiet loopback settings
    rng = np.random.default_rng(seed)
    ptables, ppages = rank_tables(p, prompt_tokens, rng)  # the tables `hetero_counts` counts with
    dtables, dpages = rank_tables(d, prompt_tokens, rng)
    ctx = mp.get_context("forkserver") if "forkserver" in mp.get_all_start_methods() else mp.get_context("spawn")
    if ctx.get_start_method() == "forkserver":  # the connector (and JAX) imported once, not per rank
        ctx.set_forkserver_preload(["dcp_jax.transfer", "dcp_jax.hetero.connector_job", "bridge.nixl"])
    common = dict(layers=layers, tokens=prompt_tokens, engine=engine, timeout_s=timeout_s, mode=mode,
                  region_bytes=region_bytes if mode == "region" else 0)

    def start(target, side, r, t, tables, pages) -> Child:
        args = dict(common, side=dataclasses.asdict(side), dcp_rank=r, tp_rank=t,
                    table=tables[r], num_pages=pages[r], seed=seed * 7919 + r * 131 + t)
        return Child(ctx, f"{'prefill' if target is _prefill_main else 'decode'} rank {(r, t)}", target, args)

    procs: list[Child] = []
    try:
        pre = [start(_prefill_main, p, r, t, ptables, ppages) for r in range(p.dcp_size) for t in range(p.tp_size)]
        procs += pre
        dec = [start(_decode_main, d, r, t, dtables, dpages) for r in range(d.dcp_size) for t in range(d.tp_size)]
        procs += dec
        addresses = [x.recv("address", timeout_s) for x in pre]
        for x in dec:
            x.send("open", addresses)
        for x in dec:
            x.recv("ready", timeout_s)
        t0 = time.monotonic()
        for x in pre:
            x.send("send")
        sent = [x.recv("sent", timeout_s) for x in pre]
        done = [x.recv("done", timeout_s) for x in dec]
        for x in procs:
            x.send("close")
        for x in procs:
            x.proc.join(timeout_s)
    finally:
        for x in procs:
            x.stop(0)  # after an error: kills whoever is left at once
    ranks = []
    for (r, t), res in zip(((r, t) for r in range(d.dcp_size) for t in range(d.tp_size)), done):
        key = t * d.dcp_size + r  # KVCacheSpec.group_rank: the key each sender files this rank under
        ranks.append(dict(dcp_rank=r, tp_rank=t, descriptors=sum(s["ranks"].get(key, {}).get("descriptors", 0) for s in sent),
                          bytes=sum(s["ranks"].get(key, {}).get("bytes", 0) for s in sent), status=res["status"],
                          paths=sorted({s["ranks"][key]["path"] for s in sent if s["ranks"].get(key, {}).get("bytes")}),
                          unpack_seconds=res["unpack_seconds"],
                          reason=res["reason"], bad_bytes=res["bad_bytes"],
                          verified=res["status"] == "success" and res["bad_bytes"] == 0))
    seconds = max(res["done_at"] for res in done) - t0
    nbytes = sum(r["bytes"] for r in ranks)
    side = lambda s: dict(page_size=s.page_size, dcp_size=s.dcp_size, interleave_size=s.interleave_size,  # noqa: E731
                          tp_size=s.tp_size, layout=s.layout)
    return dict(model=model, engine=engine, mode=mode, prefill=side(p), decode=side(d), processes=len(procs),
                sender_status=sorted({s["status"] for s in sent}), descriptors=sum(r["descriptors"] for r in ranks),
                pack_seconds=sum(s["pack_seconds"] for s in sent), unpack_seconds=sum(r["unpack_seconds"] for r in ranks),
                bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0, ranks=ranks,
                verified=all(r["verified"] for r in ranks) and all(s["status"] == "success" for s in sent))
