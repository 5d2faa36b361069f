"""The main job behind ``dcp-jax transfer``: a demo on top of the connector (`dcp_jax.transfer`).

- ``config``: `JobConfig` (with its failure-injection hooks) and the device check;
- ``kv``: the demo KV: ownership by brute force, page tables, pool and pack sizes, buffers;
- ``processes``: spawning the job's processes, their control pipes, stopping them;
- ``workers``: inside them: prefill ranks holding a `KVSender`, decode ranks holding a `KVReceiver`;
- ``run``: `run_job`, the orchestration of one request per mode and its report.

Nothing in ``dcp_jax.transfer``, ``bridge`` or ``pallas_kernels`` imports this package.
"""
from dcp_jax.job.config import DEVICES, ENGINES, MODES, JobConfig, check_device
from dcp_jax.job.kv import check_host_memory, estimate_host_bytes, request_page_tables
from dcp_jax.job.run import run_job

__all__ = ["DEVICES", "ENGINES", "MODES", "JobConfig", "check_device", "check_host_memory",
           "estimate_host_bytes", "request_page_tables", "run_job"]
