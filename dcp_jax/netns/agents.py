"""Connector sides as processes on a `Hosts` host, driven over a pipe: the two-host tests' peers.

`Agent` starts one process (`agent_main`) in a host's namespace and calls it like an object:
``agent.call("send", rid, table, 0, 64)`` runs the command there and returns its result (or
raises `AgentError` with the remote traceback, or `TimeoutError`). Roles:

* ``sender``: a `KVSender` over ``pages`` pages of random KV drawn from ``seed`` (`source_kv`),
  bound to ``host`` (control plane and Mooncake; UCX through the host's ``UCX_NET_DEVICES``).
* ``receiver``: a `KVReceiver` whose layers are the first ``pages`` pages of larger arrays: the
  ``guard`` pages after them are never registered and, like every page, start as `SENTINEL`, so
  a write outside the registered cache or outside a request's pages shows (`sentinel_ok`).
* ``attacker``: no connector; raw control frames, raw TCP bytes and a handshake of its own
  (`dcp_jax.netns.hostile`).

Every process records the connector's log lines of WARNING and above (``logs`` returns them):
the tests check that each refusal was logged with its reason. Only our own processes are on the
other end of the pipe (multiprocessing pickles; nothing from the network is unpickled).
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import numpy as np

__all__ = ["Agent", "AgentError", "agent_main", "source_kv", "SENTINEL"]

SENTINEL = 0xA5


class AgentError(RuntimeError):
    """A command raised in the agent process (the message holds its traceback)."""


def source_kv(seed: int, item_lens, pages: int, page_size: int) -> list[np.ndarray]:
    """The sender's KV: layer ``l`` is ``uint8[pages, page_size, item_lens[l]]`` from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (pages, page_size, il), dtype=np.uint8) for il in item_lens]


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 10_000:
            self.lines.append(f"{record.name}: {record.getMessage()}")


class _SenderSide:
    def __init__(self, engine, host, item_lens, page_size, pages=64, seed=1, port=0, **kw):
        from dcp_jax.transfer import KVCacheSpec, KVSender

        self.item_lens, self.page_size, self.seed = tuple(item_lens), page_size, seed
        spec = KVCacheSpec(len(item_lens), list(item_lens), page_size)
        self.kv = source_kv(seed, item_lens, pages, page_size)
        self.obj = KVSender(spec, self.kv, engine=engine, host=host, port=port, **kw)

    def hello(self):
        return self.obj.address

    def send(self, rid, table, start, stop):
        self.obj.send(rid, np.asarray(table, np.int64), start, stop)


class _ReceiverSide:
    def __init__(self, engine, host, item_lens, page_size, pages=64, guard=8, dcp_size=1, dcp_rank=0,
                 interleave_size=1, group="default", **kw):
        from dcp_jax.transfer import KVCacheSpec, KVReceiver

        self.item_lens, self.page_size, self.pages = tuple(item_lens), page_size, pages
        self.n, self.rank, self.interleave = dcp_size, dcp_rank, interleave_size
        spec = KVCacheSpec(len(item_lens), list(item_lens), page_size, dcp_size, dcp_rank, interleave_size)
        self.full = [np.full((pages + guard, page_size, il), SENTINEL, np.uint8) for il in item_lens]
        self.kv = [a[:pages] for a in self.full]  # registered; the guard pages after them are not
        self.obj = KVReceiver(spec, self.kv, engine=engine, host=host, group=group, **kw)

    def hello(self):
        return None

    def expect(self, rid, table, num_tokens, prefix_tokens=0):
        self.obj.expect(rid, np.asarray(table, np.int64), num_tokens, prefix_tokens)

    def check(self, rid_table, src_table, num_tokens, src_seed, src_pages, prefix_tokens=0):
        """Rows of this rank of tokens [prefix, num_tokens) equal the sender's bytes; returns
        the number of (token, layer) rows compared. Token ownership computed here, token by token."""
        src = source_kv(src_seed, self.item_lens, src_pages, self.page_size)
        p, n, i = self.page_size, self.n, self.interleave
        t = np.arange(prefix_tokens, num_tokens, dtype=np.int64)
        t = t[(t // i) % n == self.rank]
        j = (t // (i * n)) * i + t % i
        dtab, stab = np.asarray(rid_table, np.int64), np.asarray(src_table, np.int64)
        bad = 0
        for l in range(len(self.item_lens)):
            got = self.kv[l][dtab[j // p], j % p]
            want = src[l][stab[t // p], t % p]
            bad += int((got != want).any(axis=1).sum())
        return dict(rows=int(len(t)), bad_rows=bad)

    def sentinel_ok(self, used_pages=()):
        """True when every page outside ``used_pages`` (the guard pages included) holds only the
        sentinel."""
        used = set(int(x) for x in used_pages)
        others = [k for k in range(self.full[0].shape[0]) if k not in used]
        return all(bool((a[others] == SENTINEL).all()) for a in self.full)

    def foreign_rows(self, used_pages=()):
        """(page, row, layer) rows outside ``used_pages`` (guard pages included) that do not
        hold only the sentinel: how much a stray write changed."""
        used = set(int(x) for x in used_pages)
        others = [k for k in range(self.full[0].shape[0]) if k not in used]
        return sum(int((a[others] != SENTINEL).any(axis=-1).sum()) for a in self.full)

    def clear(self, pages):
        for a in self.full:
            a[np.asarray(pages, np.int64)] = SENTINEL


_COMMON = ("poll", "failure_reason", "abort", "release", "is_drained", "request_stats", "request_latency",
           "connect")


def _dispatch(side, log: _Log, cmd: str, args: tuple, kw: dict) -> Any:
    obj = getattr(side, "obj", None)
    if cmd == "stats":
        return obj.stats
    if cmd == "logs":
        return list(log.lines)
    if cmd == "stacks":  # where every thread is now (a stuck worker shows here)
        import sys

        return {t: "".join(traceback.format_stack(f)) for t, f in sys._current_frames().items()}
    if cmd == "wait":  # (rid, timeout_s): polls until terminal, returns (status, reason, seconds)
        rid, timeout_s = args
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            st = obj.poll(rid)
            if st.terminal:
                return st.name, obj.failure_reason(rid), time.monotonic() - t0
            time.sleep(0.005)
        return obj.poll(rid).name, "", time.monotonic() - t0
    if cmd == "wait_drained":
        rid, timeout_s = args
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s and not obj.is_drained(rid):
            time.sleep(0.005)
        return obj.is_drained(rid)
    if cmd in _COMMON:
        out = getattr(obj, cmd)(*args, **kw)
        return out.name if hasattr(out, "terminal") else out
    return getattr(side, cmd)(*args, **kw)


def agent_main(conn, role: str, kwargs: dict) -> None:
    """Process main: builds the ``role`` side from ``kwargs``, answers ``("ready", hello)`` then
    serves ``(cmd, args, kwargs)`` orders with ``("ok", result)`` / ``("err", traceback)`` until
    ``("close",)`` or the pipe closes."""
    log = _Log()
    logging.getLogger("dcp_jax").addHandler(log)
    logging.getLogger("dcp_jax").setLevel(logging.WARNING)
    try:
        if role == "sender":
            side = _SenderSide(**kwargs)
        elif role == "receiver":
            side = _ReceiverSide(**kwargs)
        elif role == "attacker":
            from dcp_jax.netns.hostile import Attacker

            side = Attacker(**kwargs)
        else:
            raise ValueError(f"role={role!r}")
        conn.send(("ready", side.hello()))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "close":
            break
        try:
            conn.send(("ok", _dispatch(side, log, msg[0], msg[1], msg[2])))
        except BaseException:  # noqa: BLE001 - the agent lives on; the test sees why
            conn.send(("err", traceback.format_exc()))
    obj = getattr(side, "obj", None)
    (obj.close if obj is not None else side.close)()
    conn.send(("closed", None))


class Agent:
    """One agent process on ``hosts``' host number ``on``; `call` runs a command there.

    ``env``: extra environment for the process, over the host's (`Hosts.spawn`), e.g.
    ``{"UCX_PROTO_INFO": "y"}`` (UCX prints the transport of each operation). Other keyword
    arguments build the side.

    Raises (at construction): AgentError if the side could not be built, TimeoutError if it
    did not say ready within ``start_timeout_s``.
    """

    def __init__(self, hosts, on: int, role: str, start_timeout_s: float = 60.0, env: dict[str, str] | None = None,
                 **kwargs):
        import multiprocessing as mp

        self.role, self.on, self.kwargs = role, on, kwargs
        self._conn, child = mp.get_context("spawn").Pipe()
        self.proc = hosts.spawn(on, agent_main, (child, role, kwargs), name=f"agent-{role}-h{on}", env=env)
        child.close()
        self.hello = self._reply(start_timeout_s, "ready")

    def _reply(self, timeout_s: float, want: str = "ok") -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} agent: no answer within {timeout_s:g} s (alive={self.proc.is_alive()})")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise AgentError(f"{self.role} agent died (exit code {self.proc.exitcode})") from None
        if kind == "err":
            raise AgentError(f"{self.role} agent raised:\n{value}")
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = 30.0, **kw: Any) -> Any:
        self._conn.send((cmd, args, kw))
        return self._reply(timeout_s)

    def kill(self) -> None:
        """SIGKILL (no cleanup: what a crash looks like to the peers)."""
        self.proc.kill()
        self.proc.join(5)

    def close(self, timeout_s: float = 15.0) -> None:
        """Closes the connector there and ends the process (killed if it does not end)."""
        if self.proc.is_alive():
            try:
                self._conn.send(("close",))
                self._conn.poll(timeout_s)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
