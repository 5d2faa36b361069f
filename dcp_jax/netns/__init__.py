"""Test harness (not part of the library): hosts as network namespaces on one machine.

`Hosts` builds two or three namespaces joined by veth links, runs processes inside them and
removes everything on exit; `dcp_jax.netns.peers` holds the process mains of the two-host tests
and of ``dcp-jax load --netns``. The library (`dcp_jax.transfer`, `bridge`) never imports this.
"""
from dcp_jax.netns.hosts import ENGINE_ENV, PREFIX, Hosts, enter_netns, needs_root_reason, remove_stale, run_in

__all__ = ["Hosts", "needs_root_reason", "remove_stale", "enter_netns", "run_in", "PREFIX", "ENGINE_ENV"]
