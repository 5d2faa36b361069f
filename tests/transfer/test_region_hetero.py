"""Issue 15 at the connector: what two sides may differ in, and what is refused (dtype).

Rows move as bytes, so both sides must agree on what the bytes are: the dtype is checked between
the sides at the handshake, with both names.
"""
import numpy as np
import pytest

from conftest import Cluster
from dcp_jax.transfer import KVCacheSpec, KVReceiver
from dcp_jax.transfer.spec import HandshakeError, check_compatible


def test_dtype_mismatch_names_both_dtypes():
    p = KVCacheSpec(1, [32], 4, dtype="bfloat16")
    d = KVCacheSpec(1, [32], 4, dtype="float8_e4m3fn")
    with pytest.raises(HandshakeError) as e:
        check_compatible(p, d)
    assert e.value.field == "dtype" and (e.value.ours, e.value.theirs) == ("bfloat16", "float8_e4m3fn")
    assert "'bfloat16'" in str(e.value) and "'float8_e4m3fn'" in str(e.value) and "never converts" in str(e.value)


def test_dtype_mismatch_is_refused_at_the_handshake(engine):
    c = Cluster(engine, dcp_size=1, connect=False)
    try:
        spec = KVCacheSpec(2, (48, 16), 4, dtype="float8_e4m3fn")
        with KVReceiver(spec, [np.zeros((4, 4, il), np.uint8) for il in (48, 16)], engine=engine) as recv:
            with pytest.raises(HandshakeError, match="never converts") as e:
                recv.connect(c.sender.address)
            assert (e.value.field, e.value.ours, e.value.theirs) == ("dtype", "float8_e4m3fn", "bfloat16")
    finally:
        c.close()
