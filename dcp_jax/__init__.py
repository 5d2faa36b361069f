"""dcp-jax: move and merge the KV cache of long-context LLM serving under decode context parallelism.

Modules (import what you need; the package import itself stays light):

- ``dcp_jax.layout``: token ownership ``owner / local_index / local_len / count``.
- ``dcp_jax.plan``: transfer plans, runs and descriptors (prefill DCP-M -> decode DCP-N).
- ``dcp_jax.packing``: pack buffer size and per-rank regions.
- ``dcp_jax.cost``: descriptor / engine-call / byte report per destination rank.
- ``dcp_jax.merge``: exact LSE merge of partial attention (and the ``ag_rs`` / ``ag_ar`` / ``a2a`` forms).
- ``dcp_jax.attention``: DCP decode attention (MLA absorbed form, GQA).
- ``dcp_jax.crosscheck``: compare the merge against a PyTorch reference.
- ``dcp_jax.transfer``: the KV transfer connector (``KVSender``, ``KVReceiver``).
- ``dcp_jax.job``: the main job behind ``dcp-jax transfer``, built on the connector.
"""

__version__ = "0.1.0"
