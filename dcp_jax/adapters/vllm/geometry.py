"""vLLM's CPU KV cache as the connector's layer entries, and the geometry both sides declare.

vLLM 0.32's CPU attention backend (``vllm/v1/attention/backends/cpu_attn.py``, layout
``LBHNC``) gives every attention layer one tensor ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` and reads it as ``view(num_blocks, num_kv_heads, 2 * block_size, head_size)``
chunked on dim 2: inside a block, head ``h`` holds ``block_size`` K rows, then ``block_size``
V rows, each ``head_size`` elements. So a token's K and V are ``2 * num_kv_heads`` separate
rows of the block, ``block_size * head_size`` elements apart.

Two ways to hand that memory to a `KVSender` / `KVReceiver` without a copy (`Geometry.rows`):

- ``"block"``: one layer entry per layer, ``[num_blocks, block_size, block_bytes / block_size]``.
  A "row" is then a slice of the block, not a token, so transfers always move whole blocks
  (`Geometry.transfer_tokens` rounds up): right whenever whole blocks land whole, i.e. decode
  DCP 1, or a decode interleave that is a multiple of the block size. One descriptor per run of
  consecutive blocks per layer.
- ``"token"``: ``2 * num_kv_heads`` entries per layer (K and V of each head), entry ``j = 2*h +
  kv`` a view of the layer's bytes from offset ``j * block_size * head_size * itemsize``, with
  ``2 * num_kv_heads`` entry pages per block: block ``b`` is page ``2 * num_kv_heads * b`` of
  every entry (`Geometry.page_table`). Rows are real token rows, so a token interleave
  (decode ``dcp_size > 1``, ``cp_kv_cache_interleave_size`` < block size) routes each token to
  its owner rank (`dcp_jax.layout`) through the connector's pack.

Both sides put `Geometry.to_dict` into ``kv_transfer_params``; `check_peer` refuses a peer of
another adapter version, protocol version or geometry at the first request, naming the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dcp_jax.transfer import PROTOCOL_VERSION, KVCacheSpec

__all__ = ["ADAPTER_VERSION", "ROWS", "LAYOUT", "Geometry", "PeerMismatch", "cache_entries",
           "geometry_of", "check_peer"]

#: version of what this adapter puts into ``kv_transfer_params`` (bumped on any change there)
ADAPTER_VERSION = 1
ROWS = ("block", "token")
LAYOUT = "vllm-cpu-LBHNC"
#: fields two sides must agree on (``dcp_size`` / ``interleave_size`` may differ: the plan maps them)
_MATCH = ("rows", "block_size", "num_layers", "num_kv_heads", "head_size", "dtype", "kv_head_shards")


class PeerMismatch(ValueError):
    """The peer's ``kv_transfer_params`` cannot be served: another adapter or protocol version,
    another geometry, or no dcp-jax fields at all. ``field``, ``ours``, ``theirs`` name it."""

    def __init__(self, field: str, ours: Any, theirs: Any, detail: str = ""):
        self.field, self.ours, self.theirs = field, ours, theirs
        msg = (f"dcp-jax vLLM connector: the prefill peer's {field} differs (this engine {ours!r}, "
               f"peer {theirs!r})")
        super().__init__(msg + (f": {detail}" if detail else ""))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The KV cache one vLLM worker holds, as the adapter moves it.

    Attributes:
        num_layers: attention layers (vLLM's per-layer tensors).
        num_kv_heads: KV heads per layer on this worker.
        head_size: elements per head row.
        dtype: torch dtype name (``"bfloat16"``); itemsize: its bytes.
        block_size: tokens per vLLM block (the connector's page_size).
        rows: ``"block"`` or ``"token"`` (module docstring).
        dcp_size, interleave_size: this side's DCP group and ``cp_kv_cache_interleave_size``.
        kv_head_shards: how many ways the KV heads are split (``tp_size // dcp_size``); both
            sides must hold the same heads per worker.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    itemsize: int
    block_size: int
    rows: str = "block"
    dcp_size: int = 1
    interleave_size: int = 1
    kv_head_shards: int = 1

    def __post_init__(self) -> None:
        if self.rows not in ROWS:
            raise ValueError(f"rows={self.rows!r} must be one of {ROWS}")
        for name in ("num_layers", "num_kv_heads", "head_size", "itemsize", "block_size",
                     "dcp_size", "interleave_size", "kv_head_shards"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.rows == "block" and self.dcp_size > 1 and self.interleave_size % self.block_size:
            raise ValueError(
                f"rows='block' moves whole blocks, but decode dcp_size={self.dcp_size} with "
                f"interleave_size={self.interleave_size} splits a block of {self.block_size} tokens "
                "over ranks; set kv_connector_extra_config rows='token' (on both engines)")

    @property
    def entries_per_layer(self) -> int:
        return 1 if self.rows == "block" else 2 * self.num_kv_heads

    @property
    def item_len(self) -> int:
        """Bytes of one row of one entry."""
        head_row = self.head_size * self.itemsize
        return 2 * self.num_kv_heads * head_row if self.rows == "block" else head_row

    @property
    def page_factor(self) -> int:
        """Entry pages per vLLM block: block ``b`` is page ``page_factor * b`` of every entry."""
        return self.entries_per_layer

    def spec(self, dcp_rank: int = 0, shard_rank: int = 0) -> KVCacheSpec:
        """The connector's `KVCacheSpec` for this worker (``dcp_rank`` in its DCP group).

        In ``"block"`` rows with DCP 1 the interleave is declared as one block (the same
        ownership: every token on rank 0), so the sender moves pages directly. Each KV-head
        shard (``shard_rank`` of ``kv_head_shards``) is a connector group of its own (its own
        sender port and receiver group, `DcpJaxWorker`): a worker's rows hold only its shard's
        heads, and both sides shard alike (`check_peer`), so the spec declares no TP and whole
        rows move shard to shard. (Declared as ``tp_size=kv_head_shards`` it asked the connector
        to pair heads, which a custom layout label cannot: every TP > DCP handshake failed.)
        """
        if not 0 <= shard_rank < self.kv_head_shards:
            raise ValueError(f"shard_rank={shard_rank} must be in [0, kv_head_shards={self.kv_head_shards})")
        n = self.num_layers * self.entries_per_layer
        inter = self.interleave_size
        if self.dcp_size == 1:
            inter = self.block_size if self.rows == "block" else 1
        return KVCacheSpec(n, [self.item_len] * n, self.block_size, dcp_size=self.dcp_size,
                           dcp_rank=dcp_rank, interleave_size=inter, dtype=self.dtype,
                           layout=f"{LAYOUT}/{self.rows}")

    def transfer_tokens(self, num_tokens: int) -> int:
        """Tokens the transfer covers: ``num_tokens`` rounded up to whole blocks in ``"block"`` rows
        (the tail of the last block is the prefill's scratch; the decode overwrites it)."""
        if self.rows == "token":
            return int(num_tokens)
        return -(-int(num_tokens) // self.block_size) * self.block_size

    def page_table(self, block_ids) -> np.ndarray:
        """i64 connector page table of a request from its vLLM block ids (local order)."""
        return np.asarray(list(block_ids), np.int64) * self.page_factor

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def geometry_of(kv_cache_config: Any, *, rows: str, dcp_size: int, interleave_size: int,
                kv_head_shards: int) -> Geometry:
    """The `Geometry` of a vLLM ``KVCacheConfig`` (its attention groups).

    Raises:
        ValueError: a group that is not plain attention (Mamba, MLA, ...), or layers of
            different head counts, sizes or dtypes: this adapter moves one uniform attention cache.
    """
    layers, shapes = 0, set()
    for g in kv_cache_config.kv_cache_groups:
        s = g.kv_cache_spec
        kind = type(s).__name__
        if kind not in ("FullAttentionSpec", "AttentionSpec") or getattr(s, "head_size_v", s.head_size) != s.head_size:
            raise ValueError(f"KV cache group of {kind} (layers {list(g.layer_names)[:3]}...): the dcp-jax "
                             "vLLM adapter moves full-attention caches only")
        shapes.add((s.block_size, s.num_kv_heads, s.head_size, s.dtype))
        layers += len(g.layer_names)
    if len(shapes) != 1 or layers == 0:
        raise ValueError(f"attention layers of different geometries {sorted(map(str, shapes))}: "
                         "one uniform cache is supported")
    bs, heads, head, dtype = shapes.pop()
    return Geometry(layers, int(heads), int(head), str(dtype).removeprefix("torch."), dtype.itemsize,
                    int(bs), rows, dcp_size, interleave_size, kv_head_shards)


def cache_entries(kv_caches: list[Any], geom: Geometry) -> list[np.ndarray]:
    """numpy views (no copy) of vLLM's per-layer CPU tensors as the connector's layer entries.

    Args:
        kv_caches: ``geom.num_layers`` torch CPU tensors ``[num_blocks, num_kv_heads,
            block_size, 2 * head_size]`` (vLLM's order of layers).
        geom: this worker's geometry.

    Returns:
        ``num_layers * entries_per_layer`` uint8 arrays ``[pages, block_size, item_len]``
        sharing the tensors' memory (layer-major; in ``"token"`` rows entry ``2*h + kv``).

    Raises:
        ValueError, TypeError: a tensor of another shape, dtype, device or not contiguous
            (the message names the layer and the layout expected).
    """
    import torch

    if len(kv_caches) != geom.num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} layers, the KV cache config {geom.num_layers}")
    want = (geom.num_kv_heads, geom.block_size, 2 * geom.head_size)
    out: list[np.ndarray] = []
    for l, t in enumerate(kv_caches):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"kv_caches[{l}] must be a CPU torch.Tensor (vLLM's CPU backend), got "
                            f"{type(t).__name__} on {getattr(t, 'device', '?')}")
        if t.dim() != 4 or tuple(t.shape[1:]) != want or not t.is_contiguous():
            raise ValueError(f"kv_caches[{l}] has shape {tuple(t.shape)} (contiguous={t.is_contiguous()}); "
                             f"expected the CPU backend's [num_blocks, num_kv_heads, block_size, "
                             f"2 * head_size] = [*, {want[0]}, {want[1]}, {want[2]}]")
        if str(t.dtype).removeprefix("torch.") != geom.dtype:
            raise ValueError(f"kv_caches[{l}] has dtype {t.dtype}, the KV cache config {geom.dtype}")
        flat = t.view(torch.uint8).reshape(-1).numpy()
        if flat.ctypes.data != t.data_ptr():
            raise RuntimeError(f"kv_caches[{l}]: the numpy view copied the tensor")
        nb = int(t.shape[0])
        if geom.rows == "block":
            out.append(flat.reshape(nb, geom.block_size, geom.item_len))
            continue
        f, chunk = geom.page_factor, geom.block_size * geom.item_len
        for j in range(f):  # K/V of head h is chunk 2h / 2h+1 of every block
            out.append(flat[j * chunk:].reshape(nb * f - j, geom.block_size, geom.item_len))
    return out


def check_peer(ours: Geometry, info: Any) -> dict[str, Any]:
    """Checks the ``dcp_jax`` entry of a prefill's ``kv_transfer_params`` against this side.

    Returns:
        The entry (``addresses``, ``num_tokens``, ...).

    Raises:
        PeerMismatch: missing entry (the prefill is not a DcpJaxConnector), another adapter or
            protocol version, an unsupported peer cache, or a geometry field that differs.
    """
    if not isinstance(info, dict):
        raise PeerMismatch("connector", "DcpJaxConnector", None,
                           "kv_transfer_params carry no 'dcp_jax' entry; is the prefill engine a DcpJaxConnector?")
    if info.get("adapter_version") != ADAPTER_VERSION:
        raise PeerMismatch("adapter_version", ADAPTER_VERSION, info.get("adapter_version"))
    if info.get("protocol_version") != PROTOCOL_VERSION:
        raise PeerMismatch("protocol_version", PROTOCOL_VERSION, info.get("protocol_version"))
    theirs = info.get("geometry")
    if not isinstance(theirs, dict):
        raise PeerMismatch("geometry", ours.to_dict(), None, str(info.get("unsupported", "")))
    for field in _MATCH:
        if theirs.get(field) != getattr(ours, field):
            raise PeerMismatch(field, getattr(ours, field), theirs.get(field))
    addrs = info.get("addresses")
    if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) for a in addrs):
        raise PeerMismatch("addresses", "a list of tcp://host:port", addrs)
    n = info.get("num_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # (True is an int to isinstance)
        raise PeerMismatch("num_tokens", "an int >= 0", info.get("num_tokens"))
    return info
