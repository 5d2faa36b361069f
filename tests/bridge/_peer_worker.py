"""Process entry points for the bridge tests (started with multiprocessing "spawn").

`target_main` is a decode-side peer: it registers a zeroed buffer, publishes its PeerInfo over
a Pipe, and answers commands. `initiator_kill_scenario` runs the prefill side of the
"peer killed mid-transfer" test in its own process, so an engine crash could not take pytest
down with it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import numpy as np

# Engine environment before any engine library loads (spawned children start from scratch).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def available_kinds() -> list[str]:
    """Engine kinds that import here (NIXL first)."""
    from bridge import available_engines

    return list(available_engines())


def target_main(conn, kind: str, name: str, nbytes: int, env: dict | None = None) -> None:
    """Decode-side peer (`env` is applied before the engine loads). Commands (tuples) over `conn`:

    ("wait", sender, tag, timeout_s) -> ("ok", bytes of the buffer) once the notification came,
        or ("err", message);
    ("info",) -> PeerInfo; ("close",) -> closes and exits.
    """
    os.environ.update(env or {})
    from bridge import make_engine

    buf = np.zeros(nbytes, dtype=np.uint8)
    with make_engine(kind, name) as eng:
        eng.register([buf])
        conn.send(eng.peer_info())
        while True:
            cmd = conn.recv()
            if cmd[0] == "wait":
                _, sender, tag, timeout_s = cmd
                try:
                    eng.wait_notification(sender, tag, timeout_s)
                    conn.send(("ok", buf.tobytes()))
                except Exception as exc:  # report, the test asserts on it
                    conn.send(("err", f"{type(exc).__name__}: {exc}"))
            elif cmd[0] == "info":
                conn.send(eng.peer_info())
            elif cmd[0] == "close":
                break
    conn.close()


def scattered_descs(src_addr: int, dst_addr: int, n: int, item: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n descriptors of `item` bytes: source rows in order, destination rows a random permutation.

    Returns (descs i64[n, 3], src_rows i64[n], dst_rows i64[n]).
    """
    rng = np.random.default_rng(seed)
    src_rows = np.arange(n, dtype=np.int64)
    dst_rows = rng.permutation(n).astype(np.int64)
    descs = np.stack([src_addr + src_rows * item, dst_addr + dst_rows * item,
                      np.full(n, item, dtype=np.int64)], axis=1)
    return descs, src_rows, dst_rows


def many_small(src: np.ndarray, dst: np.ndarray, n: int, seed: int, item: int = 64) -> np.ndarray:
    """i64[n, 3] descriptors of `item` bytes from random rows of the u8 array ``src`` to random
    rows of ``dst`` (as many rows as ``src``), drawn with replacement: many small entries, one batch."""
    rng = np.random.default_rng(seed)
    rows = src.size // item
    return np.stack([src.ctypes.data + rng.integers(0, rows, n) * item,
                     dst.ctypes.data + rng.integers(0, rows, n) * item,
                     np.full(n, item)], axis=1).astype(np.int64)


def initiator_kill_scenario(conn, kind: str, victim_info, victim_pid: int, live_info,
                            n: int, item: int, timeout_s: float, env: dict | None = None,
                            kill_after_s: float | None = 0.05) -> None:
    """Prefill side: one big batch to `victim`, SIGKILL it mid-batch, then serve `live`.

    ``kill_after_s``: the kill comes from a timer thread that long after the batch starts, so it
    lands while the engine is posting or moving the batch whether `transfer_batch` returns at
    once or not. None: the connection is made first (a 64-byte write), then the kill follows
    `transfer_batch` at once, once `check` sees the batch still moving: for a few large blocks,
    which a fast loopback moves within any fixed delay. Sends back a dict: what the batch
    raised (at submit or at wait) and after how long, whether the next batch to the dead peer
    failed, outstanding handles, and the bytes the live peer must hold.
    """
    out: dict = {}
    try:
        os.environ.update(env or {})
        from bridge import BridgeError, TransferError, make_engine

        src = np.random.default_rng(7).integers(0, 256, n * item, dtype=np.uint8)
        with make_engine(kind, "initiator") as eng:
            eng.register([src])
            victim = eng.add_peer(victim_info)
            live = eng.add_peer(live_info)
            descs, _, _ = scattered_descs(src.ctypes.data, victim_info.regions[0].addr, n, item, seed=1)
            if kill_after_s is None:  # connected first: the kill lands in the batch's bytes, not in wireup
                warm = np.array([[src.ctypes.data, victim_info.regions[0].addr, 64]], dtype=np.int64)
                eng.wait(eng.transfer_batch(victim, warm), timeout_s=timeout_s)
            killer = (None if kill_after_s is None
                      else threading.Timer(kill_after_s, os.kill, (victim_pid, signal.SIGKILL)))
            t0 = time.monotonic()
            if killer is not None:
                killer.start()
            try:
                h = eng.transfer_batch(victim, descs, dcp_rank=3, chunk=0)
                if killer is None:
                    try:
                        out["moving_at_kill"] = not eng.check(h)  # True also releases h: no wait then
                    finally:
                        os.kill(victim_pid, signal.SIGKILL)
                        out["kill_seconds"] = time.monotonic() - t0
                if out.get("moving_at_kill", True):
                    eng.wait(h, timeout_s=timeout_s)
                out["inflight_error"] = None
            except TransferError as exc:
                out["inflight_error"] = (type(exc).__name__, exc.peer, exc.dcp_rank, exc.chunk, str(exc))
            out["inflight_seconds"] = time.monotonic() - t0
            if killer is not None:
                killer.join()
            # The dead peer again: must fail (at submit or at wait) within the timeout, never hang.
            t0 = time.monotonic()
            try:
                h2 = eng.transfer_batch(victim, descs[:64])
                eng.wait(h2, timeout_s=timeout_s)
                out["second_error"] = None
            except BridgeError as exc:
                out["second_error"] = (type(exc).__name__, str(exc))
            out["second_seconds"] = time.monotonic() - t0
            out["outstanding"] = eng.outstanding
            eng.remove_peer(victim)
            # The remaining rank is served normally.
            m = 4096
            lsrc = src[: m * 64]
            descs, src_rows, dst_rows = scattered_descs(lsrc.ctypes.data, live_info.regions[0].addr, m, 64, seed=2)
            h3 = eng.transfer_batch(live, descs, notif=b"live-0")
            eng.wait(h3, timeout_s=timeout_s)
            expect = np.zeros(live_info.regions[0].nbytes, dtype=np.uint8)
            expect.reshape(-1, 64)[dst_rows] = lsrc.reshape(-1, 64)[src_rows]
            out["live_expected"] = expect.tobytes()
            out["outstanding_after"] = eng.outstanding
    except BaseException:  # report everything to the test instead of dying silently
        out["exception"] = traceback.format_exc()
    conn.send(out)
    conn.close()


def initiator_stopped_peer_scenario(conn, kind: str, info, pid: int, n: int, item: int,
                                    env: dict | None = None) -> None:
    """Prefill side of "the peer hangs": SIGSTOP the peer, start a batch that cannot finish, then
    `check`, `remove_peer` and `close(timeout_s=1)`. Sends a dict back; after the test replies
    (it has SIGKILLed the peer), waits for the background teardown and sends a second dict."""
    out: dict = {}
    try:
        os.environ.update(env or {})
        from bridge import make_engine, registered_bytes

        src = np.full(n * item, 3, dtype=np.uint8)
        eng = make_engine(kind, "initiator")
        eng.register([src])
        peer = eng.add_peer(info)
        rows = np.arange(n, dtype=np.int64)
        descs = np.stack([src.ctypes.data + rows * item, info.regions[0].addr + rows * item,
                          np.full(n, item, dtype=np.int64)], axis=1)
        warm = np.array([[src.ctypes.data, info.regions[0].addr, 64]], dtype=np.int64)
        eng.wait(eng.transfer_batch(peer, warm), timeout_s=20)  # connected before the peer stops
        os.kill(pid, signal.SIGSTOP)
        h = eng.transfer_batch(peer, descs)
        time.sleep(0.5)
        out["check_while_stopped"] = eng.check(h)
        eng.remove_peer(peer)
        time.sleep(0.3)
        out["check_after_remove"] = eng.check(h)  # the engine may still be using the memory
        t0 = time.monotonic()
        eng.close(timeout_s=1.0)
        out["close_seconds"] = time.monotonic() - t0
        out["teardown_running"] = eng._closer.is_alive()
        out["registered_after_close"] = registered_bytes()
        out["handle_released"] = h.released
    except BaseException:
        out["exception"] = traceback.format_exc()
    conn.send(out)
    if "exception" in out:
        return
    conn.recv()  # the peer is dead now
    eng._closer.join(30)
    conn.send({"teardown_running_after_kill": eng._closer.is_alive()})
    conn.close()


def spawn_target(kind: str, name: str, nbytes: int, env: dict | None = None):
    """Starts `target_main` in a spawned process; returns (process, conn, PeerInfo)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, kind, name, nbytes, env))
    proc.start()
    child.close()
    if not parent.poll(25):
        proc.kill()
        raise RuntimeError(f"target {name} did not publish its PeerInfo")
    return proc, parent, parent.recv()


def stop_target(proc, conn) -> None:
    try:
        conn.send(("close",))
    except (BrokenPipeError, OSError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


#: rows per test buffer and bytes per row (MLA bf16 row: 576 x 2 B)
ROWS = 2048
ITEM = 1152


class Pair:
    """An initiator and a target engine of one kind, connected, each with one registered buffer."""

    def __init__(self, kind: str):
        from bridge import make_engine

        self.kind = kind
        self.ini = make_engine(kind, f"{kind}-ini")
        self.tgt = make_engine(kind, f"{kind}-tgt")
        self.src = np.zeros(ROWS * ITEM, dtype=np.uint8)
        self.dst = np.zeros(ROWS * ITEM, dtype=np.uint8)
        self.ini.register([self.src])
        self.tgt.register([self.dst])
        self.peer = self.ini.add_peer(self.tgt.peer_info())

    def fill(self, seed: int) -> None:
        """Fresh random source bytes, zeroed destination, drained notifications, zero counters."""
        rng = np.random.default_rng(seed)
        self.src[:] = rng.integers(0, 256, self.src.size, dtype=np.uint8)
        self.dst[:] = 0
        self.tgt.notifications()
        self.ini.reset_counters()

    def close(self) -> None:
        self.ini.close()
        self.tgt.close()
