"""Transfer-engine adapters (NIXL, Mooncake, jax.experimental.transfer) behind one small protocol,
plus registered buffers.

    from bridge import make_engine, MemoryRegion
    with make_engine("nixl", "prefill") as eng:
        eng.register([MemoryRegion(addr, nbytes)])
        send(eng.peer_info())                       # out of band, e.g. a multiprocessing Pipe
        peer = eng.add_peer(received_peer_info)
        h = eng.transfer_batch(peer, descs, notif=b"chunk0")   # descs: i64[n, 3]; op="READ" pulls
        while not eng.check(h):                     # non-blocking; or eng.wait(h, timeout_s=30.0)
            do_other_work()

See `bridge.base` for the protocol (check / cancel / close semantics), `bridge.errors` for the
errors, `bridge.regions` for regions, `PeerInfo` (and its plain-dict form) and descriptor
validation.
"""
from __future__ import annotations

from typing import Any

from bridge.base import (
    BridgeError,
    DescriptorError,
    EngineCounters,
    MemoryRegion,
    PeerError,
    PeerInfo,
    RegistrationError,
    TransferEngine,
    TransferError,
    TransferHandle,
    TransferTimeout,
    as_region,
    registered_bytes,
    validate_descriptors,
)

__all__ = [
    "BridgeError",
    "DescriptorError",
    "EngineCounters",
    "MemoryRegion",
    "PeerError",
    "PeerInfo",
    "RegistrationError",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferTimeout",
    "ENGINE_KINDS",
    "as_region",
    "available_engines",
    "make_engine",
    "registered_bytes",
    "validate_descriptors",
]

#: Values accepted by `make_engine(kind=...)`. "auto" picks among the descriptor engines (NIXL,
#: Mooncake) only; "jax-transfer" (`bridge.jax_engine`) is chosen by name.
ENGINE_KINDS = ("nixl", "mooncake", "jax-transfer", "auto")


def available_engines() -> tuple[str, ...]:
    """Engine kinds whose Python package imports here, in preference order ("nixl" first)."""
    out = []
    from bridge.nixl import nixl_available

    if nixl_available():
        out.append("nixl")
    from bridge.mooncake import mooncake_available

    if mooncake_available():
        out.append("mooncake")
    return tuple(out)


def make_engine(kind: str, name: str, **kw: Any) -> TransferEngine:
    """Creates a transfer engine of the given kind.

    Args:
        kind: "nixl", "mooncake", "jax-transfer" (jax.experimental.transfer, every batch a pull,
            host memory), or "auto" (NIXL if it imports, else Mooncake).
        name: engine / agent name, unique among communicating engines.
        **kw: passed to the adapter (`NixlEngine(backends=...)`,
            `MooncakeEngine(hostname=..., protocol=...)`, `JaxTransferEngine(hostname=..., staging=...)`).

    Returns:
        A `NixlEngine`, `MooncakeEngine` or `JaxTransferEngine` (close it, or use it as a context
        manager).

    Raises:
        ValueError: unknown kind.
        BridgeError: the engine's package is missing or it failed to start.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine={kind!r} must be one of {ENGINE_KINDS}")
    if kind == "auto":
        avail = available_engines()
        if not avail:
            raise BridgeError("kind='auto': neither NIXL nor Mooncake imports in this environment")
        kind = avail[0]
    if kind == "jax-transfer":
        from bridge.jax_engine import JaxTransferEngine

        return JaxTransferEngine(name, **kw)
    if kind == "nixl":
        from bridge.nixl import NixlEngine

        return NixlEngine(name, **kw)
    from bridge.mooncake import MooncakeEngine

    return MooncakeEngine(name, **kw)
