"""`KVReceiver`: one decode rank's side of the connector.

The decode rank owns its paged KV cache and decides where each request's rows go
(`expect`); the receiver announces that to every prefill sender it is connected to and learns
completion from the engine itself: in push mode from the ``done`` notifications the engine
delivers after a batch's bytes landed, in pull mode from its own READs finishing. A request is
SUCCESS only when, for every sender, the chunks it completed cover ``[prefix_tokens,
num_tokens)``. Messages that do not belong to a live request of the right incarnation are
dropped and counted, never credited to another request.

Module map (mixins of `KVReceiver`): the per-request calls (`expect`, `poll`, `wait`, `abort`,
`release`, ...) in `_receiver_requests`, the handshake, links and coverage checks in
`_receiver_links`, the worker's round and what arrives (notifications, reads, endings) in
`_receiver_data`, the region and fused paths in `_receiver_region`, the figures it reports
(`stats`, `peers`, `request_stats`) in `_receiver_stats`.
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

import numpy as np

from dcp_jax._validate import check_int_type
from dcp_jax.transfer._worker import (DEFAULT_HEARTBEAT_S, Worker, check_liveness, check_seconds, close_at_exit,
                                      shut_down, CheckedSeconds, FixedSeconds, SetOnce)
from dcp_jax.transfer._receiver_data import ReceiverData
from dcp_jax.transfer._receiver_links import Link, ReceiverLinks, missing_senders  # noqa: F401  (missing_senders: re-exported)
from dcp_jax.transfer._receiver_region import ReceiverRegion
from dcp_jax.transfer._receiver_requests import ReceiverRequests
from dcp_jax.transfer._receiver_stats import ReceiverStats
from dcp_jax.transfer._region import DEFAULT_REGION_BYTES, ReceiveRegion, ipc_export
from dcp_jax.transfer.control import check_local_host, make_side_engine
from dcp_jax.transfer.memory import MAX_BUFFER_BYTES, CacheLayers
from dcp_jax.transfer.requests import RecvRequest, check_request_id
from dcp_jax.transfer.schedule import SideLayout
from dcp_jax.transfer.spec import KVCacheSpec
from dcp_jax.transfer.staging import side_staged

__all__ = ["KVReceiver", "DIRECTIONS"]

logger = logging.getLogger(__name__)

DIRECTIONS = ("push", "pull")


class KVReceiver(ReceiverRequests, ReceiverLinks, ReceiverData, ReceiverRegion, ReceiverStats):
    """Decode-rank connector over the caller's KV layers.

    Typical life: construct, `warm_up` (GPU caches: compiles the region path's unpack before any
    window lands), `connect` to each prefill sender, then per request `expect`, `wait` / `poll`,
    `release`; `close` at the end.

    Args:
        spec: this decode rank's `KVCacheSpec` (``dcp_size``/``dcp_rank``/``interleave_size`` are
            the decode DCP layout).
        kv_layers: ``spec.num_layers`` arrays ``[num_pages, page_size, ...]`` (numpy, JAX or
            CuPy), registered once and held until `close`; the engine writes into them in place.
        engine: ``"nixl"``, ``"mooncake"``, ``"jax-transfer"`` or ``"auto"``; must match the sender's.
        direction: default direction of `connect`: ``"push"`` (the sender WRITEs) or ``"pull"``
            (this rank READs).
        group: name of this decode DCP group (every rank of a group gives the same name).
        timeout_s: a request with no progress for this long FAILS (seconds). Progress is a part
            landing (a window written, read or unpacked), the move to TRANSFERRING, or a
            sender's report that an engine batch (push) or pull of the request is still in
            flight within the sender's bound (``moving``, protocol 10: the engine reports no
            progress inside a batch, and a batch may take longer than this): such a report
            counts as progress until its lease ends (the time left to that bound, at most this
            rank's ``peer_timeout_s``), and this clock runs from then. So a request whose one
            batch moves for longer than ``timeout_s`` ends SUCCESS here as on the sender; a
            batch past its bound is reported no more (the sender FAILS it and says so; should
            that word be lost, this rank FAILS it ``timeout_s`` after the last lease ended), and
            a sender gone silent is dropped after ``peer_timeout_s``. Reports are taken only for
            a live request of the same incarnation from a sender it was announced to; a
            malformed one is refused and counted (``stats["rejected_messages"]``) and changes nothing.
        peer_timeout_s: a sender silent for this long is dropped and its requests FAIL. Set at
            construction only (sent to the peers at hello; reassigning raises AttributeError),
            as is ``heartbeat_s``; ``timeout_s`` may be reassigned while it runs.
        heartbeat_s: ping interval (seconds).
        engine_options: keyword arguments for `bridge.make_engine`.
        host: this machine's address to use (an interface's IP): control connections are made
            from it and Mooncake listens on it (NIXL: set ``UCX_NET_DEVICES``). None: any
            interface for the control plane, loopback for Mooncake.
        region_bytes: size of the receive region this rank offers senders for the ``region``
            path (bytes; allocated once in the layers' memory, registered beside them, windows
            unpacked from it into the pages). None: `DEFAULT_REGION_BYTES` (64 MiB) for GPU
            layers (where every descriptor costs 4-7 us), none for host layers (give a size to
            offer one); 0: none (senders then take another path; ``mode="region"`` is refused
            at the handshake). GPU layers also offer CUDA IPC handles of themselves (``fused``).
        drain_grace_s: a push sender dropped as silent may resume and still write: its requests'
            pages (`is_drained`) and receive-region ranges stay held until it reconnects or this
            long passed (seconds, at most 86400; None: ``timeout_s + 2 * peer_timeout_s``, capped
            there; may be reassigned, checked on assignment).
        staging: ``"auto"`` (stage through host memory when the engine cannot register the KV's
            memory: `dcp_jax.transfer.staging.side_staged`), ``"none"`` or ``"host"`` (always).
            Staged, only the receive region is registered, in (pinned) host memory: windows land
            there and are copied into the device pages; senders then take the ``region`` path.
            ``region_bytes`` None then means `DEFAULT_REGION_BYTES`; 0 is refused.

    Attributes:
        staged: True when this side stages (its KV is not registered).

    Raises:
        TypeError, ValueError: bad spec, layers or options (``region_bytes`` above 0 but under
            one token's ``spec.row_bytes``: no window would fit, or above `MAX_BUFFER_BYTES`;
            a ``host`` no socket of this machine can bind to).
        MemoryError: the receive region of ``region_bytes`` could not be allocated (names it;
            nothing is left open).
        bridge.BridgeError: the engine could not start or register (nothing is left open).
    """

    timeout_s = CheckedSeconds()  # settable while it runs: checked on every assignment
    peer_timeout_s = FixedSeconds()  # sent to the peers at hello: set once, here
    heartbeat_s = FixedSeconds()
    spec = SetOnce()  # the handshake and every request's checks rest on these: set once, here
    direction = SetOnce()
    group = SetOnce()
    host = SetOnce()
    staged = SetOnce()
    drain_grace_s = CheckedSeconds()

    def __init__(self, spec: KVCacheSpec, kv_layers: Sequence[Any], *, engine: str = "nixl",
                 direction: str = "push", group: str = "default", timeout_s: float = 30.0,
                 peer_timeout_s: float = 5.0, heartbeat_s: float = DEFAULT_HEARTBEAT_S, engine_options: dict | None = None,
                 host: str | None = None, region_bytes: int | None = None,
                 drain_grace_s: float | None = None, staging: str = "auto"):
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} must be one of {DIRECTIONS}")
        if not isinstance(group, str):
            raise ValueError(f"group={group!r} must be a non-empty str of at most 256 UTF-8 bytes")
        check_request_id(group, "group")  # the same rule: non-empty, at most 256 UTF-8 bytes
        if host is not None and (not isinstance(host, str) or not 0 < len(host) <= 255 or any(c in host for c in ":;/ ")):
            raise ValueError(f"host={host!r} must be None or an IPv4 address / host name of this machine")
        if host is not None:
            check_local_host(host)
        self.spec, self.direction, self.group, self.host = spec, direction, group, host
        self.timeout_s = timeout_s  # checked (`CheckedSeconds`), here and on any later assignment
        self.peer_timeout_s = peer_timeout_s  # checked (`FixedSeconds`): set once, here
        self.heartbeat_s = heartbeat_s
        check_liveness(self.heartbeat_s, self.peer_timeout_s)
        # checked (`CheckedSeconds`, at most a day; the default capped there too)
        self.drain_grace_s = min(self.timeout_s + 2 * self.peer_timeout_s, 86400.0) if drain_grace_s is None \
            else drain_grace_s
        if region_bytes is not None and not 0 <= check_int_type("region_bytes", region_bytes) <= MAX_BUFFER_BYTES:
            raise ValueError(f"region_bytes={region_bytes!r} must be None or an int in [0, 2**62] (bytes)")
        self._layers = CacheLayers(spec, kv_layers, writable=True)
        self._layout = SideLayout.of(spec)
        name = f"dcp-recv-{spec.dcp_rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.engine = make_side_engine(engine, name, host, engine_options)
        try:
            self.staged = side_staged(staging, self.engine.kind, self._layers.mem_type)
            if region_bytes is None:
                region_bytes = max(DEFAULT_REGION_BYTES, spec.row_bytes) if self._layers.mem_type == "VRAM" \
                    or self.staged else 0
            if self.staged and region_bytes < spec.row_bytes:
                raise ValueError(f"region_bytes={region_bytes} is less than one token's {spec.row_bytes} bytes: a "
                                 "staged receiver lands every window in its receive region")
            if 0 < region_bytes < spec.row_bytes:  # it could hold no window: say so, not offer none
                raise ValueError(f"region_bytes={region_bytes} is less than one token's {spec.row_bytes} bytes: no "
                                 "window would fit (0 offers no receive region)")
            try:
                self._region = ReceiveRegion(int(region_bytes),
                                             self._layers.mem_type, self._layers.device_id, staged=self.staged)
            except (MemoryError, OSError) as exc:  # the allocator's own words do not say which buffer
                raise MemoryError(f"region_bytes={int(region_bytes):,}: cannot allocate the receive region "
                                  f"({type(exc).__name__}: {exc})") from exc
            self._ipc = [] if self.staged else ipc_export(self._layers)  # once: every connection offers the same
            extra = [self._region.memory_region()] if self._region.nbytes else []
            # Staged: the engine never sees the KV, only the (host) receive region.
            self.engine.register(([] if self.staged else list(self._layers.regions)) + extra)
        except BaseException:
            self.engine.close()
            raise
        self._lock = threading.RLock()
        self._closed = False
        self._links: list[Link] = []
        self._last_drop: str | None = None  # why the last link was dropped (`expect`'s message)
        self._by_peer: dict[str, Link] = {}
        self._outbox: deque[tuple[Link, bytes]] = deque()
        self._requests: dict[str, RecvRequest] = {}
        self._page_owner: dict[int, str] = {}  # page -> id of the held request that writes into it
        self._released: dict[tuple, Any] = {}  # (id, inc) -> a released request whose pages an engine may still write
        self._reads: dict[int, tuple] = {}  # handle seq -> (request, link, msg, handle)
        self._chunk_rows: dict[tuple, np.ndarray] = {}
        self._doubt: dict[str, tuple] = {}  # dropped push sender's peer -> (when, link): may still write
        self._counts = dict(dropped_messages=0, rejected_notifications=0, inconsistent_messages=0,
                            requests=0, succeeded=0, failed=0, aborted=0, bytes=0, reads=0, unpacks=0)
        self._init_region_state()
        self._last_ping = self._next_timeout_check = 0.0
        self._worker = Worker(f"dcp-receiver-{spec.dcp_rank}", self._round, None, spin_fn=self._spin_ready)
        self._worker.start()
        close_at_exit(self)

    # ---- public API --------------------------------------------------------------------------
    def connect(self, address: str, *, direction: str | None = None, timeout_s: float = 10.0) -> None:
        """Connects to a prefill `KVSender` and performs the versioned handshake.

        Both specs and the protocol version cross; the sender checks them against its own and
        against the ranks of this group already connected, this side checks the sender's.

        Args:
            address: the sender's `KVSender.address` (``"tcp://host:port"``).
            direction: ``"push"`` or ``"pull"`` for this connection (default: the receiver's).
            timeout_s: how long to wait for the sender's answer (seconds).

        Raises:
            HandshakeError: a field differs or the geometry cannot be served (names the field
                and both values); field ``"position"``: a live connected sender already holds the
                sender's prefill (dcp_rank, tp_rank); or, from the sender, another receiver of
                this group that still pings holds this rank's (dcp_rank, tp_rank) (the sender
                waits two of that receiver's ping intervals for it to say bye or fall silent
                before refusing); field ``"peer"``: the sender's engine metadata is not valid.
                Nothing was registered with the peer.
            TimeoutError: no answer within ``timeout_s``.
            ValueError: malformed address, unknown direction, or already connected there.
        """
        self._check_open()
        direction = self.direction if direction is None else direction
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} must be one of {DIRECTIONS}")
        timeout_s = check_seconds("timeout_s", timeout_s)
        with self._lock:
            if any(link.client.address == address for link in self._links):
                raise ValueError(f"address={address!r} is already connected")
        link = self._handshake(address, direction, timeout_s)
        with self._lock:
            self._links.append(link)
            self._by_peer[link.peer] = link
        self._worker.wake()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVReceiver is closed")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the worker, fails live requests, closes the engine and sockets, releases the
        registrations; returns within ``timeout_s`` (+ a small margin). Idempotent.

        A push sender's WRITEs already handed to its engine may still land after this returns
        (closing this side's engine does not stop them: measured with NIXL over loopback). So a
        request that was live at the close stays not `is_drained` until ``drain_grace_s`` after
        it, and the receive region is freed only then (a daemon timer keeps it).

        Raises:
            TypeError, ValueError: ``timeout_s`` is not a number of seconds in (0, 86400] (also
                on a closed receiver: the argument is checked before anything else).
        """
        check_seconds("timeout_s", timeout_s)
        if self._closed:
            return
        shut_down(self, timeout_s, "receiver", self._close_links, flush=self._flush)
        self._close_unpacker()  # before the region and the pages it holds go
        with self._lock:
            doubt = any(not self._drained(r) for r in [*self._requests.values(), *self._released.values()])
        if doubt:  # a late WRITE into freed memory would corrupt this process: free it after the grace
            timer = threading.Timer(self.drain_grace_s, self._region.close)
            timer.daemon = True
            try:
                timer.start()
            except RuntimeError:  # interpreter exit (no thread starts): the region lives until the end
                pass
        else:
            self._region.close()
        self._layers.close()

    def _close_links(self) -> None:
        torn = self.engine.torn_down
        if torn:  # this side's reads are over: nothing of them lands any more
            for req, *_ in self._reads.values():
                req.inflight -= 1
            self._reads.clear()
        now = time.monotonic()
        for link in self._links:  # after the "failed" frames of the live requests
            self._say_bye(link, "receiver closed", drained=torn)
            link.close_flag()
            if link.direction == "push":  # its WRITEs may still land: in doubt for drain_grace_s
                self._doubt.setdefault(link.peer, (now, link))
        self._links.clear()  # stats say 0 connections once closed
        self._by_peer.clear()

    def __enter__(self) -> "KVReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVReceiver(dcp_rank={self.spec.dcp_rank}, engine={self.engine.kind!r}, "
                f"requests={len(self._requests)}, connections={len(self._links)}{', closed' if self._closed else ''})")
