"""Process entry points for the GPU bridge tests (started with multiprocessing "spawn": CUDA
state must not be forked).

`ipc_exporter` owns device arrays (CuPy pool views at offsets, a `DeviceBuffer`, a JAX array),
exports their CUDA IPC handles and reports their bytes after the peer wrote them.
`mooncake_target` owns VRAM registered with a Mooncake engine (`nvlink_intra`) and reports its
bytes once a notification arrives.
"""
from __future__ import annotations

import os
import traceback

import numpy as np

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

#: Geometry shared with the tests: (name, shape, dtype) of the exported arrays, in order.
IPC_ARRAYS = (
    ("view", (65536,), np.uint8),       # CuPy: bytes [4096, 69632) of a 1 MiB pool allocation
    ("tail", (1000,), np.uint8),        # CuPy: bytes [200000, 201000) of the same allocation
    ("u16", (64, 576), np.uint16),      # CuPy: its own allocation
    ("dbuf", (3 << 20,), np.uint8),     # bridge.buffers.DeviceBuffer
)
#: The JAX array, exported on its own: XLA's buffers are VMM memory, refused by legacy IPC.
JAX_ARRAY = ("jax", (128, 1152), np.uint8)
BIG_BYTES = 1 << 20
VIEW_AT, TAIL_AT = 4096, 200_000


def initial_arrays(seed: int = 5) -> dict[str, np.ndarray]:
    """The host bytes the exporter starts from (the big allocation and every exported array)."""
    rng = np.random.default_rng(seed)
    out = {"big": rng.integers(0, 256, BIG_BYTES, dtype=np.uint8)}
    for name, shape, dt in IPC_ARRAYS[2:] + (JAX_ARRAY,):
        out[name] = rng.integers(0, np.iinfo(dt).max + 1, shape, dtype=dt)
    out["view"] = out["big"][VIEW_AT:VIEW_AT + 65536].copy()
    out["tail"] = out["big"][TAIL_AT:TAIL_AT + 1000].copy()
    return out


def ipc_exporter(conn, env: dict | None = None) -> None:
    """Commands over `conn`: ("dump",) -> ("dump", {name: host bytes}) read back from the device;
    ("exit",). First sends ("handles", [IpcHandle dicts of IPC_ARRAYS], JAX array's dict or the
    IpcError text) or ("error", traceback). `env` is applied before JAX loads."""
    for k, v in (env or {}).items():  # "" removes the variable
        if v:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    try:
        import cupy as cp
        import jax

        from bridge.buffers import DeviceBuffer
        from bridge.cuda_ipc import IpcError, export_ipc_handles

        init = initial_arrays()
        big = cp.asarray(init["big"])
        view, tail = big[VIEW_AT:VIEW_AT + 65536], big[TAIL_AT:TAIL_AT + 1000]
        u16 = cp.asarray(init["u16"])
        dbuf = DeviceBuffer(3 << 20)
        dbuf.array[:] = cp.asarray(init["dbuf"])
        gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
        jx = jax.device_put(init["jax"], gpu)
        jx.block_until_ready()
        cp.cuda.runtime.deviceSynchronize()
        handles = export_ipc_handles([view, tail, u16, dbuf])
        try:
            jax_handle = export_ipc_handles([jx])[0].to_dict()
        except IpcError as e:
            jax_handle = f"IpcError: {e}"
        conn.send(("handles", [h.to_dict() for h in handles], jax_handle))
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd = conn.recv()
        if cmd[0] == "dump":
            cp.cuda.runtime.deviceSynchronize()
            # The JAX array through DLPack (np.asarray would cache the first read).
            jbytes = cp.asnumpy(cp.from_dlpack(jx))
            conn.send(("dump", {"big": cp.asnumpy(big), "u16": cp.asnumpy(u16), "dbuf": cp.asnumpy(dbuf.array),
                                "jax": jbytes}))
        else:
            conn.send(("bye",))
            return


def mooncake_target(conn, nbytes: int, at: int) -> None:
    """Mooncake engine "mc-target" with VRAM bytes [at, at + nbytes) of a CuPy allocation of
    nbytes + 2 * at registered (so the region starts inside the allocation), filled with 0x5A.
    Sends ("info", PeerInfo dict, protocol) then answers ("wait", sender, tag, timeout_s) with
    ("bytes", whole allocation as host bytes) or ("error", traceback); ("exit",) closes."""
    try:
        import cupy as cp

        from bridge import MemoryRegion, make_engine

        whole = cp.full(nbytes + 2 * at, 0x5A, dtype=cp.uint8)
        cp.cuda.runtime.deviceSynchronize()
        eng = make_engine("mooncake", "mc-target")
        eng.register([MemoryRegion(int(whole.data.ptr) + at, nbytes, "VRAM", 0)])
        conn.send(("info", eng.peer_info().to_dict(), eng.protocol))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "wait":
                try:
                    eng.wait_notification(cmd[1], cmd[2], timeout_s=cmd[3])
                    cp.cuda.runtime.deviceSynchronize()
                    conn.send(("bytes", cp.asnumpy(whole)))
                except Exception:  # noqa: BLE001
                    conn.send(("error", traceback.format_exc()))
            elif cmd[0] == "info":
                conn.send(("info", eng.peer_info().to_dict(), eng.protocol))
            else:
                conn.send(("bye",))
                return
    finally:
        eng.close()


#: `flag_waiter`'s KV: layers of [rows, width] bytes (4 GiB: a copy of ~4 ms, past the 9.21 GB
#: job's per-rank share); row r of layer l holds (7 l + r) % 251.
FLAG_LAYERS, FLAG_ROWS, FLAG_WIDTH = 4, 262144, 4096


def flag_waiter(conn) -> None:
    """Owns `FLAG_LAYERS` zeroed CuPy layers, exports their IPC handles; on ("wait", flag name,
    seq, perm) maps the writer's flag page (once), spins until it reads seq, then checks at once
    that row i of layer l holds source row perm[i]'s bytes; answers ("checked", spins, bad rows)."""
    try:
        import cupy as cp

        from bridge.cuda_ipc import export_ipc_handles
        from bridge.host_flag import OpenedFlag

        layers = [cp.zeros((FLAG_ROWS, FLAG_WIDTH), cp.uint8) for _ in range(FLAG_LAYERS)]
        cp.cuda.runtime.deviceSynchronize()
        conn.send(("ready", [h.to_dict() for h in export_ipc_handles(layers)]))
        flags: dict = {}
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                for f in flags.values():
                    f.close()
                conn.send(("bye",))
                return
            _, name, seq, perm = msg
            flag = flags.get(name) or OpenedFlag(name)
            flags[name] = flag
            spins = 0
            while not flag.done(seq):
                spins += 1
            p = cp.asarray(perm)
            bad = 0
            for l, a in enumerate(layers):
                want = ((7 * l + p) % 251).astype(cp.uint8)[:, None]
                bad += int((a != want).any(axis=1).sum())
            for a in layers:
                a.fill(0)
            cp.cuda.runtime.deviceSynchronize()
            conn.send(("checked", spins, bad))
    except Exception:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
