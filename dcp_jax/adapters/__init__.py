"""Adapters that plug the connector (`dcp_jax.transfer`) into serving stacks.

- ``dcp_jax.adapters.vllm``: `DcpJaxConnector`, a vLLM ``KVConnectorBase_V1`` (vLLM 0.32,
  CPU backend), loaded with ``--kv-transfer-config '{"kv_connector": "DcpJaxConnector",
  "kv_connector_module_path": "dcp_jax.adapters.vllm", "kv_role": "kv_producer"}'``.

Adapters are clients of the library's public API (``KVSender`` / ``KVReceiver``); the library
never imports them.
"""
