"""``dcp-jax generate``: a tiny DeepSeek-style model served disaggregated, checked token for token.

One prefill process per prefill DCP rank (a `KVSender` over its pages), one decode process per
decode DCP rank (a `KVReceiver`; the ranks merge partial attention through ``jax.distributed``
collectives), and a single-process reference. `GenerateConfig` (config.py), `run_generate`
(run.py), the processes (workers.py), the typer command (cli.py). Imports no JAX at import time.
"""
from dcp_jax.generate.config import GenerateConfig

__all__ = ["GenerateConfig"]
