"""The embeddable KV transfer connector (prefill `KVSender`, decode `KVReceiver`)."""
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec, check_compatible
from dcp_jax.transfer.status import LEGAL_TRANSITIONS, IllegalTransition, RequestState, TransferStatus

__all__ = [
    "HandshakeError",
    "IllegalTransition",
    "KVCacheSpec",
    "LEGAL_TRANSITIONS",
    "RequestState",
    "TransferStatus",
    "check_compatible",
]
