"""A transfer server over `jax.experimental.transfer` (what tpu-inference and sglang-jax use for P/D).

`JaxTransferServer` is the raw engine: whole JAX arrays, moved only by pull. The bridge engine
`bridge.jax_engine.JaxTransferEngine` (``make_engine("jax-transfer", ...)``) puts registered
memory and descriptor batches on top of it; this module is what it calls:

1. each process starts one transfer server (`JaxTransferServer`);
2. the prefill side stages a rank's pack (`offer`): the arrays are copied into `staging`
   memory (`pinned_host` by default) and scheduled with `await_pull(uuid, arrays)`;
3. the decode rank learns (uuid, shapes, the owner's address) over the connector's control
   plane and `pull`s them with a bounded wait; the arrays land in its device memory;
4. the decode rank reports completion on the control plane, and the owner `release`s the
   offer (its staged copies are dropped).

Staging: sglang-jax documents that staging bf16 arrays in *unpinned* host memory corrupts their
strides in this engine, so the default is `pinned_host` (tests/bridge/test_jax_transfer.py
checks bf16 byte for byte through each staging kind). Measured here (CPU, jax 0.11.2): pulls
into `pinned_host` specs fail at the puller ("Memory kind mismatch with xla::PjRtBuffers"), so
`pull` always lands in device memory.

Limits (jax 0.11.2): no per-offer cancel, so an offer that is never pulled holds its staged copy
until `release` or `close` (the owner's connector times requests out and releases them); and a
pull's own timeout does not end a pull whose offer never comes, so `pull` polls the arrays'
readiness against its deadline and raises `TransferTimeout`, leaving that pull pending inside
JAX (its buffers stay allocated until the process ends: a known leak per timed-out pull).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from bridge.errors import PeerError, TransferError, TransferTimeout

KIND = "jax-transfer"
STAGINGS = ("pinned_host", "unpinned_host", "device")
MAX_UUID = 2**63 - 1
_POLL_FIRST_S = 1e-4  # a pull's arrays are polled with this backoff (seconds), capped below
_POLL_MAX_S = 5e-3


class _Stopped(Exception):
    """`pull`'s should_stop asked to stop waiting."""


def _check_uuid(uuid) -> int:
    if (isinstance(uuid, bool) or not isinstance(uuid, (int, np.integer))
            or not 0 <= uuid <= MAX_UUID):
        raise ValueError(f"{uuid=} must be an int in [0, 2**63 - 1]")
    return int(uuid)


def _deadline(timeout_s: float) -> datetime.datetime:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"{timeout_s=} must be a positive number of seconds")
    return datetime.datetime.now() + datetime.timedelta(seconds=float(timeout_s))


class JaxTransferServer:
    """One process's `jax.experimental.transfer` server: offers arrays and pulls peers' offers.

    Args:
        name: this engine's name (copied into errors and `peer_info`).
        device: the JAX device whose client serves transfers (default `jax.devices()[0]`).
        address: where the server listens ("host:port"; port 0 picks one).
        transport_addresses: the bulk-transport sockets (same form).
        staging: memory kind offers are copied into ("pinned_host", "unpinned_host", "device").

    Raises:
        ValueError: unknown `staging`, empty `name`.
        TransferError: the server did not start (the JAX message is included).
    """

    kind = KIND

    def __init__(self, name: str, *, device=None, address: str = "127.0.0.1:0",
                 transport_addresses: Sequence[str] = ("127.0.0.1:0",),
                 staging: str = "pinned_host"):
        from jax.experimental import transfer

        if not isinstance(name, str) or not name:
            raise ValueError(f"{name=} must be a non-empty str")
        if staging not in STAGINGS:
            raise ValueError(f"{staging=} must be one of {STAGINGS}")
        self.name, self.staging = name, staging
        self.device = jax.devices()[0] if device is None else device
        try:
            self._server = transfer.start_transfer_server(
                self.device.client, address, list(transport_addresses))
        except Exception as e:  # the C++ layer raises XlaRuntimeError/ValueError variants
            raise TransferError("jax transfer server did not start", peer=name,
                                num_descriptors=0, engine_message=str(e)) from e
        self._lock = threading.Lock()
        self._offers: dict[int, list[jax.Array]] = {}
        self._connections: dict[str, object] = {}
        self._closed = False

    # ---- identity -------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The address peers `pull` from ("host:port")."""
        self._check_open()
        return self._server.address()

    def peer_info(self) -> dict:
        """What a puller needs, as plain types (send it over the control plane)."""
        return {"engine": KIND, "name": self.name, "address": self.address}

    @staticmethod
    def peer_address(info: dict) -> str:
        """The address in a peer's `peer_info` dict, checked (never trust a peer's message).

        Raises:
            PeerError: not a dict of this engine kind with a "host:port" str address.
        """
        if not isinstance(info, dict) or info.get("engine") != KIND:
            raise PeerError(f"info: not a {KIND!r} peer_info dict: {info!r:.200}")
        addr = info.get("address")
        if not isinstance(addr, str) or ":" not in addr or len(addr) > 300:
            raise PeerError(f"info: address {addr!r:.100} must be a 'host:port' str")
        return addr

    # ---- the owner's side ---------------------------------------------------------------
    def offer(self, uuid: int, arrays: Sequence, *, copy: bool = True) -> list[jax.ShapeDtypeStruct]:
        """Stage `arrays` and schedule them to be pulled once under `uuid`.

        Args:
            uuid: the offer's id, unique among this engine's live offers (the connector derives
                it from request, rank and chunk), int in [0, 2**63 - 1].
            arrays: non-empty sequence of JAX or numpy arrays (numpy ones are put on the
                device first). Copied into `staging` memory; the caller may reuse its buffers
                as soon as this returns.
            copy: False when the caller hands over fresh numpy arrays it never touches again
                (the engine's own gather buffers): they are staged without a defensive copy.

        Returns:
            The specs (shape, dtype) the puller passes to `pull`.

        Raises:
            ValueError: bad `uuid` or a uuid already offered and not released; empty `arrays`.
            TypeError: an element is not an array.
        """
        self._check_open()
        uuid = _check_uuid(uuid)
        if not isinstance(arrays, (list, tuple)) or not arrays:
            raise ValueError("arrays must be a non-empty list of arrays")
        sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.staging)
        staged = []
        for i, a in enumerate(arrays):
            if not isinstance(a, (np.ndarray, jax.Array)):
                raise TypeError(f"arrays[{i}] must be a numpy or JAX array, got {type(a).__name__}")
            # The offer must own its bytes (the caller reuses its pack buffer): on CPU,
            # device_put of an aligned numpy array aliases it even with may_alias=False
            # (caught by the tests), so numpy is copied first; a JAX array put into its own
            # memory kind may come back as the same buffer, and is copied then.
            if isinstance(a, np.ndarray) and copy:
                a = np.array(a, copy=True)
            s = jax.device_put(a, sharding)
            if isinstance(a, jax.Array) and s.unsafe_buffer_pointer() == a.unsafe_buffer_pointer():
                s = jax.device_put(jax.numpy.copy(a), sharding)
            staged.append(s)
        with self._lock:
            if uuid in self._offers:
                raise ValueError(f"{uuid=} is already offered (release it first)")
            self._offers[uuid] = staged
        jax.block_until_ready(staged)
        self._server.await_pull(uuid, staged)
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in staged]

    def release(self, uuid: int) -> bool:
        """Drop an offer's staged copies (after the puller reported completion). True if it
        was live."""
        with self._lock:
            return self._offers.pop(_check_uuid(uuid), None) is not None

    @property
    def live_offers(self) -> int:
        """Offers staged and not released."""
        return len(self._offers)

    # ---- the puller's side --------------------------------------------------------------
    def pull(self, address: str, uuid: int, specs: Sequence, *, timeout_s: float = 30.0,
             peer: str = "", should_stop: Callable[[], str | None] | None = None) -> list[jax.Array]:
        """Pull offer `uuid` of the engine at `address` into this device's memory.

        Args:
            address: the owner's `address` (from its `peer_info`, via `peer_address`).
            uuid: the offer's id.
            specs: (shape, dtype) of each array, as `offer` returned them (ShapeDtypeStructs
                or pairs); must match the offer.
            timeout_s: bound on the whole pull (connect included), seconds.
            peer: the owner's name, copied into errors.
            should_stop: polled while waiting; a non-None answer (the reason) ends the wait
                with `TransferError` (the pull itself stays pending inside JAX, as on timeout).

        Returns:
            The arrays, on `device` (memory kind "device").

        Raises:
            TransferTimeout: the offer did not arrive within `timeout_s`.
            TransferError: the pull failed (the JAX message is included).
            ValueError: bad `uuid`, `timeout_s` or `specs`.
        """
        self._check_open()
        uuid = _check_uuid(uuid)
        deadline = _deadline(timeout_s)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        if not isinstance(specs, (list, tuple)) or not specs:
            raise ValueError("specs must be a non-empty list of (shape, dtype)")
        avals = []
        for i, s in enumerate(specs):
            shape, dtype = (s.shape, s.dtype) if hasattr(s, "shape") else s
            if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
                raise ValueError(f"specs[{i}] shape {shape} must be non-negative ints")
            avals.append(jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding))
        with self._lock:
            conn = self._connections.get(address)
        try:
            if conn is None:
                conn = self._server.connect(address)
                with self._lock:
                    self._connections[address] = conn
            out = conn.pull(uuid, avals, timeout=deadline)
            # The pull returns futures at once, and (jax 0.11.2) its timeout does not end a
            # pull whose offer never comes: block_until_ready would wait forever. Poll instead.
            pause = _POLL_FIRST_S
            while not all(a.is_ready() for a in out):
                if datetime.datetime.now() >= deadline:
                    raise TimeoutError("DEADLINE: arrays not ready")
                reason = should_stop() if should_stop is not None else None
                if reason is not None:
                    raise _Stopped(reason)
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
            jax.block_until_ready(out)  # ready: raises the pull's error, if any
        except _Stopped as e:
            raise TransferError(f"pull of offer {uuid} stopped", peer=peer or address,
                                num_descriptors=len(avals), engine_message=str(e)) from None
        except Exception as e:
            msg = str(e)
            if datetime.datetime.now() >= deadline or "DEADLINE" in msg.upper():
                raise TransferTimeout(f"pull of offer {uuid} timed out after {timeout_s} s",
                                      peer=peer or address, num_descriptors=len(avals),
                                      engine_message=msg) from e
            raise TransferError(f"pull of offer {uuid} failed", peer=peer or address,
                                num_descriptors=len(avals), engine_message=msg) from e
        return list(out)

    # ---- lifetime -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.name!r} is closed")

    def close(self) -> None:
        """Drop every offer and connection (idempotent). The server itself ends with the
        process: jax 0.11 has no call that stops it."""
        with self._lock:
            self._offers.clear()
            self._connections.clear()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.live_offers} offers"
        return f"JaxTransferServer({self.name!r}, staging={self.staging!r}, {state})"


__all__ = ["KIND", "STAGINGS", "JaxTransferServer"]
