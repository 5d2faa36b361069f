"""`KVSender`: the prefill side of the connector, one per prefill rank (process).

The caller owns its paged KV cache and its scheduler; the sender owns planning, packing,
transfer, completion and failure reporting for any number of concurrent requests. Its public
calls never block on the network: `send` queues a chunk, `poll` reads a status. One worker
thread does the rest, in this order each round: control messages, planning of newly possible
(chunk, rank) units, submission while the `PackArena` has room (FIFO, so nobody starves),
polling the engine for finished batches, timeouts and heartbeats (`_sender_round`; the
figures it reports are in `_sender_stats`; the per-request calls `send`, `poll`, `wait`, `abort`,
`release`, ... in `_sender_requests`).

Push (default; sglang's and NixlPushConnector's direction): the sender WRITEs each window to the
decode rank and attaches a ``done`` notification that the engine delivers after the bytes
landed. Pull (vLLM's default): the sender packs, tells the receiver where to READ
(``pull_ready``), and frees the region when the receiver reports its engine finished
(``pull_done``). A region is reused only after the engine (or, for pull, the reader) confirmed
every transfer reading it finished; an aborted or failed request's regions stay quarantined
until then.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

from pallas_kernels import GatherConfig, PackSource, compile_count
from dcp_jax._validate import check_int_type
from dcp_jax.transfer._worker import (DEFAULT_HEARTBEAT_S, Worker, check_liveness, close_at_exit, shut_down,
                                      CheckedSeconds, FixedSeconds, SetOnce)
from dcp_jax.transfer.arena import PackArena
from dcp_jax.transfer._sender_handshake import SenderHandshake
from dcp_jax.transfer._sender_peers import SenderPeers
from dcp_jax.transfer._region import SEND_MODES
from dcp_jax.transfer._sender_region import REGION_HOLD_MAX_S, REGION_NOTIFY, SenderRegion  # noqa: F401 - docs name them
from dcp_jax.transfer._sender_endings import SenderEndings
from dcp_jax.transfer._sender_units import SenderUnits
from dcp_jax.transfer._sender_pack import SenderPack
from dcp_jax.transfer._sender_requests import SenderRequests
from dcp_jax.transfer._sender_warm import SenderWarmUp
from dcp_jax.transfer._sender_round import SenderRound
from dcp_jax.transfer._sender_stats import SenderStats
from dcp_jax.transfer.control import ControlServer, make_side_engine
from dcp_jax.transfer.memory import MAX_BUFFER_BYTES, CacheLayers, alloc_pack
from dcp_jax.transfer.requests import SendRequest
from dcp_jax.transfer.schedule import SideLayout
from dcp_jax.transfer.spec import KVCacheSpec
from dcp_jax.transfer.staging import Packer, side_staged

__all__ = ["KVSender", "SEND_MODES", "DEFAULT_PACK_BYTES"]

logger = logging.getLogger(__name__)

DEFAULT_PACK_BYTES = 64 << 20


class KVSender(SenderRequests, SenderRound, SenderPeers, SenderHandshake, SenderUnits, SenderPack, SenderEndings,
               SenderRegion, SenderWarmUp, SenderStats):
    """Prefill-side connector over the caller's KV layers.

    Typical life: construct, hand `address` to the decode ranks, `warm_up` once they have
    connected (GPU caches: compiles the pack and fused launches before the first request), then
    per request `send` each prefilled chunk, `wait` / `poll`, `release`; `close` at the end.

    Args:
        spec: this prefill rank's `KVCacheSpec` (``dcp_size``/``dcp_rank`` are the prefill DCP).
        kv_layers: ``spec.num_layers`` arrays ``[num_pages, page_size, ...]`` (numpy, JAX or
            CuPy, one kind), registered once and held until `close`; never copied.
        engine: ``"nixl"``, ``"mooncake"``, ``"jax-transfer"`` or ``"auto"``.
        host, port: where the control plane listens and what it advertises (an address receivers
            reach, not a wildcard such as "0.0.0.0"; port in [0, 65535]; 0: any free port); Mooncake listens
            on ``host`` too unless ``engine_options`` names a ``hostname`` (NIXL: UCX's
            interfaces come from ``UCX_NET_DEVICES``).
        mode: the transfer path for every decode rank: ``"packed"`` (gather each rank's rows
            into the pack buffer, then one descriptor per destination page run per layer),
            ``"direct"`` (descriptors straight from the KV pages), ``"region"`` (gather, then ONE
            descriptor per window into the rank's receive region, unpacked there), ``"fused"``
            (same host, GPU caches: one copy kernel into the rank's IPC-mapped pages), or
            ``"auto"`` (per peer, `dcp_jax.transfer._region.choose_path`: fused, else direct on
            hosts when pages stay whole, else region when the rank offers one, else packed). A
            path a rank cannot take refuses its handshake (`HandshakeError` field ``"path"``).
        pack_bytes: size of the registered pack buffer (bytes, one token's ``spec.row_bytes``
            to `memory.MAX_BUFFER_BYTES`); windows larger than it are sliced; default
            `DEFAULT_PACK_BYTES`.
        max_batch_indices: at most this many rows per engine batch (None: no limit).
        timeout_s: a request with no progress for this long FAILS (seconds). Progress is a chunk
            (`send`), a rank's announcement or a window completed. An engine batch (or pull) the
            engine still reports live (neither completed nor failed) is no stall, as the engine
            cannot report progress inside one batch: it keeps its request alive for
            ``timeout_s`` + its size allowance (`_sender_endings.batch_allowance`: 1 ms a
            descriptor + 1 s per 10 MB; 120,000 descriptors: 120 s more), counted from its post
            or from the completion of the batch posted before it to the same rank, and no
            sooner than the bound of an earlier batch to that rank still in flight (it waits its
            turn behind it). Past that bound it FAILS as stuck (the reason names the batch); a dead rank still ends it after
            ``peer_timeout_s``. Each decode rank is told which of its requests have such a batch
            in flight within its bound (``moving`` frames, at most one per ``heartbeat_s`` a rank
            while there are such, each entry with a lease up to that bound): its own
            ``timeout_s`` counts the request as progressing until the lease ends, so both sides
            agree (`KVReceiver`).
        peer_timeout_s: a receiver silent for this long is dropped and its requests FAIL. Set at
            construction only (sent to the peers at hello; reassigning raises AttributeError),
            as is ``heartbeat_s``; ``timeout_s`` may be reassigned while it runs.
        heartbeat_s: interval of the pings that keep connections alive (seconds).
        engine_options: keyword arguments for the engine adapter (`bridge.make_engine`).
        staging: ``"auto"`` (stage through host memory when the engine cannot register the KV's
            memory: `dcp_jax.transfer.staging.side_staged`), ``"none"`` or ``"host"`` (always).
            Staged, only the pack buffer (pinned host memory) is registered; windows are
            gathered on the device and copied into it; peers then take ``packed`` or ``region``.
        pack_backend: ``"auto"`` or a `pallas_kernels.registry` backend name (``"xla"``,
            ``"host"``, ``"gpu-triton"``, ``"gpu-mosaic"``, ...) that gathers the windows
            (`dcp_jax.transfer.staging.Packer`); `request_stats` names it.
        region_notify: how a decode rank learns that a region-push window landed (set once,
            here). ``"write"`` (default): the engine's notification travels with each write, so
            the rank unpacks as soon as its own window is there. ``"round"``: writes go without
            one, and each rank of a pack round hears ``done`` over the control plane once every
            region write of that round has completed (at most `REGION_HOLD_MAX_S` after its own
            ended; `close` tells the ones still waiting), so this side's SUCCESS may come up to
            that long before a rank hears its ``done`` (the rank's own SUCCESS follows it). For
            decode ranks on the sender's own GPU: its processes time-slice, so an early rank's
            unpack runs between the copies still moving and delays them. It pays with ONE round
            for the request (``warm_up(round_rows=...)`` at least the rows it sends; the main job
            sets that): 32k job on one H100, 2026-12-07, transfer phase 1,024-1,162 GB/s against
            496-557, the whole request level (265.7-286.5 against 260.2-276.0 GB/s); with the
            default rounds each round's notices wait for its writes and it lost (232.0 against
            276.0). Pulls and the other paths ignore it.

    Attributes:
        staged: True when this side stages (its KV is not registered).
        pack_backend: the registry name of the backend that packs.

    Raises:
        TypeError, ValueError: bad spec, layers or options (the message names the argument;
            ``mode="direct"``/``"fused"`` with a staged side).
        MemoryError: the pack buffer of ``pack_bytes`` could not be allocated (names it).
        bridge.BridgeError: the engine could not start or register (nothing is left open).
    """

    timeout_s = CheckedSeconds()  # settable while it runs: checked on every assignment
    peer_timeout_s = FixedSeconds()  # sent to the peers at hello: set once, here
    heartbeat_s = FixedSeconds()
    spec = SetOnce()  # the handshake and every request's checks rest on these: set once, here
    mode = SetOnce()
    staged = SetOnce()
    max_batch_indices = SetOnce()
    region_notify = SetOnce()

    def __init__(self, spec: KVCacheSpec, kv_layers: Sequence[Any], *, engine: str = "nixl",
                 host: str = "127.0.0.1", port: int = 0, mode: str = "auto",
                 pack_bytes: int | None = None, max_batch_indices: int | None = None,
                 timeout_s: float = 30.0, peer_timeout_s: float = 5.0, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 engine_options: dict | None = None, staging: str = "auto", pack_backend: str = "auto",
                 region_notify: str = "write"):
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        if mode not in SEND_MODES:
            raise ValueError(f"mode={mode!r} must be one of {SEND_MODES}")
        if region_notify not in REGION_NOTIFY:
            raise ValueError(f"region_notify={region_notify!r} must be one of {REGION_NOTIFY}")
        pack_bytes = check_int_type("pack_bytes", DEFAULT_PACK_BYTES if pack_bytes is None else pack_bytes)
        if not spec.row_bytes <= pack_bytes <= MAX_BUFFER_BYTES:
            raise ValueError(f"pack_bytes={pack_bytes!r} must be an int >= one token's "
                             f"{spec.row_bytes} bytes and <= 2**62")
        if max_batch_indices is not None:
            max_batch_indices = check_int_type("max_batch_indices", max_batch_indices)
            if max_batch_indices < 1:
                raise ValueError(f"max_batch_indices={max_batch_indices!r} must be None or an int >= 1")
        max_batch_indices = None if max_batch_indices is None else int(max_batch_indices)
        if not isinstance(host, str) or not host:
            # Unlike a receiver's (None: connect from any interface), the sender's host is the
            # address it advertises: receivers connect to it.
            raise ValueError(f"host={host!r} must be an address of this machine that receivers reach "
                             "(a str such as '127.0.0.1'): the control plane listens and is advertised there")
        if _is_wildcard(host):  # a wildcard binds, but no receiver can dial it
            raise ValueError(f"host={host!r} is a wildcard: the sender advertises its host to receivers "
                             "(`address`), so give this machine's address that they reach (e.g. its IP)")
        self.spec, self.mode, self.region_notify = spec, mode, region_notify
        self.timeout_s = timeout_s  # checked (`CheckedSeconds`), here and on any later assignment
        self.peer_timeout_s = peer_timeout_s  # checked (`FixedSeconds`): set once, here
        self.heartbeat_s = heartbeat_s
        check_liveness(self.heartbeat_s, self.peer_timeout_s)
        self.max_batch_indices = max_batch_indices
        self._layers = CacheLayers(spec, kv_layers)
        self._source = PackSource(self._layers.rows)  # checked (and imported) once for every pack
        self._layout = SideLayout.of(spec)
        self._arena = PackArena(pack_bytes, align=64)
        self._max_region_rows = pack_bytes // spec.row_bytes
        # Index rows one kernel launch of a round may take (`warm_up` sets them to the largest
        # bucket it compiled; a round past them goes on in the next round, a lone window that is
        # larger still runs): every window counts its rows rounded up to a row block.
        self._index_block = GatherConfig.default().block_rows
        self._index_cap = {"pack": float("inf"), "fused": float("inf")}
        name = f"dcp-send-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.engine = make_side_engine(engine, name, host, engine_options)
        try:
            self.staged = side_staged(staging, self.engine.kind, self._layers.mem_type)
            if self.staged and mode in ("direct", "fused"):
                raise ValueError(f"mode={mode!r} needs the KV registered, but this sender stages "
                                 f"(staging={staging!r}, {self.engine.kind} engine, {self._layers.mem_type} KV): "
                                 "use mode 'packed', 'region' or 'auto'")
            try:
                self._pack = alloc_pack(pack_bytes, self._layers, self.staged)
            except (MemoryError, OSError) as exc:  # the allocator's own words do not say which buffer
                raise MemoryError(f"pack_bytes={pack_bytes:,}: cannot allocate the pack buffer "
                                  f"({type(exc).__name__}: {exc})") from exc
            self._packer = Packer(self._layers.rows, self._source, self._pack.array, pack_backend, staged=self.staged)
            self.pack_backend = self._packer.name
            # Staged: the engine never sees the KV, only the (host) pack buffer.
            self.engine.register(([] if self.staged else list(self._layers.regions)) + [self._pack])
            self._ctl = ControlServer(host, port)
        except BaseException:
            self.engine.close()
            raise
        self._lock = threading.RLock()
        self._closed = False
        self._requests: dict[str, SendRequest] = {}
        self._to_plan: dict[SendRequest, None] = {}  # ordered set: chunks or ranks not planned yet
        self._next_timeout_check = 0.0
        self._early: dict[str, list] = {}     # expects for an id still held in a terminal state
        # Released FAILED / ABORTED ids, for timeout_s: rid -> (until, ranks that had announced it,
        # status, reason): a rank announcing it late is told how it ended (`_on_expect`).
        self._released_ended: dict[str, tuple] = {}
        # Every released id, for timeout_s: rid -> until. A request started under such an id (by a
        # `send` or an announcement) is "reborn": a chunk of it may be a late one of the released request.
        self._released_at: dict[str, float] = {}
        # Requests dropped unsent (`_forget_unsent`), for timeout_s more: rid -> (until, request).
        # `poll`, `wait`, `failure_reason`, `request_stats` and `release` still answer for them.
        self._forgotten: dict[str, tuple[float, SendRequest]] = {}
        # rid -> {rank: inc} of announcements parked in `_early` that their ranks cancelled: the
        # request the parked rest start (`_replay_early`) must know those ranks had the id.
        self._cancelled_early: dict[str, dict[int, int]] = {}
        self._conns: dict[bytes, Any] = {}     # control identity -> _sender_peers.Conn
        self._outbox: deque = deque()        # (identity, frame) made off the worker thread: `_tell`
        self._queue: deque = deque()         # _sender_units.Unit, FIFO (per rank; see _submit_units)
        self._held: dict = {}                # Conn -> pack-arena bytes its windows hold
        self._inflight: list = []      # push windows the engine has not reported yet
        self._post_seq = 0             # engine batches and pulls posted so far (`Unit.seq`)
        self._pulls: dict[tuple, Any] = {}  # pull windows the reader has not reported yet
        self._fused: list = []              # fused copies enqueued this round, waited for at its end
        self._fused_launched: tuple = ({}, [])  # their launch's (errors by unit, one copier per launch)
        self._fused_seq: int | None = None  # the flag number bumped behind that launch (None: not gated)
        self._flag: Any = None              # fused path: the flag page ranks wait on (`_sender_region._flag_name`)
        self._asks: dict[tuple, Any] = {}   # region windows packed, waiting for the rank's grant
        self._held_dones: list = []        # (unit, ended at): region_notify="round" notices not told yet
        self._round_no = 0                 # pack rounds so far (`Unit.round`)
        # Rounds whose device pack is enqueued, oldest first: (ticket, windows, when), `_post_ready`.
        self._packing: deque = deque()
        self._counts = dict(dropped_messages=0, handshakes=0, handshakes_refused=0, requests=0,
                            succeeded=0, failed=0, aborted=0, bytes=0, descriptors=0, batches=0,
                            engine_calls=0, stalls=0, held_hellos=0)
        self._compile_count = compile_count
        # A worker stalled this long (SIGSTOP, a pause of the process) may have been dropped as
        # silent by a receiver, which then reuses the pages: `SenderPeers._on_stall`. The shortest
        # limit of the connections (`_update_stall_limit`), by each receiver's own peer_timeout_s.
        self._stall_s = float("inf")
        self._last_round = time.monotonic()
        self._held_hellos: dict[bytes, tuple] = {}  # ident -> (hello, first seen): `_hold_hello`
        self._worker = Worker(f"dcp-sender-{spec.dcp_rank}", self._round, self._ctl.sock, spin_fn=self._spin_ready)
        self._last_ping = 0.0
        self._worker.start()
        close_at_exit(self)

    # ---- public API --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``"tcp://host:port"`` of the control plane: give it to `KVReceiver.connect`."""
        return self._ctl.address

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVSender is closed")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the worker, fails what is live, closes the engine and sockets; releases every
        registration. Returns within ``timeout_s`` (+ a small margin) whatever the engine does.
        Idempotent. The decode ranks hear ``bye`` after the engine's close, saying whether it was
        torn down in time (then they give back the pages of the failed requests at once).

        Raises:
            TypeError, ValueError: ``timeout_s`` is not a number of seconds in (0, 86400].
        """
        shut_down(self, timeout_s, "sender", self._close_conns)
        self._source = None
        self._layers.close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVSender(address={self.address!r}, engine={self.engine.kind!r}, "
                f"requests={len(self._requests)}, connections={len(self._conns)}{', closed' if self._closed else ''})")


def _is_wildcard(host: str) -> bool:
    """True for an address that means "every interface": ``*``, IPv4's 0.0.0.0 in any spelling
    the resolver takes (``0``, ``0.0``, ``00.0.0.0``), IPv6's ``::`` (bracketed or not)."""
    import ipaddress
    import socket

    if host == "*":
        return True
    try:
        return socket.inet_aton(host) == b"\0\0\0\0"
    except OSError:
        pass
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a name: resolved by the control plane

