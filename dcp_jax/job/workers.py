"""The job's rank processes from the inside: `prefill_main` (its shard in a `KVSender`) and
`decode_main` (its pool in a `KVReceiver`, every byte verified).

Each sets up, says ``hello``, then serves the control-pipe commands of the protocol in
:mod:`dcp_jax.job.processes` (which spawns them and holds the orchestrator's end) until
``shutdown``; a command that raises goes back as its traceback.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from dcp_jax.job import gpus, kv, verify
from dcp_jax.job.config import JobConfig, engine_env
from dcp_jax.kv_data import SENTINEL_BYTE, fill_rows, page_rows

__all__ = ["prefill_main", "decode_main", "PEER_TIMEOUT_S"]

PEER_TIMEOUT_S = 30.0  # a silent peer is dropped after this (the orchestrator reports deaths sooner)
# While a request is live each child waits on its connector (`wait`: woken when the request ends,
# so its end is seen at once) and looks at its pipe for an abort between waits. Looking costs
# ~0.1 ms of Python (multiprocessing's poll) taken from the connector's worker thread on the GIL:
# every 1 ms it stretched the fused round's launch on the H200 host (2026-12-03), hence not more often.
POLL_S = 0.01          # prefill: the pipe between waits
DECODE_POLL_S = 0.005  # decode: the pipe (and the progress / test hooks) between waits
PROGRESS_S = 0.25      # how often a decode rank reports the bytes landed so far


def _child_start(cfg_dict: dict, gpu_env: dict | None = None) -> JobConfig:
    # Ctrl-C reaches the whole process group; the parent stops its children itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gpus.enter_gpu(gpu_env or {})  # before anything touches CUDA: this process's GPU is its device 0
    cfg = JobConfig(**cfg_dict)
    engine_env(cfg.device)
    return cfg


class _Inbox:
    """A child's end of its control pipe: commands in order, and a non-blocking look for an abort
    while a request is live (a command that comes then is kept for later and ends the request)."""

    def __init__(self, conn: Connection):
        self.conn, self._later = conn, []

    def get(self) -> tuple[str, Any]:
        return self._later.pop(0) if self._later else self.conn.recv()

    def abort_reason(self) -> str | None:
        """Why the orchestrator wants the live request ended, or None (never blocks)."""
        reason = None
        try:
            while self.conn.poll(0):
                kind, arg = self.conn.recv()
                if kind != "abort":
                    self._later.append((kind, arg))  # release / close / shutdown: served after the request
                reason = reason or (str(arg) if kind == "abort" else f"the job sent {kind!r}")
        except (EOFError, OSError):  # the orchestrator died (killed): end the request, then the loop
            self._later.append(("shutdown", None))
            return "the job's main process is gone"
        return reason


def _serve(inbox: _Inbox, handlers: dict, state: dict, key: str) -> None:
    """The command loop of a child: ``handlers[kind](arg)`` until shutdown; errors go back as text.

    ``state[key]`` is the connector object of the mode open now (a `KVSender` or a `KVReceiver`,
    None between modes): ``release rid`` and ``close`` are served here for both sides, and it is
    closed when the loop ends."""

    def release(rid: str) -> None:
        try:
            state[key].release(rid)
        except KeyError:
            pass

    def drop() -> None:
        if state[key] is not None:
            state[key].close()
            state[key] = None

    def close(_) -> None:
        drop()
        inbox.conn.send(("closed", None))

    handlers = dict(handlers, release=release, close=close)
    try:
        while True:
            try:
                kind, arg = inbox.get()
            except (EOFError, OSError):
                break
            if kind == "shutdown":
                break
            fn = handlers.get(kind)
            if fn is None:
                continue  # e.g. an abort that came after the request ended
            try:
                fn(arg)
            except Exception:  # noqa: BLE001 - the orchestrator reports it
                try:
                    inbox.conn.send(("error", traceback.format_exc()))
                except (OSError, EOFError):  # the orchestrator is gone (killed): nobody to tell
                    break
    finally:
        drop()


# ------------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------------
def prefill_main(cfg_dict: dict, rank: int, conn: Connection, gpu_env: dict | None = None) -> None:
    """Prefill rank process: its shard of the request in its own paged KV; one `KVSender` per mode.
    ``gpu_env``: its placement (:func:`dcp_jax.job.gpus.child_env`)."""
    try:
        cfg = _child_start(cfg_dict, gpu_env)
        t0 = time.perf_counter()
        geo, p = cfg.geometry, cfg.src_page_size  # the prefill side's own page size
        tokens, local, table, pool = kv.prefill_page_table(cfg, rank)
        host = kv.alloc_buffer(kv.kv_bytes(pool, p, geo.kv_item_lens), "cpu")[0]
        rows = page_rows(table, local, p)
        for li, view in enumerate(kv.layer_views(host, pool, p, geo.kv_item_lens)):
            fill_rows(view.reshape(pool * p, -1), rows, tokens, li, cfg.seed)  # only the request's rows
        fill_s = time.perf_counter() - t0
        buf, owner = kv.alloc_buffer(host.nbytes, cfg.device, like=host)
        del host
        layers = kv.layer_views(buf, pool, p, geo.kv_item_lens)
        t1 = time.perf_counter()
        from dcp_jax.transfer import KVCacheSpec, KVSender, TransferStatus

        import_s = time.perf_counter() - t1
        spec = KVCacheSpec(geo.num_layers, tuple(geo.kv_item_lens), p, cfg.prefill_dcp_size, rank,
                           cfg.prefill_interleave_size)
        conn.send(("hello", dict(fill_kv=fill_s, imports=import_s, total=time.perf_counter() - t0,
                                 device=gpus.device_info(cfg.device))))
    except BaseException:  # noqa: BLE001 - report, then exit non-zero
        _quiet_send(conn, ("error", traceback.format_exc()))
        raise SystemExit(1)
    state: dict[str, Any] = dict(sender=None, checks={})
    inbox = _Inbox(conn)

    def open_(arg: dict) -> None:
        n = arg["dcp_size"]
        if cfg.verify and n not in state["checks"]:
            state["checks"][n] = verify.send_checksums(cfg, rank, n, table, layers)
        # Direct and fused sends never pack: a token's worth of pack buffer is all they need.
        pack = geo.row_bytes if arg["mode"] in ("direct", "fused") else kv.pack_bytes(cfg, rank)
        # Staging and the pack backend are the connector's (dcp_jax.transfer.staging): the job
        # passes its flags as the sender's options and reports what the sender did.
        state["sender"] = KVSender(spec, layers, engine=cfg.engine_kind, mode=arg["mode"], pack_bytes=pack,
                                   max_batch_indices=cfg.max_batch_indices, timeout_s=cfg.timeout_s,
                                   peer_timeout_s=min(cfg.timeout_s, PEER_TIMEOUT_S), staging=cfg.staging,
                                   pack_backend=cfg.pack_backend, region_notify=cfg.sender_region_notify)
        conn.send(("opened", dict(address=state["sender"].address, engine=state["sender"].engine.kind,
                                  checks=state["checks"].get(n))))

    def warm(arg: dict) -> None:
        # The kernels every round can launch, compiled once the decode ranks are linked
        # (`KVSender.warm_up`): a timed round that splits differently from the warm-up request's
        # (a rank announcing late) would otherwise compile its index bucket inside the request
        # (~0.2 s on an H200 for the fused copy).
        sender, end = state["sender"], time.monotonic() + cfg.timeout_s
        while len(sender.peers) < arg["peers"]:
            if time.monotonic() > end:
                raise TimeoutError(f"{len(sender.peers)} of {arg['peers']} decode ranks linked to the "
                                   f"sender after {cfg.timeout_s:g} s (--timeout-s)")
            time.sleep(0.002)
        t0 = time.perf_counter()
        round_rows = cfg.round_rows
        if round_rows is None and sender.mode == "region" and sender.region_notify == "round":
            # One round holds every window: its ranks hear ``done`` once all of its writes landed.
            round_rows = max(1, kv.pack_bytes(cfg, rank) // geo.row_bytes)
        buckets = sender.warm_up(max(1, kv.most_rows_to_one_rank(cfg, rank)), round_rows=round_rows)
        conn.send(("warmed", dict(buckets, seconds=time.perf_counter() - t0)))

    def send(arg: dict) -> None:
        sender, rid = state["sender"], arg["rid"]
        from pallas_kernels import compile_count, compile_log

        # Send once every linked decode rank's announcement is here, as in serving (decode ranks
        # announce at scheduling, long before the prefill ends): one that arrived after the first
        # round would go out a round later, and the rounds (`launches`) would vary run to run.
        end = time.monotonic() + cfg.timeout_s
        while _announced(sender, rid) < len(sender.peers) and time.monotonic() < end:
            time.sleep(0.0005)
        traces0 = compile_count()  # a kernel traced inside a timed request: the compile is in its time
        t0 = time.perf_counter()
        for start, stop in arg["chunks"]:  # one send per chunk; each returns at once
            try:
                sender.send(rid, table, start, stop)
            except ValueError:
                if not sender.poll(rid).terminal:
                    raise
                break  # the request already failed (a decode rank died): no more chunks
        while not (status := sender.wait(rid, POLL_S)).terminal:
            reason = inbox.abort_reason()
            if reason is not None:
                sender.abort(rid, f"aborted by the job: {reason}")
        total = time.perf_counter() - t0
        traced = compile_count() - traces0
        st = sender.request_stats(rid)
        conn.send(("sent", dict(status=status.value, ok=status is TransferStatus.SUCCESS,
                                reason=sender.failure_reason(rid), total_seconds=total,
                                plan_seconds=st["plan_seconds"], pack_seconds=st["pack_seconds"],
                                transfer_seconds=st["transfer_seconds"], ranks=st["ranks"],
                                first_byte_at=st["first_byte_at"], copy_seconds=st["copy_seconds"],
                                launches=st["launches"], timeline=st["timeline"],
                                staging="staged" if sender.staged else "direct", pack_backend=st["pack_backend"],
                                stage_seconds=st["stage_seconds"],
                                kernel_traces=traced, trace_log=compile_log()[-traced:] if traced else [],
                                unit_rows=verify.unit_rows(cfg, rank, arg["dcp_size"], arg["chunks"]))))

    _serve(inbox, dict(open=open_, warm=warm, send=send), state, "sender")
    del owner


def _quiet_send(conn: Connection, msg: Any) -> None:
    try:
        conn.send(msg)
    except Exception:  # noqa: BLE001 - best effort on the failure path
        pass


# ------------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------------
def decode_main(cfg_dict: dict, index: int, pools: tuple[int, int], tag: str, conn: Connection,
                gpu_env: dict | None = None) -> None:
    """Decode rank process: one registered pool of ``pools = (send_pool, pool_pages)`` pages
    (:func:`dcp_jax.job.kv.decode_pools`); one `KVReceiver` per mode; verifies every byte.
    ``gpu_env``: its placement (:func:`dcp_jax.job.gpus.child_env`)."""
    send_pool, pool_pages = pools
    try:
        cfg = _child_start(cfg_dict, gpu_env)
        geo, p = cfg.geometry, cfg.page_size
        buf, owner = kv.alloc_buffer(kv.kv_bytes(pool_pages, p, geo.kv_item_lens), cfg.device)
        layers = kv.layer_views(buf, pool_pages, p, geo.kv_item_lens)
        from dcp_jax.transfer import KVCacheSpec, KVReceiver, TransferStatus

        conn.send(("hello", dict(index=index, pool_pages=pool_pages, device=gpus.device_info(cfg.device))))
    except BaseException:  # noqa: BLE001
        _quiet_send(conn, ("error", traceback.format_exc()))
        raise SystemExit(1)
    state: dict[str, Any] = dict(recv=None, rank=index, size=cfg.dcp_size)
    inbox = _Inbox(conn)

    def open_(arg: dict) -> None:
        r, n = arg["dcp_rank"], arg["dcp_size"]
        spec = KVCacheSpec(geo.num_layers, tuple(geo.kv_item_lens), p, n, r, cfg.interleave_size)
        recv = KVReceiver(spec, layers, engine=cfg.engine_kind, group=f"{tag}-{arg['mode']}", direction=cfg.direction,
                          timeout_s=cfg.timeout_s, peer_timeout_s=min(cfg.timeout_s, PEER_TIMEOUT_S),
                          region_bytes=kv.region_bytes(cfg, arg["mode"], r, n), staging=cfg.staging)
        state.update(recv=recv, rank=r, size=n)
        # The unpack's buckets compiled before any sender links (`KVReceiver.warm_up`): on a
        # fresh GPU machine the first window's compile outlasted the senders' peer timeout.
        t0 = time.perf_counter()
        warmed = recv.warm_up(max(1, max(kv.most_rows_to_one_rank(cfg, k) for k in range(cfg.prefill_dcp_size))))
        warmed.update(seconds=time.perf_counter() - t0)
        for address in arg["addresses"]:
            recv.connect(address, timeout_s=min(cfg.timeout_s, 60.0))
        conn.send(("opened", warmed))

    def request(arg: dict) -> None:
        recv, r, n, rid = state["recv"], state["rank"], state["size"], arg["rid"]
        table = kv.decode_page_table(cfg, r, n, send_pool, seq=arg.get("seq", 0))
        if arg["fill"]:
            buf[:] = SENTINEL_BYTE
            kv.sync(buf)  # the sentinel must be in place before any peer may write
        base = recv.stats["bytes"]
        recv.expect(rid, table, arg["num_tokens"], cfg.prefix_tokens)
        conn.send(("ready", None))
        die_at = verify.die_bytes(cfg, r, n) if arg["hooks"] and cfg.die_rank == index else None
        t0 = last = time.perf_counter()
        while not (status := recv.wait(rid, DECODE_POLL_S)).terminal:
            reason = inbox.abort_reason()
            if reason is not None:
                recv.abort(rid, f"aborted by the job: {reason}")
            now = time.perf_counter()
            if die_at is not None or (arg["progress"] and now - last >= PROGRESS_S):
                landed = recv.stats["bytes"] - base
                if die_at is not None and landed >= die_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # test hook: die in the middle of a request
                if arg["progress"] and now - last >= PROGRESS_S:
                    conn.send(("progress", landed))
                    last = now
        wait_s = time.perf_counter() - t0
        if die_at is not None:
            os.kill(os.getpid(), signal.SIGKILL)  # completed before the hook fired: die before reporting
        rs = recv.request_stats(rid)
        out = dict(dcp_rank=r, status=status.value, errors=[] if status is TransferStatus.SUCCESS
                   else [f"{status.value}: {recv.failure_reason(rid)}"], wait_seconds=wait_s,
                   paths=rs["paths"], unpack_seconds=rs["unpack_seconds"], done_at=rs["done_at"],
                   timeline=rs["timeline"],
                   staging="staged" if recv.staged else "direct", unstage_seconds=rs["stage_seconds"])
        if arg["check"]:  # staged or not, what is checked is the KV itself (device memory on a GPU)
            out.update(verify.verify_pool(cfg, r, n, table, buf, layers, arg, status is TransferStatus.SUCCESS))
        conn.send(("result", out))

    _serve(inbox, dict(open=open_, request=request), state, "recv")
    del owner


def _announced(sender, rid: str) -> int:
    """Decode ranks whose announcement of ``rid`` reached ``sender`` (0 before the first)."""
    try:
        return len(sender.request_stats(rid)["ranks"])
    except KeyError:
        return 0

