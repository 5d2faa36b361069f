"""A JAX CPU receiver layer that the caller deletes after handing it over: the connector's view
keeps the memory (found by a fresh-user trial: the engines wrote into freed memory, both sides
said SUCCESS, and the process aborted at exit with "corrupted double-linked list")."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import sys
import numpy as np, jax.numpy as jnp
from bridge.engine_env import quiet_engines
quiet_engines()
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender

engine, how = sys.argv[1], sys.argv[2]
P = 16
spec = KVCacheSpec(1, [1152], P)
rng = np.random.default_rng()
src_np = rng.integers(0, 256, (8, P, 1152), dtype=np.uint8)
src = [jnp.asarray(src_np.view(np.uint16)).view(jnp.bfloat16)]
dst = [jnp.zeros((4, P, 576), jnp.bfloat16)]
with KVSender(spec, src, engine=engine, timeout_s=10) as snd, \
        KVReceiver(spec, dst, engine=engine, timeout_s=10) as rcv:
    rcv.connect(snd.address)
    if how == "delete":
        dst[0].delete()
    else:
        del dst[0]
    # New arrays that would take the freed memory: none may change.
    junk = [jnp.full((4, P, 576), 3, jnp.bfloat16) for _ in range(20)]
    rcv.expect("r", [0, 1], num_tokens=2 * P)
    snd.send("r", [5, 1], 0, 2 * P)
    print(rcv.wait("r", 10).name, snd.wait("r", 10).name)
    assert all(bool((j == 3).all()) for j in junk), "a new array was written"
    # What the engine wrote is the caller's rows 5 and 1 in the view the receiver keeps.
    got = np.asarray(rcv._layers.rows[0]).reshape(-1, P, 1152)[:2]
    assert (got == src_np[[5, 1]]).all(), "rows differ"
print("closed")
"""


@pytest.mark.parametrize("how", ["delete", "drop"])
def test_a_deleted_jax_cpu_layer_is_kept_until_close(engine, how):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SCRIPT, engine, how], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
    assert "SUCCESS SUCCESS" in res.stdout and "closed" in res.stdout, res.stdout


def test_a_layer_deleted_before_it_is_given_is_refused_naming_it():
    # Before: JAX's own "RuntimeError: Array has been deleted ..." with no layer named.
    import jax.numpy as jnp
    import numpy as np

    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender

    live = jnp.zeros((4, 16, 8), jnp.uint8)
    gone = jnp.zeros((4, 16, 8), jnp.uint8)
    gone.delete()
    for cls in (KVReceiver, KVSender):
        with pytest.raises(ValueError, match=r"kv_layers\[1\]: a deleted JAX array"):
            cls(KVCacheSpec(2, [8, 8], 16), [live, gone])
    assert (np.asarray(live) == 0).all()
