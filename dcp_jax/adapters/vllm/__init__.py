"""dcp-jax as a vLLM KV connector (vLLM 0.32, CPU backend): `DcpJaxConnector`.

    --kv-transfer-config '{"kv_connector": "DcpJaxConnector",
                           "kv_connector_module_path": "dcp_jax.adapters.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"engine": "nixl", "direction": "pull"}}'

Modules: `connector` (the class vLLM loads), `scheduler` (P/D contract), `worker` (the caches
under a `KVSender` / `KVReceiver`), `geometry` (vLLM's CPU cache layout as layer entries, the
geometry check), `config` (``kv_connector_extra_config``).
"""
from dcp_jax.adapters.vllm.connector import DcpJaxConnector
from dcp_jax.adapters.vllm.geometry import ADAPTER_VERSION, Geometry, PeerMismatch

__all__ = ["DcpJaxConnector", "ADAPTER_VERSION", "Geometry", "PeerMismatch"]
