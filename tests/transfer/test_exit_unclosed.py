"""A process exiting while its never-closed sender and receivers are mid-transfer keeps its own
exit code: the atexit hooks close them, instead of engine threads being killed inside C++ calls
at finalisation (SIGABRT, "terminate called without an active exception")."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One sender, two decode ranks, 8,192 tokens over 8 layers of 1,152 B rows in direct mode: on
# loopback the transfer takes ~150 ms (NIXL) to ~3 s (Mooncake), so 10 ms after `send` it is
# still moving. The child checks that, then exits without closing anything.
CHILD = textwrap.dedent("""
    import gc, sys, time, weakref
    import numpy as np
    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender
    engine, how = sys.argv[1], sys.argv[2]
    L, PAGES, PS, ITEM, N = 8, 1024, 16, 1152, 8192
    src = [np.full((PAGES, PS, ITEM), l + 1, np.uint8) for l in range(L)]
    s = KVSender(KVCacheSpec(L, [ITEM] * L, PS), src, engine=engine, mode="direct")
    rs = []
    for r in range(2):
        dst = [np.zeros((PAGES, PS, ITEM), np.uint8) for _ in range(L)]
        rs.append(KVReceiver(KVCacheSpec(L, [ITEM] * L, PS, dcp_size=2, dcp_rank=r), dst, engine=engine))
        rs[-1].connect(s.address)
    # A side closed by hand and dropped is collectable: the exit hook holds it weakly.
    extra = KVReceiver(KVCacheSpec(L, [ITEM] * L, PS, dcp_size=2, dcp_rank=0),
                       [np.zeros((4, PS, ITEM), np.uint8) for _ in range(L)], engine=engine)
    extra.close()
    ref = weakref.ref(extra)
    del extra
    gc.collect()
    print("collected", ref() is None, flush=True)
    rs[0].expect("a", np.arange(256), N)
    rs[1].expect("a", np.arange(256) + 300, N)
    s.send("a", np.arange(512), 0, N)
    time.sleep(0.01)
    print("in flight", not s.poll("a").terminal, flush=True)
    if how == "raise":
        raise RuntimeError("user bug")
    rs[1].close()  # one side closed already: the hook must skip it
    sys.exit(0)
""")


@pytest.mark.parametrize("how, code", [("raise", 1), ("exit0", 0)])
def test_exit_mid_transfer_without_close_keeps_exit_code(engine, tmp_path, how, code):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script), engine, how], capture_output=True, text=True,
                       env=env, timeout=120)
    assert "terminate called" not in p.stderr, p.stderr[-3000:]
    # The exit hook closes each side as close() does (it used to fail: no thread starts in an
    # atexit hook on Python >= 3.12, and the engine close ran on one).
    assert "at interpreter exit failed" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "collected True" in p.stdout, p.stdout
    assert "in flight True" in p.stdout, p.stdout  # else the exit did not race the transfer
    if how == "raise":
        assert "RuntimeError: user bug" in p.stderr
