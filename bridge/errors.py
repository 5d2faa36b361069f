"""Typed errors of `bridge` (every one a `BridgeError`); re-exported by `bridge` and `bridge.base`."""
from __future__ import annotations

__all__ = [
    "BridgeError",
    "RegistrationError",
    "DescriptorError",
    "PeerError",
    "TransferError",
    "TransferTimeout",
]


class BridgeError(Exception):
    """Base class of every error raised by `bridge`."""


class RegistrationError(BridgeError):
    """A memory region could not be registered or deregistered (engine refusal, overlap, bad kind)."""


class DescriptorError(BridgeError, ValueError):
    """A descriptor batch is malformed or reaches outside registered memory; nothing was sent."""


class PeerError(BridgeError):
    """The peer is unknown to this engine, was removed, or its `PeerInfo` is unusable."""


class TransferError(BridgeError):
    """A submitted transfer failed; bytes of this batch may be missing at the peer.

    Attributes:
        peer: name of the destination peer.
        num_descriptors: descriptors in the failed batch.
        engine_message: the engine's own message or status code, verbatim.
        dcp_rank: decode rank the batch was for, when the caller said so.
        chunk: request chunk index the batch belonged to, when the caller said so.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str,
        num_descriptors: int,
        engine_message: str = "",
        dcp_rank: int | None = None,
        chunk: int | None = None,
    ):
        self.message = message
        self.peer = peer
        self.num_descriptors = int(num_descriptors)
        self.engine_message = engine_message
        self.dcp_rank = dcp_rank
        self.chunk = chunk
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [f"{self.message}: peer={self.peer!r}, num_descriptors={self.num_descriptors}"]
        if self.dcp_rank is not None:
            parts.append(f"dcp_rank={self.dcp_rank}")
        if self.chunk is not None:
            parts.append(f"chunk={self.chunk}")
        text = ", ".join(parts)
        if self.engine_message:
            text += f" (engine: {self.engine_message})"
        return text

    def __reduce__(self):  # keep keyword-only fields across pickling (errors cross process pipes)
        return (
            _rebuild_transfer_error,
            (type(self), self.message, self.peer, self.num_descriptors, self.engine_message,
             self.dcp_rank, self.chunk),
        )

    def with_context(self, *, dcp_rank: int | None = None, chunk: int | None = None) -> TransferError:
        """Returns a copy of this error with the decode rank and/or chunk filled in."""
        return type(self)(
            self.message,
            peer=self.peer,
            num_descriptors=self.num_descriptors,
            engine_message=self.engine_message,
            dcp_rank=self.dcp_rank if dcp_rank is None else dcp_rank,
            chunk=self.chunk if chunk is None else chunk,
        )


class TransferTimeout(TransferError):
    """A transfer (or an awaited notification) did not complete before its deadline."""


def _rebuild_transfer_error(cls, message, peer, num_descriptors, engine_message, dcp_rank, chunk):
    return cls(message, peer=peer, num_descriptors=num_descriptors, engine_message=engine_message,
               dcp_rank=dcp_rank, chunk=chunk)
