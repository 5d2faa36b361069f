"""``dcp-jax load``: a load generator for the KV connector (`dcp_jax.transfer`).

One `KVSender` process and ``--dcp-size`` `KVReceiver` processes move random requests (random
lengths, page tables and chunking, up to ``--concurrency`` in flight, a fraction aborted on
purpose) through the public connector API only; every completed request is verified byte for
byte on every rank and every page outside a live request must keep the sentinel. See
`dcp_jax.loadgen.report` for what each reported figure means.
"""
from dcp_jax.loadgen.config import LoadConfig, plan_requests
from dcp_jax.loadgen.command import load_command
from dcp_jax.loadgen.run import run_load

__all__ = ["LoadConfig", "load_command", "plan_requests", "run_load"]
