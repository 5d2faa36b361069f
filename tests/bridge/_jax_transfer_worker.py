"""Owner process for tests/bridge/test_jax_transfer.py (started with multiprocessing "spawn").

Commands over the Pipe: ("offer", uuid, staging, case) -> ("ok", address, specs) after staging
`case_arrays(case)` under `uuid`; ("release", uuid) -> ("ok", was_live); ("close",) -> exits.
"""
from __future__ import annotations

import traceback

import numpy as np


def case_arrays(case: str) -> list:
    """The arrays of a test case, as numpy (bf16 as ml_dtypes), the same in both processes.

    bf16 bit patterns are kept NaN-free (XLA on CPU canonicalises NaNs)."""
    import ml_dtypes

    rng = np.random.default_rng(len(case) * 7919)  # str hash differs per process

    def bf16(shape):
        bits = rng.integers(0, 2**16, shape, dtype=np.uint16)
        return ((bits & 0xBFFF) | 0x2000).astype(np.uint16).view(ml_dtypes.bfloat16)

    if case == "mla-bf16":  # DeepSeek-V3 MLA rows: 576 bf16 per token
        return [bf16((1000, 576))]
    if case == "gqa-interleaved-bf16":  # tpu-inference's [tokens, 2*kv_heads, head_dim]
        return [bf16((257, 16, 128))]
    if case == "mla-sliced-from-640-bf16":  # 576 lanes sliced out of a 640-lane padded row
        return [np.ascontiguousarray(bf16((333, 640))[:, :576])]
    if case == "pack-u8":  # a rank's pack region of odd length plus a bf16 entry
        return [rng.integers(0, 256, (4 << 20) + 3, dtype=np.uint8), bf16((7, 3))]
    raise ValueError(f"unknown {case=}")


def owner_main(conn) -> None:
    from bridge.jax_transfer import JaxTransferServer

    engines: dict[str, JaxTransferServer] = {}
    while True:
        cmd = conn.recv()
        try:
            if cmd[0] == "close":
                for e in engines.values():
                    e.close()
                conn.send(("ok",))
                return
            if cmd[0] == "offer":
                _, uuid, staging, case = cmd
                if staging not in engines:
                    engines[staging] = JaxTransferServer(f"owner-{staging}", staging=staging)
                eng = engines[staging]
                specs = eng.offer(uuid, case_arrays(case))
                conn.send(("ok", eng.address, [(s.shape, str(s.dtype)) for s in specs]))
            elif cmd[0] == "release":
                conn.send(("ok", any(e.release(cmd[1]) for e in engines.values())))
            else:
                conn.send(("err", f"unknown command {cmd[0]!r}"))
        except Exception:  # report, keep serving
            conn.send(("err", traceback.format_exc()))
