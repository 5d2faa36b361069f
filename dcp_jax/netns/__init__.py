"""Test harness (not part of the library): hosts as network namespaces on one machine.

`Hosts` builds two or three namespaces joined by veth links, runs processes inside them and
removes everything on exit; `dcp_jax.netns.agents` holds the process main of the two-host tests
(``dcp-jax load --netns`` spawns `dcp_jax.loadgen.worker`'s, through `dcp_jax.loadgen.soak`). The
library (`dcp_jax.transfer`, `bridge`) never imports this.
"""
from dcp_jax.netns.hosts import ENGINE_ENV, PREFIX, Hosts, enter_netns, needs_root_reason, remove_stale, run_in

__all__ = ["Hosts", "needs_root_reason", "remove_stale", "enter_netns", "run_in", "PREFIX", "ENGINE_ENV"]
