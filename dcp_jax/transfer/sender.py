"""`KVSender`: the prefill side of the connector, one per prefill rank (process).

The caller owns its paged KV cache and its scheduler; the sender owns planning, packing,
transfer, completion and failure reporting for any number of concurrent requests. Its public
calls never block on the network: `send` queues a chunk, `poll` reads a status. One worker
thread does the rest, in this order each round: control messages, planning of newly possible
(chunk, rank) units, submission while the `PackArena` has room (FIFO, so nobody starves),
polling the engine for finished batches, timeouts and heartbeats.

Push (default; sglang's and NixlPushConnector's direction): the sender WRITEs each window to the
decode rank and attaches a ``done`` notification that the engine delivers after the bytes
landed. Pull (vLLM's default): the sender packs, tells the receiver where to READ
(``pull_ready``), and frees the region when the receiver reports its engine finished
(``pull_done``). A region is reused only after the engine (or, for pull, the reader) confirmed
every transfer reading it finished; an aborted or failed request's regions stay quarantined
until then.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge import PeerInfo, TransferError, make_engine
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._worker import ACTIVE, IDLE, PENDING, Worker, check_page_table, check_seconds
from dcp_jax.transfer.arena import PackArena
from dcp_jax.transfer.control import ControlServer
from dcp_jax.transfer.memory import CacheLayers
from dcp_jax.transfer.requests import RankTarget, SendRequest, check_request_id
from dcp_jax.transfer.schedule import SideLayout, batch_engine_calls, plan_rank_chunk
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec, check_compatible
from dcp_jax.transfer.status import TransferStatus
from dcp_jax.layout import local_len_np

__all__ = ["KVSender", "SEND_MODES", "DEFAULT_PACK_BYTES"]

logger = logging.getLogger(__name__)

SEND_MODES = ("auto", "packed", "direct")
DEFAULT_PACK_BYTES = 64 << 20


@dataclasses.dataclass(eq=False)
class _Conn:
    """One connected decode rank (its control identity, engine peer and cache geometry)."""

    ident: bytes
    name: str
    peer: str
    spec: KVCacheSpec
    group: str
    direction: str
    layer_bases: np.ndarray
    last_seen: float


@dataclasses.dataclass(eq=False)
class _Unit:
    """One window of one (request, chunk, rank): one engine batch or one pull."""

    req: SendRequest
    target: RankTarget
    rc: Any          # schedule.RankChunk
    w: int           # window index
    region: Any = None
    handle: Any = None


class KVSender:
    """Prefill-side connector over the caller's KV layers.

    Args:
        spec: this prefill rank's `KVCacheSpec` (``dcp_size``/``dcp_rank`` are the prefill DCP).
        kv_layers: ``spec.num_layers`` arrays ``[num_pages, page_size, ...]`` (numpy, JAX or
            CuPy, one kind), registered once and held until `close`; never copied.
        engine: ``"nixl"``, ``"mooncake"`` or ``"auto"``.
        host, port: where the control plane listens (port 0: any free port).
        mode: ``"packed"`` (gather each rank's rows into the pack buffer, then one descriptor
            per destination page run), ``"direct"`` (descriptors straight from the KV pages), or
            ``"auto"`` (direct when the decode interleave is a multiple of this page size, i.e.
            block round-robin keeps whole pages together; packed otherwise).
        pack_bytes: size of the registered pack buffer (bytes); windows larger than it are
            sliced; default `DEFAULT_PACK_BYTES`.
        max_batch_indices: at most this many rows per engine batch (None: no limit).
        timeout_s: a request with no progress for this long FAILS (seconds).
        peer_timeout_s: a receiver silent for this long is dropped and its requests FAIL.
        heartbeat_s: interval of the pings that keep connections alive (seconds).
        engine_options: keyword arguments for the engine adapter (`bridge.make_engine`).

    Raises:
        TypeError, ValueError: bad spec, layers or options (the message names the argument).
        bridge.BridgeError: the engine could not start or register (nothing is left open).
    """

    def __init__(self, spec: KVCacheSpec, kv_layers: Sequence[Any], *, engine: str = "nixl",
                 host: str = "127.0.0.1", port: int = 0, mode: str = "auto",
                 pack_bytes: int | None = None, max_batch_indices: int | None = None,
                 timeout_s: float = 30.0, peer_timeout_s: float = 5.0, heartbeat_s: float = 0.5,
                 engine_options: dict | None = None):
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        if mode not in SEND_MODES:
            raise ValueError(f"mode={mode!r} must be one of {SEND_MODES}")
        pack_bytes = DEFAULT_PACK_BYTES if pack_bytes is None else pack_bytes
        if isinstance(pack_bytes, bool) or not isinstance(pack_bytes, int) or pack_bytes < spec.row_bytes:
            raise ValueError(f"pack_bytes={pack_bytes!r} must be an int >= one token's "
                             f"{spec.row_bytes} bytes")
        if max_batch_indices is not None and (not isinstance(max_batch_indices, int) or max_batch_indices < 1):
            raise ValueError(f"max_batch_indices={max_batch_indices!r} must be None or an int >= 1")
        self.spec, self.mode = spec, mode
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self.peer_timeout_s = check_seconds("peer_timeout_s", peer_timeout_s)
        self.heartbeat_s = check_seconds("heartbeat_s", heartbeat_s)
        self.max_batch_indices = max_batch_indices
        self._layers = CacheLayers(spec, kv_layers)
        self._layout = SideLayout.of(spec)
        self._pack = _alloc_pack(pack_bytes, self._layers)
        self._arena = PackArena(pack_bytes, align=64)
        self._max_region_rows = pack_bytes // spec.row_bytes
        name = f"dcp-send-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.engine = make_engine(engine, name, **(engine_options or {}))
        try:
            self.engine.register(list(self._layers.regions) + [self._pack])
            self._ctl = ControlServer(host, port)
        except BaseException:
            self.engine.close()
            raise
        self._lock = threading.RLock()
        self._requests: dict[str, SendRequest] = {}
        self._early: dict[str, list] = {}     # expects for an id still held in a terminal state
        self._conns: dict[bytes, _Conn] = {}
        self._queue: deque[_Unit] = deque()
        self._inflight: list[_Unit] = []      # push windows the engine has not reported yet
        self._pulls: dict[tuple, _Unit] = {}  # pull windows the reader has not reported yet
        self._counts = dict(dropped_messages=0, handshakes=0, handshakes_refused=0, requests=0,
                            succeeded=0, failed=0, aborted=0, bytes=0, descriptors=0, batches=0,
                            engine_calls=0)
        from pallas_kernels import compile_count

        self._compile_count = compile_count
        self._worker = Worker(f"dcp-sender-{spec.dcp_rank}", self._round, self._ctl.sock)
        self._last_ping = 0.0
        self._worker.start()

    # ---- public API --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``"tcp://host:port"`` of the control plane: give it to `KVReceiver.connect`."""
        return self._ctl.address

    def send(self, request_id: str, page_table: Any, start: int, stop: int) -> None:
        """Queues tokens ``[start, stop)`` of a request for every decode rank; returns at once.

        Call once per chunk (chunked prefill) in any order of non-overlapping ranges. Ranks that
        have not announced the request yet (`KVReceiver.expect`) get it when they do.

        Args:
            request_id: the request's id (str, 1..256 characters), the same on both sides.
            page_table: int[pages]: ``page_table[k]`` is the physical page holding this prefill
                rank's local tokens ``[k*page_size, (k+1)*page_size)`` (spec section 10); it must
                cover local rows up to ``stop`` and may grow between chunks.
            start, stop: token positions, ``0 <= start < stop``.

        Raises:
            TypeError, ValueError: bad id, range or page table (page ids outside the cache, too
                few pages), a range overlapping one already sent, or a finished request id that
                was not released yet.
        """
        rid = check_request_id(request_id)
        if isinstance(start, bool) or isinstance(stop, bool) or not isinstance(start, (int, np.integer)) \
                or not isinstance(stop, (int, np.integer)) or not 0 <= start < stop:
            raise ValueError(f"start={start!r}, stop={stop!r} must be ints with 0 <= start < stop")
        start, stop = int(start), int(stop)
        rows = int(local_len_np(stop, self.spec.dcp_size, self.spec.dcp_rank, self.spec.interleave_size))
        table = check_page_table(page_table, rows, self.spec.page_size,
                                 self._layers.min_rows // self.spec.page_size)
        with self._lock:
            req = self._requests.get(rid)
            if req is None:
                req = self._new_request(rid)
            if req.status.terminal:
                raise ValueError(f"request_id={rid!r} is {req.status.name}; release() it before reusing the id")
            if req.sent.overlaps(start, stop):
                raise ValueError(f"tokens [{start}, {stop}) of request_id={rid!r} overlap a range already sent")
            req.sent.add(start, stop)
            req.chunks.append((start, stop))
            req.page_table = table
            req.state.touch()
        self._worker.wake()

    def poll(self, request_id: str) -> TransferStatus:
        """The request's `TransferStatus` on this side.

        Raises:
            KeyError: unknown (never sent nor announced, or released) request id.
        """
        return self._get(request_id).status

    def failure_reason(self, request_id: str) -> str:
        """Why the request FAILED or was ABORTED ("" otherwise). Raises KeyError if unknown."""
        return self._get(request_id).state.reason

    def abort(self, request_id: str, reason: str = "aborted by the prefill side") -> bool:
        """Aborts a request on this side and tells its decode ranks; idempotent.

        Queued windows are dropped; windows the engine is moving are cancelled as far as the
        engine can, and their pack regions stay quarantined until the engine reports them done.
        The request's source pages may be reused once `is_drained` says so.

        Returns:
            True if the request moved to ABORTED now, False if it was already terminal.

        Raises:
            KeyError: unknown request id.
        """
        with self._lock:
            req = self._get(request_id)
            return self._end(req, TransferStatus.ABORTED, str(reason)[:proto.MAX_TEXT], notify="abort")

    def release(self, request_id: str) -> None:
        """Forgets a request (aborting it first if it is still live); its id may then be reused.

        Raises:
            KeyError: unknown request id.
        """
        with self._lock:
            req = self._get(request_id)
            if not req.status.terminal:
                self._end(req, TransferStatus.ABORTED, "released before completion", notify="abort")
            del self._requests[req.rid]
            early = self._early.pop(req.rid, [])
        for conn, msg in early:  # announcements that came for the next use of this id
            with self._lock:
                self._on_expect(conn, msg)

    def is_drained(self, request_id: str) -> bool:
        """True when no engine operation of this request reads its pages any more (its source
        pages may be freed): always after SUCCESS; after FAILED/ABORTED once every window in
        flight was reported done by the engine or the reader. Raises KeyError if unknown."""
        with self._lock:
            req = self._get(request_id)
            return req.status.terminal and req.inflight == 0

    def request_stats(self, request_id: str) -> dict[str, Any]:
        """Per-request figures: status, per-rank rows/descriptors/bytes/batches/engine calls and
        strategies, plan/pack seconds, seconds from first submit to completion."""
        with self._lock:
            req = self._get(request_id)
            t0, t1 = req.t_first_submit, req.t_done
            return dict(status=req.status.value, reason=req.state.reason, inflight=req.inflight,
                        plan_seconds=req.plan_seconds, pack_seconds=req.pack_seconds,
                        transfer_seconds=(t1 - t0) if t0 is not None and t1 is not None else None,
                        ranks={r: t.counters.as_dict() for r, t in sorted(req.targets.items())})

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of this sender: requests by outcome, bytes/descriptors/batches/engine calls
        submitted, dropped and rejected messages, kernel compiles, pack arena, connections."""
        with self._lock:
            out = dict(self._counts)
            out.update(rejected_messages=self._ctl.rejected, live_requests=len(self._requests),
                       queued_windows=len(self._queue), inflight_windows=len(self._inflight) + len(self._pulls),
                       connections=len(self._conns), kernel_compiles=self._compile_count(),
                       arena=dict(self._arena.stats), worker_errors=self._worker.errors)
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the worker, fails what is live, closes the engine and sockets; releases every
        registration. Returns within ``timeout_s`` (+ a small margin) whatever the engine does.
        Idempotent."""
        deadline = time.monotonic() + check_seconds("timeout_s", timeout_s)
        if not self._worker.stop(max(0.1, deadline - time.monotonic() - 1.0)):
            logger.warning("sender worker did not stop in time; closing under it")
        with self._lock:
            for req in list(self._requests.values()):
                self._end(req, TransferStatus.FAILED, "sender closed", notify="failed")
            self._ctl.close()
        self.engine.close(timeout_s=max(0.1, deadline - time.monotonic()))
        self._layers.close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the worker's round ---------------------------------------------------------------------
    def _round(self) -> int:
        busy = False
        for ident, msg in self._ctl.recv():
            busy = True
            with self._lock:
                self._on_message(ident, msg)
        with self._lock:
            self._plan_units()
            busy |= self._submit_units()
            busy |= self._poll_inflight()
            self._check_timeouts()
            self._heartbeat()
            if busy:
                return ACTIVE
            return PENDING if self._inflight else IDLE

    def _on_message(self, ident: bytes, msg: dict) -> None:
        kind = msg["k"]
        if kind == "hello":
            return self._on_hello(ident, msg)
        conn = self._conns.get(ident)
        if conn is None:
            if kind == "_bad_version":
                return self._nack(ident, HandshakeError("version", proto.PROTOCOL_VERSION, msg["v"]))
            self._counts["dropped_messages"] += 1
            return
        conn.last_seen = time.monotonic()
        if kind == "expect":
            return self._on_expect(conn, msg)
        if kind == "pull_done":
            return self._on_pull_done(conn, msg)
        if kind in ("abort", "failed"):
            req = self._requests.get(msg["rid"])
            t = req.targets.get(conn.spec.dcp_rank) if req is not None else None
            if t is None or t.inc != msg["inc"] or t.conn is not conn:
                # Nothing of ours is in flight for that incarnation: the rank may reuse its pages.
                self._ctl.send(conn.ident, proto.encode("drained", msg["rid"], msg["inc"]))
                self._counts["dropped_messages"] += 1
                return
            if req.status.terminal:
                self._counts["dropped_messages"] += 1
                self._maybe_drained(req, t)
                return
            status = TransferStatus.ABORTED if kind == "abort" else TransferStatus.FAILED
            self._end(req, status, f"decode rank {conn.spec.dcp_rank}: {msg['reason']}", notify=kind)
        elif kind != "ping":
            self._counts["dropped_messages"] += 1

    def _on_hello(self, ident: bytes, msg: dict) -> None:
        try:
            spec = KVCacheSpec.from_dict(msg["spec"])
            check_compatible(self.spec, spec, side="prefill")
            if msg["direction"] not in ("push", "pull"):
                raise HandshakeError("direction", "push|pull", msg["direction"])
            group = [c for c in self._conns.values() if c.group == msg["group"] and c.ident != ident]
            for c in group:
                for field in ("dcp_size", "interleave_size"):
                    if getattr(c.spec, field) != getattr(spec, field):
                        raise HandshakeError(field, getattr(c.spec, field), getattr(spec, field),
                                             f"decode group {msg['group']!r} already has rank {c.spec.dcp_rank} with it")
            bases = proto.unpack_i64(msg["layer_bases"], "layer_bases", max_items=self.spec.num_layers)
            if len(bases) != self.spec.num_layers:
                raise HandshakeError("layer_bases", self.spec.num_layers, len(bases))
            info = PeerInfo.from_dict(msg["peer"])
        except HandshakeError as exc:
            return self._nack(ident, exc)
        except (TypeError, ValueError, proto.ProtocolError) as exc:
            return self._nack(ident, HandshakeError("spec", "a valid hello", "refused", str(exc)))
        for old in [c for c in group if c.spec.dcp_rank == spec.dcp_rank]:
            self._drop_conn(old, f"decode rank {spec.dcp_rank} reconnected")
        try:
            peer = self.engine.add_peer(info)
        except Exception as exc:  # noqa: BLE001 - refused metadata: tell the receiver why
            return self._nack(ident, HandshakeError("peer", "engine metadata", "refused", str(exc)))
        self._conns[ident] = _Conn(ident, msg["name"], peer, spec, msg["group"], msg["direction"],
                                   bases, time.monotonic())
        self._counts["handshakes"] += 1
        self._ctl.send(ident, proto.encode(
            "hello_ack", spec=self.spec.to_dict(), peer=self.engine.peer_info().to_dict(),
            layer_bases=proto.pack_i64(self._layers.bases), name=self.engine.name))

    def _nack(self, ident: bytes, exc: HandshakeError) -> None:
        self._counts["handshakes_refused"] += 1
        def plain(v):  # msgpack-able as is: scalars and lists of them; anything else as text
            if isinstance(v, (tuple, list)) and all(isinstance(x, (int, str)) for x in v):
                return list(v)
            return v if isinstance(v, (int, str, float, bool, type(None))) else repr(v)

        self._ctl.send(ident, proto.encode("hello_nack", field=exc.field, ours=plain(exc.ours),
                                           theirs=plain(exc.theirs), message=str(exc)[:proto.MAX_TEXT]))

    def _on_expect(self, conn: _Conn, msg: dict) -> None:
        rid, rank = msg["rid"], conn.spec.dcp_rank
        try:
            check_request_id(rid)
            if msg["dcp_rank"] != rank or msg["prefix_tokens"] > msg["num_tokens"]:
                raise proto.ProtocolError("expect: rank or token range inconsistent")
            table = proto.unpack_i64(msg["page_table"], "page_table")
            s = conn.spec  # once per announcement, so planning each chunk need not check it again
            rows = int(local_len_np(msg["num_tokens"], s.dcp_size, s.dcp_rank, s.interleave_size))
            table = check_page_table(table, rows, s.page_size, np.iinfo(np.int64).max // s.page_size)
        except (TypeError, ValueError) as exc:
            logger.debug("dropping expect: %s", exc)
            self._counts["dropped_messages"] += 1
            return
        req = self._requests.get(rid)
        if req is not None and req.status.terminal:
            if rank in req.targets or req.status is TransferStatus.SUCCESS:
                # This rank already had this id: the decode side released and reused it.
                self._early.setdefault(rid, []).append((conn, msg))
            else:  # a late announcement of the request that ended: tell the rank how it ended
                kind = "abort" if req.status is TransferStatus.ABORTED else "failed"
                self._ctl.send(conn.ident, proto.encode(kind, rid, msg["inc"], reason=req.state.reason))
            return
        if req is None:
            req = self._new_request(rid)
        old = req.targets.get(rank)
        if old is not None or (req.group is not None and req.group != conn.group):
            self._counts["dropped_messages"] += 1  # a duplicate or a second group: not ours
            return
        req.group, req.group_size = conn.group, conn.spec.dcp_size
        req.targets[rank] = RankTarget(conn, msg["inc"], msg["num_tokens"], msg["prefix_tokens"], table)
        req.state.touch()
        self._maybe_done(req)

    def _new_request(self, rid: str) -> SendRequest:
        req = self._requests[rid] = SendRequest(rid)
        self._counts["requests"] += 1
        return req

    # ---- planning and submission ------------------------------------------------------------------
    def _plan_units(self) -> None:
        for req in self._requests.values():
            if req.status.terminal or req.page_table is None:
                continue
            for rank, t in req.targets.items():
                while t.next_chunk < len(req.chunks):
                    ci = t.next_chunk
                    t.next_chunk += 1
                    start, stop = req.chunks[ci]
                    if stop > t.num_tokens:
                        self._end(req, TransferStatus.FAILED, f"tokens [{start}, {stop}) pass decode rank "
                                  f"{rank}'s num_tokens={t.num_tokens}", notify="failed")
                        break
                    tp = time.perf_counter()
                    try:
                        rc = plan_rank_chunk(
                            ci, max(start, t.prefix_tokens), max(stop, t.prefix_tokens), src=self._layout,
                            dst=SideLayout.of(t.conn.spec), src_page_table=req.page_table,
                            dst_page_table=t.page_table, mode=self._mode_for(t.conn.spec),
                            max_batch_indices=self.max_batch_indices, max_region_rows=self._max_region_rows,
                            check_tables=False)  # both tables were checked once, at send / expect
                    except ValueError as exc:
                        self._end(req, TransferStatus.FAILED, f"plan for decode rank {rank}: {exc}", notify="failed")
                        break
                    req.plan_seconds += time.perf_counter() - tp
                    t.parts_left[ci] = (len(rc.windows), start, stop)
                    t.counters.rows += len(rc.src_rows)
                    if rc.strategy != "empty":
                        t.counters.strategies.add(rc.strategy)
                    self._queue.extend(_Unit(req, t, rc, w) for w in range(len(rc.windows)))
                if req.status.terminal:
                    break

    def _mode_for(self, dst: KVCacheSpec) -> str:
        if self.mode != "auto":
            return self.mode
        return "direct" if dst.interleave_size % self.spec.page_size == 0 else "packed"

    def _submit_units(self) -> bool:
        busy = False
        while self._queue:
            u = self._queue[0]
            if u.req.status.terminal:
                self._queue.popleft()
                continue
            lo, hi = u.rc.windows[u.w]
            if u.rc.strategy == "packed" and hi > lo:
                u.region = self._arena.acquire((u.req.rid, u.rc.chunk, u.target.conn.spec.dcp_rank, u.w),
                                               u.rc.window_bytes(u.w, self._layers.item_lens))
                if u.region is None:
                    break  # the arena is full: wait for a transfer to finish (FIFO keeps order)
            self._queue.popleft()
            busy = True
            try:
                self._submit(u, lo, hi)
            except Exception as exc:  # noqa: BLE001 - the request fails, the sender lives on
                if u.region is not None:
                    self._arena.release(u.region)
                self._end(u.req, TransferStatus.FAILED, f"decode rank {u.target.conn.spec.dcp_rank}, chunk "
                          f"{u.rc.chunk}: {type(exc).__name__}: {exc}", notify="failed")
        return busy

    def _submit(self, u: _Unit, lo: int, hi: int) -> None:
        req, t, rc = u.req, u.target, u.rc
        rank, n = t.conn.spec.dcp_rank, hi - lo
        region_addr = None
        if u.region is not None:
            from pallas_kernels import pack_rows

            tk = time.perf_counter()
            pack_rows(self._layers.rows, rc.src_rows[lo:hi], self._pack.array, offset=u.region.offset)
            req.pack_seconds += time.perf_counter() - tk
            region_addr = self._pack.addr + u.region.offset
        head = dict(chunk=rc.chunk, part=u.w, nparts=len(rc.windows), start=rc.start, stop=rc.stop, nrows=n)
        if req.t_first_submit is None:
            req.t_first_submit = time.perf_counter()
        req.state.advance(TransferStatus.TRANSFERRING)
        if t.conn.direction == "pull":
            src_rows = b"" if region_addr is not None else proto.pack_i64(rc.src_rows[lo:hi])
            self._pulls[(req.rid, t.inc, rank, rc.chunk, u.w)] = u
            req.inflight += 1
            t.inflight += 1
            # The reader builds these very descriptors (same rows, same runs): count them here.
            ndesc = rc.descriptors_per_window(self.spec.num_layers)[u.w] if n else 0
            self._count(t, ndesc, rc.window_bytes(u.w, self._layers.item_lens) if n else 0,
                        batch_engine_calls(ndesc, getattr(self.engine, "window", None)) if n else 0)
            self._ctl.send(t.conn.ident, proto.encode("pull_ready", req.rid, t.inc, lo=lo, src_addr=region_addr or 0,
                                                      src_rows=src_rows, **head))
            return
        descs = rc.window_descriptors(u.w, src_bases=self._layers.bases, dst_bases=t.conn.layer_bases,
                                      item_lens=self._layers.item_lens, region_addr=region_addr)
        notif = proto.encode("done", req.rid, t.inc, **head)
        u.handle = self.engine.transfer_batch(t.conn.peer, descs, notif=notif, dcp_rank=rank, chunk=rc.chunk)
        req.inflight += 1
        t.inflight += 1
        self._inflight.append(u)
        self._count(t, len(descs), int(descs[:, 2].sum()) if len(descs) else 0,
                    batch_engine_calls(len(descs), getattr(self.engine, "window", None)))

    def _count(self, t: RankTarget, descriptors: int, nbytes: int, calls: int) -> None:
        """Adds one batch to the rank's and the sender's counters (a notification-only batch
        moves no descriptor and counts no batch)."""
        batches = 1 if descriptors else 0
        c = t.counters
        c.descriptors += descriptors
        c.bytes += nbytes
        c.batches += batches
        c.engine_calls += calls
        for k, v in (("descriptors", descriptors), ("bytes", nbytes), ("batches", batches), ("engine_calls", calls)):
            self._counts[k] += v

    def _poll_inflight(self) -> bool:
        busy, keep = False, []
        for u in self._inflight:
            err = None
            try:
                done = self.engine.check(u.handle)
            except TransferError as exc:
                done, err = True, exc
            if not done:
                keep.append(u)
                continue
            busy = True
            self._unit_finished(u, None if err is None else f"engine: {err}")
        self._inflight = keep
        return busy

    def _unit_finished(self, u: _Unit, error: str | None) -> None:
        """The engine (or the reader) is done with a window: free its region, credit or fail."""
        if u.region is not None:
            if u.region.state == "quarantined":
                self._arena.release_quarantined(u.region)
            else:
                self._arena.release(u.region)
            u.region = None
        req, t = u.req, u.target
        req.inflight -= 1
        t.inflight -= 1
        if req.status.terminal or self._requests.get(req.rid) is not req:
            self._maybe_drained(req, t)
            return
        if error is not None:
            self._end(req, TransferStatus.FAILED, f"decode rank {t.conn.spec.dcp_rank}, chunk {u.rc.chunk}: {error}",
                      notify="failed")
            return
        left, start, stop = t.parts_left[u.rc.chunk]
        if left > 1:
            t.parts_left[u.rc.chunk] = (left - 1, start, stop)
        else:
            del t.parts_left[u.rc.chunk]
            t.coverage.add(start, stop)
        req.state.touch()
        self._maybe_done(req)

    def _maybe_done(self, req: SendRequest) -> None:
        if not req.status.terminal and req.complete() and req.inflight == 0:
            if req.finish(TransferStatus.SUCCESS):
                self._counts["succeeded"] += 1

    def _on_pull_done(self, conn: _Conn, msg: dict) -> None:
        u = self._pulls.pop((msg["rid"], msg["inc"], conn.spec.dcp_rank, msg["chunk"], msg["part"]), None)
        if u is None or u.target.conn is not conn:
            self._counts["dropped_messages"] += 1
            return
        self._unit_finished(u, None if msg["ok"] else f"reader: {msg['reason']}")

    # ---- endings, timeouts, peers ------------------------------------------------------------------
    def _end(self, req: SendRequest, status: TransferStatus, reason: str, *, notify: str | None) -> bool:
        """Moves a live request to FAILED/ABORTED, tells its decode ranks, quarantines its regions."""
        if not req.finish(status, reason):
            return False
        self._counts["failed" if status is TransferStatus.FAILED else "aborted"] += 1
        for u in self._inflight + list(self._pulls.values()):
            if u.req is req and u.region is not None and u.region.state != "quarantined":
                self._arena.quarantine(u.region)
                if u.handle is not None:
                    self.engine.cancel(u.handle)
        if notify:
            for t in req.targets.values():
                if t.conn.ident in self._conns:
                    self._ctl.send(t.conn.ident, proto.encode(notify, req.rid, t.inc, reason=reason[:proto.MAX_TEXT]))
        for t in req.targets.values():
            self._maybe_drained(req, t)
        return True

    def _maybe_drained(self, req: SendRequest, t: RankTarget) -> None:
        """Tells a rank of an ended (not successful) request once no write of ours into its
        pages is in flight: the decode side may then reuse them (`KVReceiver.is_drained`)."""
        if (req.status.terminal and req.status is not TransferStatus.SUCCESS and not t.drained
                and t.inflight == 0 and t.conn.ident in self._conns):
            t.drained = True
            self._ctl.send(t.conn.ident, proto.encode("drained", req.rid, t.inc))

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for req in list(self._requests.values()):
            if not req.status.terminal and req.state.stalled_for(now) > self.timeout_s:
                self._end(req, TransferStatus.FAILED, f"no progress for {self.timeout_s:g} s", notify="failed")

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if now - conn.last_seen > self.peer_timeout_s:
                self._drop_conn(conn, f"decode rank {conn.spec.dcp_rank} silent for {self.peer_timeout_s:g} s")
        if now - self._last_ping >= self.heartbeat_s:
            self._last_ping = now
            ping = proto.encode("ping")
            for conn in list(self._conns.values()):
                self._ctl.send(conn.ident, ping)

    def _drop_conn(self, conn: _Conn, reason: str) -> None:
        """A receiver is gone: fail its requests, forget its engine peer (its handles then end)."""
        self._conns.pop(conn.ident, None)
        for req in list(self._requests.values()):
            t = req.targets.get(conn.spec.dcp_rank)
            if t is not None and t.conn is conn:
                self._end(req, TransferStatus.FAILED, reason, notify="failed")
        for key, u in list(self._pulls.items()):
            if u.target.conn is conn:  # a dead reader reads no more: its regions are free
                del self._pulls[key]
                self._unit_finished(u, reason)
        try:
            self.engine.remove_peer(conn.peer)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _get(self, request_id: str) -> SendRequest:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request_id={request_id!r} is not known to this sender")
        return req

    def __repr__(self) -> str:
        return (f"KVSender(address={self.address!r}, engine={self.engine.kind!r}, "
                f"requests={len(self._requests)}, connections={len(self._conns)})")


def _alloc_pack(nbytes: int, layers: CacheLayers):
    from bridge.buffers import DeviceBuffer, HostBuffer

    if layers.mem_type == "DRAM":
        return HostBuffer(nbytes)
    return DeviceBuffer(nbytes, device_id=layers.device_id)
