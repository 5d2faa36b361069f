"""The embeddable KV transfer connector: a prefill `KVSender` and one `KVReceiver` per decode rank.

    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus

    sender = KVSender(KVCacheSpec(61, [1152] * 61, page_size=64), prefill_kv_layers)
    recv = KVReceiver(KVCacheSpec(61, [1152] * 61, 64, dcp_size=8, dcp_rank=r), decode_kv_layers)
    recv.connect(sender.address)                       # versioned handshake, both specs checked
    recv.expect("req-1", decode_page_table, num_tokens=32768)
    sender.send("req-1", prefill_page_table, 0, 32768)  # once per chunk; returns at once
    while recv.poll("req-1") is TransferStatus.WAITING or ...: ...

The caller owns its paged KV cache (numpy, JAX or CuPy arrays) and its scheduler; the connector
owns planning, packing, transfer, completion and failure reporting. See `KVSender`,
`KVReceiver`, and ``docs/conventions.md`` section 10 for the page-table conventions.
"""
from dcp_jax.transfer.protocol import PROTOCOL_VERSION, ProtocolError
from dcp_jax.transfer.receiver import KVReceiver
from dcp_jax.transfer.sender import KVSender
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec, check_compatible
from dcp_jax.transfer.status import LEGAL_TRANSITIONS, IllegalTransition, RequestState, TransferStatus

__all__ = [
    "HandshakeError",
    "IllegalTransition",
    "KVCacheSpec",
    "KVReceiver",
    "KVSender",
    "LEGAL_TRANSITIONS",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "RequestState",
    "TransferStatus",
    "check_compatible",
]
