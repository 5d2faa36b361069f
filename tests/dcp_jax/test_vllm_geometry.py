"""The vLLM adapter's connector spec, without vLLM (the package's __init__ imports it): a worker of
one KV-head shard pairs with the same shard's worker on the other side (TP > DCP: each shard is a
group of its own; declared as TP it was refused at every handshake)."""
import importlib.util
import sys
from pathlib import Path

import pytest

from dcp_jax.transfer import KVCacheSpec
from dcp_jax.transfer.spec import check_compatible

_PATH = Path(__file__).resolve().parents[2] / "dcp_jax" / "adapters" / "vllm" / "geometry.py"
_SPEC = importlib.util.spec_from_file_location("_vllm_geometry", _PATH)
geometry = sys.modules["_vllm_geometry"] = importlib.util.module_from_spec(_SPEC)  # (dataclasses look it up)
_SPEC.loader.exec_module(geometry)


@pytest.mark.parametrize("rows", ["block", "token"])
def test_each_kv_head_shard_pairs_with_its_own(rows):
    prefill = geometry.Geometry(2, 2, 64, "bfloat16", 2, 16, rows, kv_head_shards=2)
    decode = geometry.Geometry(2, 2, 64, "bfloat16", 2, 16, rows, dcp_size=2, interleave_size=16, kv_head_shards=2)
    for shard in range(2):
        p = prefill.spec(0, shard)
        assert isinstance(p, KVCacheSpec) and p.tp_size == 1
        for r in range(2):
            check_compatible(p, decode.spec(r, shard), side="decode")  # whole rows, no head pairing
    with pytest.raises(ValueError, match="shard_rank=2"):
        prefill.spec(0, 2)
