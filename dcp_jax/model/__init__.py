"""A tiny DeepSeek-style model (MLA or GQA) with a jitted prefill and a DCP decode step.

`ModelConfig` / `init_params` (config.py), `prefill` / `prefill_logits` and the shared
projections (forward.py), `make_decode_step` over a DCP mesh (decode.py), and `place_prefill_kv`
(paging.py: the prefill's rows into per-rank pages, the oracle of the connector's placement).
"""
from dcp_jax.model.config import DTYPES, ModelConfig, init_params
from dcp_jax.model.decode import DecodeGeometry, global_caches, greedy_decode, make_decode_step, replicated
from dcp_jax.model.forward import PREFILL_CHUNK, prefill, prefill_logits

__all__ = ["DTYPES", "ModelConfig", "init_params", "DecodeGeometry", "global_caches", "greedy_decode",
           "make_decode_step", "replicated", "PREFILL_CHUNK", "prefill", "prefill_logits"]
