"""The processes of ``dcp-jax generate``: prefill ranks (a `KVSender` each) and decode ranks
(a `KVReceiver` each, one JAX process of a ``jax.distributed`` group).

Protocol over each child's pipe, ``(kind, arg)``: prefill sends ``address``, then ``ready``
(prefill compiled); on ``go`` it prefills, writes its rows into its pages, ``send``s them and
answers ``done {t_start, t_sent, status}``; ``close`` closes the sender. A decode rank gets
``open {addresses}``, answers ``ready`` (receiver connected, request expected, step compiled,
collectives warmed up), waits for the KV, hands the pages to the decode loop, generates, and
answers ``result``. Errors come back as ``error traceback``. Times are ``time.monotonic()``
(one clock for every process of the machine).

This module imports no JAX at import time: each child first sets its own XLA flags (one CPU
device per process) before JAX starts.
"""
from __future__ import annotations

import os
import re
import time

from dcp_jax.child_process import exit_with_parent, report_error  # imports no JAX

__all__ = ["prefill_main", "decode_main", "RID"]

RID = "generate-0"
WAIT_S = 1.0  # each side waits on its connector (`wait`: woken the moment the request ends)
# Compiling the decode step on 2 busy cores can starve a connector's heartbeat thread for
# seconds; the connector's default (5 s) then drops a live peer.
PEER_TIMEOUT_S = 120.0


def _child_env(device: str, gpu: int = 0) -> None:
    # One device per process: drop a forced host device count inherited from a test process.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = flags.strip()
    if device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:  # this process's GPU only (NCCL wants one GPU per rank)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    from dcp_jax.job.config import engine_env

    engine_env(device)


def _prefill_pages(cfg, rank: int):
    """This prefill rank's page table for its local rows of the shipped tokens (seeded shuffle)."""
    import numpy as np

    from dcp_jax import layout

    rows = int(layout.local_len_np(cfg.kv_tokens, cfg.prefill_dcp_size, rank, cfg.prefill_interleave_size))
    n = max(1, -(-rows // cfg.prefill_page))
    return np.random.default_rng(1000 + rank).permutation(n + 1)[:n].astype(np.int64), n + 1


def prefill_main(conn, cfg, rank: int, prompt) -> None:
    exit_with_parent()
    try:
        _child_env(cfg.device, 0)
        import jax
        import jax.numpy as jnp
        import numpy as np

        from dcp_jax import layout
        from dcp_jax.model import PREFILL_CHUNK, init_params, prefill
        from dcp_jax.transfer import KVCacheSpec, KVSender, TransferStatus

        mcfg = cfg.model_config()
        params = init_params(mcfg)
        table, num_pages = _prefill_pages(cfg, rank)
        # The sender's pages: host numpy on CPU, CuPy device memory on a GPU (written in place;
        # a JAX array would be replaced, not updated, by the prefill: docs/connector.md).
        xp = np
        if cfg.device == "gpu":
            import cupy as xp
        cache = [xp.zeros((num_pages, cfg.prefill_page) + s, np.dtype(mcfg.jdtype)) for s in mcfg.entry_shapes]
        spec = KVCacheSpec(len(cache), mcfg.item_lens, cfg.prefill_page, cfg.prefill_dcp_size, rank,
                           cfg.prefill_interleave_size, dtype=np.dtype(mcfg.jdtype).name)
        sender = KVSender(spec, cache, engine=cfg.engine, timeout_s=cfg.timeout_s, peer_timeout_s=PEER_TIMEOUT_S)
        conn.send(("address", sender.address))
        pad = -(-len(prompt) // PREFILL_CHUNK) * PREFILL_CHUNK
        tokens = np.pad(np.asarray(prompt[: cfg.kv_tokens], np.int32), (0, pad - cfg.kv_tokens))
        compiled = prefill.lower(mcfg, params, jax.ShapeDtypeStruct((pad,), jnp.int32)).compile()
        t = np.arange(cfg.kv_tokens)
        mine = t[layout.owner_np(t, cfg.prefill_dcp_size, cfg.prefill_interleave_size) == rank]
        j = layout.local_index_np(mine, cfg.prefill_dcp_size, cfg.prefill_interleave_size)
        dst_pages, dst_slots, mine = (xp.asarray(a) for a in (table[j // cfg.prefill_page], j % cfg.prefill_page, mine))
        conn.send(("ready", None))
        kind, _ = conn.recv()
        if kind != "go":
            raise RuntimeError(f"prefill {rank}: expected 'go', got {kind!r}")
        t_start = time.monotonic()
        entries = compiled(params, jnp.asarray(tokens))
        for e, rows in enumerate(entries):  # the model's rows into this rank's pages
            cache[e][dst_pages, dst_slots] = (np.asarray(rows) if xp is np else xp.from_dlpack(rows))[mine]
        if xp is not np:
            xp.cuda.runtime.deviceSynchronize()
        t_sent = time.monotonic()
        if sender.poll(RID).terminal:  # (a decode rank gave up before the KV was ready)
            raise RuntimeError(f"request {sender.poll(RID).name} before send: {sender.failure_reason(RID)}")
        sender.send(RID, table, 0, cfg.kv_tokens)
        while not (status := sender.wait(RID, WAIT_S)).terminal:  # woken when it ends: no polling
            pass
        conn.send(("done", dict(t_start=t_start, t_sent=t_sent, t_done=time.monotonic(), status=status.name,
                                reason=sender.failure_reason(RID) if status is not TransferStatus.SUCCESS else "",
                                stats=_plain(sender.request_stats(RID)))))
        conn.recv()  # close
        sender.close()
        conn.send(("closed", None))
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        report_error(conn)  # Child names the process
        raise SystemExit(1)


def _plain(d):
    """Stats as plain Python values (what the pipe carries)."""
    import numpy as np

    if isinstance(d, dict):
        return {str(k): _plain(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_plain(v) for v in d]
    if isinstance(d, np.generic):
        return d.item()
    return d if isinstance(d, (int, float, str, bool, type(None))) else str(d)


def decode_main(conn, cfg, rank: int, coordinator: str, prompt) -> None:
    exit_with_parent()
    try:
        _child_env(cfg.device, rank)
        import gc

        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        n = cfg.dcp_size
        if n > 1:
            jax.distributed.initialize(coordinator, num_processes=n, process_id=rank,
                                       initialization_timeout=int(cfg.timeout_s))
        from dcp_jax.merge import make_dcp_mesh
        from dcp_jax.model import DecodeGeometry, global_caches, init_params, make_decode_step, replicated
        from dcp_jax.model.paging import request_pages
        from dcp_jax.transfer import KVCacheSpec, KVReceiver, TransferStatus

        mcfg = cfg.model_config()
        mesh = make_dcp_mesh(n)
        dev = jax.local_devices()[0]
        if mesh.devices.flat[rank] != dev:
            raise RuntimeError(f"decode rank {rank}: mesh position {rank} is {mesh.devices.flat[rank]}, not {dev}")
        pages = request_pages(cfg.total_tokens, dcp_size=n, page_size=cfg.page_size,
                              interleave_size=cfg.interleave_size, seed=cfg.seed)
        geo = DecodeGeometry(cfg.page_size, pages.num_pages, pages.max_pages, cfg.interleave_size, cfg.merge)
        shapes = [(pages.num_pages, cfg.page_size) + s for s in mcfg.entry_shapes]
        # Free rows hold NaN: the decode attention must never read a row this rank does not own.
        local = [jax.device_put(jnp.full(s, jnp.nan, mcfg.jdtype), dev) for s in shapes]
        spec = KVCacheSpec(len(local), mcfg.item_lens, cfg.page_size, n, rank, cfg.interleave_size,
                           dtype=np.dtype(mcfg.jdtype).name)
        recv = KVReceiver(spec, local, engine=cfg.engine, timeout_s=cfg.timeout_s, peer_timeout_s=PEER_TIMEOUT_S)
        kind, arg = conn.recv()
        for address in arg["addresses"]:
            recv.connect(address)
        recv.expect(RID, pages.rank_table(rank, cfg.kv_tokens), cfg.kv_tokens)
        params = jax.tree.map(lambda a: replicated(mesh, a), init_params(mcfg))
        page_table = jax.make_array_from_callback(pages.tables.shape, NamedSharding(mesh, P("dcp")),
                                                  lambda idx: pages.tables[idx])
        token = replicated(mesh, np.int32(prompt[cfg.kv_tokens]))
        pos = replicated(mesh, np.int32(cfg.kv_tokens))
        step = make_decode_step(mcfg, mesh, geo)
        t0 = time.monotonic()
        # Warm-up on scratch caches: compiles the step and opens the collectives' connections.
        scratch = global_caches(mesh, [[jax.device_put(jnp.zeros(s, mcfg.jdtype), dev) for s in shapes]])
        out = step(params, scratch, page_table, token, pos)
        jax.block_until_ready(out)
        del out, scratch
        compile_s = time.monotonic() - t0
        conn.send(("ready", dict(compile_s=compile_s)))
        while not (status := recv.wait(RID, WAIT_S)).terminal:
            pass
        t_success = time.monotonic()
        reason = recv.failure_reason(RID) if status is not TransferStatus.SUCCESS else ""
        recv.release(RID)
        # The connector's views of the layers block XLA's donation (a buffer with an external
        # reference is copied, not updated in place): the receiver hands the pages over here.
        recv.close()
        del recv
        gc.collect()
        t_closed = time.monotonic()
        if status is not TransferStatus.SUCCESS:
            conn.send(("result", dict(rank=rank, status=status.name, reason=reason)))
            return
        if cfg.corrupt_rank == rank:  # test hook: one received row of layer entry 0 changes
            p0 = int(pages.tables[rank, 0])
            local[0] = local[0].at[p0, 0].add(jnp.asarray(1.0, mcfg.jdtype))
        ptrs = [a.unsafe_buffer_pointer() for a in local]
        caches = global_caches(mesh, [local])
        del local
        marks = []
        tokens, logits, caches = _decode(step, params, caches, page_table, token, pos, cfg.new_tokens, marks)
        in_place = [c.addressable_data(0).unsafe_buffer_pointer() for c in caches] == ptrs
        conn.send(("result", dict(rank=rank, status="SUCCESS", reason="", t_success=t_success, t_closed=t_closed,
                                  step_done=marks, tokens=tokens, compile_s=compile_s, kv_in_place=in_place,
                                  logits=logits if rank == 0 else None)))
    except BaseException:  # noqa: BLE001
        report_error(conn)  # Child names the process
        raise SystemExit(1)


def _decode(step, params, caches, page_table, token, pos, steps, marks):
    from dcp_jax.model import greedy_decode

    return greedy_decode(step, params, caches, page_table, token, pos, steps,
                         on_step=lambda k: marks.append(time.monotonic()))
