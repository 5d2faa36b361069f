"""The adapter's settings, read once from vLLM's config (``kv_connector_extra_config``).

Keys of ``kv_connector_extra_config`` (all optional):

- ``engine``: ``"nixl"`` (default) or ``"mooncake"``; both engines of a pair must agree.
- ``direction``: ``"pull"`` (default, vLLM's: the decode READs) or ``"push"`` (the prefill WRITEs).
- ``rows``: ``"block"`` (default) or ``"token"`` (see `dcp_jax.adapters.vllm.geometry`); both
  engines must agree; ``"token"`` is needed for a decode DCP group with a token interleave.
- ``host``, ``port``: where the prefill's `KVSender` listens (default ``127.0.0.1``, 5710); the
  sender of KV-head shard ``s`` (a TP rank of the prefill) listens on ``port + s``.
- ``timeout_s``: a transfer with no progress for this long fails (default 30 s; a prefill
  request no decode ever announces frees its blocks after it); ``connect_timeout_s``: the
  decode's handshake with a prefill (default 5 s).
- ``mode``: the sender's ``"auto"`` (default), ``"packed"`` or ``"direct"``.
- ``dcp_rank``, ``tp_rank``: this worker's ranks when it runs outside vLLM's process groups
  (a test driving the worker hooks); by default read from vLLM's DCP and TP groups.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dcp_jax.adapters.vllm.geometry import ROWS, Geometry, geometry_of

__all__ = ["AdapterConfig", "ENGINES", "DIRECTIONS"]

ENGINES = ("nixl", "mooncake")
DIRECTIONS = ("pull", "push")
_KEYS = {"engine", "direction", "rows", "host", "port", "timeout_s", "connect_timeout_s", "mode",
         "dcp_rank", "tp_rank"}


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """Parsed settings (module docstring); ``role`` is vLLM's ``kv_role``."""

    role: str
    engine: str = "nixl"
    direction: str = "pull"
    rows: str = "block"
    host: str = "127.0.0.1"
    port: int = 5710
    timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    mode: str = "auto"
    tp_size: int = 1
    dcp_size: int = 1
    interleave_size: int = 1
    dcp_rank: int | None = None
    tp_rank: int | None = None

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "AdapterConfig":
        """Reads ``vllm_config.kv_transfer_config`` and ``parallel_config``.

        Raises:
            ValueError: an unknown key or a bad value (named).
        """
        kt = vllm_config.kv_transfer_config
        extra = dict(kt.kv_connector_extra_config or {})
        unknown = set(extra) - _KEYS
        if unknown:
            raise ValueError(f"kv_connector_extra_config has unknown keys {sorted(unknown)} "
                             f"(known: {sorted(_KEYS)})")
        pc = vllm_config.parallel_config
        cfg = cls(role=str(kt.kv_role), tp_size=int(pc.tensor_parallel_size),
                  dcp_size=int(getattr(pc, "decode_context_parallel_size", 1) or 1),
                  interleave_size=int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1), **extra)
        cfg._check()
        return cfg

    def _check(self) -> None:
        for name, allowed in (("engine", ENGINES), ("direction", DIRECTIONS), ("rows", ROWS),
                              ("mode", ("auto", "packed", "direct"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"kv_connector_extra_config {name}={getattr(self, name)!r} must be one of {allowed}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"kv_connector_extra_config host={self.host!r} must be a non-empty str")
        if self.tp_size % self.dcp_size:
            raise ValueError(f"tensor_parallel_size={self.tp_size} is not a multiple of "
                             f"decode_context_parallel_size={self.dcp_size}")
        last = 65535 - (self.tp_size // self.dcp_size - 1)  # one port per KV-head shard: port + shard
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port <= last:
            raise ValueError(f"kv_connector_extra_config port={self.port!r} must be an int in 1..{last} "
                             f"(the senders listen on port .. port + {self.tp_size // self.dcp_size - 1})")
        for name in ("timeout_s", "connect_timeout_s"):
            v = getattr(self, name)  # the connector's own bound (`check_seconds`): (0, 86400]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise ValueError(f"kv_connector_extra_config {name}={v!r} must be a number of seconds in (0, 86400]")
        for name in ("dcp_rank", "tp_rank"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"kv_connector_extra_config {name}={v!r} must be an int >= 0")

    @property
    def kv_head_shards(self) -> int:
        """Ways the KV heads are split: vLLM's DCP reuses the TP ranks, ``tp // dcp`` groups."""
        return self.tp_size // self.dcp_size

    def geometry(self, kv_cache_config: Any) -> Geometry:
        """This engine's `Geometry` (raises ValueError for caches the adapter cannot move)."""
        return geometry_of(kv_cache_config, rows=self.rows, dcp_size=self.dcp_size,
                           interleave_size=self.interleave_size, kv_head_shards=self.kv_head_shards)

    def addresses(self) -> list[str]:
        """Control-plane addresses of this (prefill) engine's senders, one per KV-head shard."""
        return [f"tcp://{self.host}:{self.port + s}" for s in range(self.kv_head_shards)]
