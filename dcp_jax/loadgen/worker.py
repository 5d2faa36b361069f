"""Process mains of a load run: one `KVSender` process, one `KVReceiver` process per decode rank.

Each process plays a serving engine's side over the public connector API only
(`dcp_jax.transfer`): it owns a `PagePool` (its paged KV, registered by the connector), takes
request orders from the orchestrator over a multiprocessing pipe (our own processes; nothing from
the network is unpickled) and reports each request once it is finished *and* its pages are back
on the free list.

Pages of a finished request are reused only when nothing can touch them any more, as the
connector says: ``is_drained(rid)`` on each side (always after SUCCESS; after ABORTED/FAILED once
no window of it is still moving: the sender's writes or reads of its pages, the receiver's own
reads and every sender's word that it has no write in flight). Only then is the request
released, its pages checked and given back, and the request reported.

Pipe messages (tuples): orchestrator -> sender ``start``(plan) / ``snapshot`` / ``finish``;
-> receiver ``connect``(address) / ``expect``(plan) / ``abort``(i) / ``snapshot`` / ``finish``.
Back: ``ready``, ``connected``, ``armed``(i), ``done``(i, info), ``snapshot``(info),
``final``(info), ``error``(side, traceback).
"""
from __future__ import annotations

import time
import traceback

import numpy as np

from dcp_jax.loadgen.config import LoadConfig, RequestPlan
from dcp_jax.loadgen.pool import PagePool, owned_tokens

__all__ = ["sender_main", "receiver_main", "rss_bytes", "cpu_seconds"]

_IDLE_WAIT_S = 0.002


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread (seconds)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rss_bytes() -> int:
    """Resident set size of this process (``VmRSS`` of /proc/self/status), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _spec(cfg: LoadConfig, dcp_size: int, rank: int, interleave: int):
    from dcp_jax.transfer import KVCacheSpec

    g = cfg.geometry
    return KVCacheSpec(g.num_layers, g.kv_item_lens, cfg.page_size, dcp_size, rank, interleave, dtype=g.dtype)


class _Side:
    """What both kinds of process share: the pipe loop, the pool, the RSS/registration record."""

    name = "side"

    def __init__(self, conn, cfg: LoadConfig, rng_key: int):
        import bridge

        self.conn, self.cfg, self.bridge = conn, cfg, bridge
        self.rng = np.random.default_rng([cfg.seed, 0x5EED, rng_key + 1])
        self.live: dict[int, object] = {}
        self.mem = dict(rss_start=rss_bytes(), registered_before=bridge.registered_bytes())
        self.conn_obj = None  # the KVSender / KVReceiver

    def make_pool(self, rows_per_request: int) -> PagePool:
        g = self.cfg.geometry
        self.pool = PagePool(g.kv_item_lens, self.cfg.pool_pages(rows_per_request), self.cfg.page_size, self.rng)
        return self.pool

    def created(self) -> None:
        self.mem.update(registered_with=self.bridge.registered_bytes(), rss_ready=rss_bytes())

    def loop(self) -> None:
        busy = True
        while True:
            if self.conn.poll(0 if busy else _IDLE_WAIT_S):
                while True:
                    if not self.handle(self.conn.recv()):
                        return
                    if not self.conn.poll():
                        break
            busy = False
            for i in list(self.live):
                busy |= self.step(self.live[i])

    def handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "snapshot":
            self.conn.send(("snapshot", self.snapshot()))
        elif kind == "sample":  # the soak's memory record over time
            self.conn.send(("sample", dict(t=time.monotonic(), rss=rss_bytes(),
                                           registered=self.bridge.registered_bytes())))
        elif kind == "finish":
            self.finish()
            return False
        else:
            self.command(kind, msg)
        return True

    def snapshot(self) -> dict:
        return dict(rss=rss_bytes(), stats=self.conn_obj.stats)

    def finish(self) -> None:
        live = len(self.live)
        violations = self.pool.check_free()
        stats = self.conn_obj.stats
        rss_end = rss_bytes()
        t0 = time.monotonic()
        self.conn_obj.close()
        close_s = time.monotonic() - t0
        self.mem.update(rss_end=rss_end, rss_after_close=rss_bytes(), cpu_s=cpu_seconds(),
                        registered_after_close=self.bridge.registered_bytes())
        self.conn.send(("final", dict(side=self.name, stats=stats, pool=self.pool.counters(), mem=self.mem,
                                      end_violations=violations, unfinished=live, close_s=close_s,
                                      reconnects=getattr(self, "reconnects", 0),
                                      pages_leaked=self.pool.num_pages - len(self.pool.free))))


class _SReq:
    __slots__ = ("plan", "table", "tokens", "want", "next", "phase", "status", "reason", "t_term", "transfer_s",
                 "drain_s", "t_arm")

    def __init__(self, plan: RequestPlan, table, tokens, want):
        self.plan, self.table, self.tokens, self.want = plan, table, tokens, want
        self.next, self.phase = 0, "send"
        self.status, self.reason, self.t_term, self.transfer_s, self.drain_s = None, "", 0.0, None, 0.0
        self.t_arm = 0.0  # when a before_send abort began waiting for the ranks' announcements


class _Sender(_Side):
    name = "sender"

    def __init__(self, conn, cfg: LoadConfig, host: str = "127.0.0.1"):
        super().__init__(conn, cfg, -1)
        from dcp_jax.transfer import KVSender, TransferStatus

        self.S = TransferStatus
        self.make_pool(cfg.max_tokens)
        self.conn_obj = self.s = KVSender(_spec(cfg, 1, 0, 1), self.pool.layers, engine=cfg.engine, host=host,
                                          mode=cfg.mode, timeout_s=cfg.timeout_s, peer_timeout_s=cfg.peer_timeout_s)
        self.created()
        conn.send(("ready", dict(address=self.s.address, pid=_pid())))

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["kernel_compiles"] = out["stats"].get("kernel_compiles")
        return out

    def command(self, kind: str, msg: tuple) -> None:
        if kind != "start":
            raise ValueError(f"sender: unknown order {kind!r}")
        plan = RequestPlan.from_msg(msg[1])
        tokens = np.arange(plan.num_tokens, dtype=np.int64)
        table = self.pool.allocate(plan.num_tokens)
        want = self.pool.fill(table, tokens, plan.seed)
        self.live[plan.index] = _SReq(plan, table, tokens, want)

    def step(self, r: _SReq) -> bool:
        s, rid, ab = self.s, r.plan.rid, r.plan.abort
        if r.phase == "send":
            if ab is not None and ab.point == "before_send":
                r.phase = "arm"
                return True
            a, b = r.plan.chunks[r.next]
            try:
                s.send(rid, r.table, a, b)
            except ValueError:
                if s.poll(rid).terminal:  # failed (e.g. a timeout) before its last chunk
                    r.phase = "wait"
                    return True
                raise
            r.next += 1
            if ab is not None:
                r.phase = "arm"
            elif r.next == len(r.plan.chunks):
                r.phase = "wait"
            return True
        if r.phase == "arm":  # abort only once every rank's expect reached the sender
            try:
                st = s.request_stats(rid)
            except KeyError:  # no expect arrived yet (before_send: nothing was sent)
                r.t_arm = r.t_arm or time.monotonic()
                if time.monotonic() - r.t_arm < self.cfg.timeout_s + 2 * self.cfg.peer_timeout_s:
                    return False
                # The expects went over a connection a fault broke (the ranks failed the request
                # on their side, and their "failed" found no request here): none will come.
                s.send(rid, r.table, *r.plan.chunks[0])
                s.abort(rid, "loadgen: planned abort; no decode rank's announcement came")
                r.phase = "wait"
                return True
            if not s.poll(rid).terminal and len(st["ranks"]) < self.cfg.dcp_size:
                return False
            if ab.by < 0:
                s.abort(rid, "loadgen: planned abort by the sender")
            else:
                self.conn.send(("armed", r.plan.index))
            r.phase = "wait"
            return True
        try:
            if r.phase == "wait":
                status = s.poll(rid)
                if not status.terminal:
                    return False
                r.status, r.reason, r.t_term = status, s.failure_reason(rid), time.monotonic()
                r.transfer_s = s.request_stats(rid).get("transfer_seconds")
                r.phase = "drain"
            if not s.is_drained(rid):  # an aborted request's window may still be moving
                return False
            r.drain_s = time.monotonic() - r.t_term
            s.release(rid)
        except KeyError:  # the sender forgot it: it ended before any chunk was sent, 2 * timeout_s ago
            if r.status is None:  # (`KVSender` drops such requests itself; nothing of it is in flight)
                r.status, r.reason = self.S.ABORTED, "ended unsent; forgotten by the sender"
            r.t_term = r.t_term or time.monotonic()
            r.drain_s = time.monotonic() - r.t_term
        bad, sv = self.pool.verify(r.table, r.tokens, r.plan.seed, count=False, want=r.want)  # nobody writes our KV
        self.pool.give_back(r.table)
        del self.live[r.plan.index]
        self.conn.send(("done", r.plan.index, dict(status=r.status.value, reason=r.reason[:200],
                                                   transfer_s=r.transfer_s, src_bad_rows=bad, drain_s=r.drain_s)))
        return True


class _RReq:
    __slots__ = ("plan", "table", "tokens", "status", "reason", "latency", "t_term")

    def __init__(self, plan: RequestPlan, table, tokens):
        self.plan, self.table, self.tokens = plan, table, tokens
        self.status, self.reason, self.latency, self.t_term = None, "", None, 0.0


class _Receiver(_Side):
    def __init__(self, conn, cfg: LoadConfig, rank: int, host: str | None = None):
        super().__init__(conn, cfg, rank)
        from dcp_jax.transfer import KVReceiver, TransferStatus

        self.S, self.rank, self.name = TransferStatus, rank, f"receiver{rank}"
        self.inject = set(filter(None, cfg.inject.split(","))) if rank == 0 else set()
        self.given_back = self.succeeded = 0
        self.make_pool(cfg.rank_rows())
        self.conn_obj = self.r = KVReceiver(_spec(cfg, cfg.dcp_size, rank, cfg.interleave_size), self.pool.layers,
                                            engine=cfg.engine, direction=cfg.direction, timeout_s=cfg.timeout_s,
                                            peer_timeout_s=cfg.peer_timeout_s, host=host,
                                            region_bytes=cfg.region_bytes())
        self.address, self.reconnects, self.next_reconnect = None, 0, 0.0
        self.created()
        conn.send(("ready", dict(pid=_pid())))

    def command(self, kind: str, msg: tuple) -> None:
        if kind == "connect":
            self.address = msg[1]
            self.r.connect(msg[1])
            self.conn.send(("connected", self.rank))
        elif kind == "expect":
            plan = RequestPlan.from_msg(msg[1])
            if self.r.stats["connections"] == 0:  # a fault outlived the peer timeout: connect again
                self._reconnect(must=True)
            tokens = owned_tokens(plan.num_tokens, self.cfg.dcp_size, self.rank, self.cfg.interleave_size)
            table = self.pool.allocate(len(tokens))
            try:
                self.r.expect(plan.rid, table, plan.num_tokens)
            except RuntimeError:  # the sender dropped the link since the check above: connect again, once
                self._reconnect(must=True)
                self.r.expect(plan.rid, table, plan.num_tokens)
            self.live[plan.index] = _RReq(plan, table, tokens)
        elif kind == "abort":
            req = self.live.get(msg[1])
            if req is not None:
                self.r.abort(req.plan.rid, f"loadgen: planned abort by decode rank {self.rank}")
        else:
            raise ValueError(f"receiver: unknown order {kind!r}")

    def _reconnect(self, must: bool) -> None:
        """Connects to the sender again (its answer may wait until its old writes ended). A
        refusal or timeout is retried ``must`` times more now, else at the next pass."""
        from dcp_jax.transfer import HandshakeError

        for attempt in range(3 if must else 1):
            self.reconnects += 1
            try:
                self.r.connect(self.address, timeout_s=30.0)
                return
            except (HandshakeError, TimeoutError):
                self.next_reconnect = time.monotonic() + 0.5
                if attempt == 2 or not must:
                    if must:
                        raise
                    return
                time.sleep(0.5)

    def step(self, q: _RReq) -> bool:
        rid = q.plan.rid
        if q.status is None:
            status = self.r.poll(rid)
            if not status.terminal:
                return False
            latency = self.r.request_latency(rid)
            if latency is None:  # the connector sets the end time just after the status: next pass
                return False
            q.status, q.reason, q.latency, q.t_term = status, self.r.failure_reason(rid), latency, time.monotonic()
        if not self.r.is_drained(rid):  # an aborted request: a write may still be landing
            if self.r.stats["connections"] == 0 and time.monotonic() >= self.next_reconnect:
                # A sender dropped as silent stays "in doubt" (its pages held) until we connect
                # again and it says none of its old writes is in flight: do not wait for an expect.
                self._reconnect(must=False)
            return False
        self.r.release(rid)
        del self.live[q.plan.index]
        self._give_back(q)
        return True

    def _give_back(self, q: _RReq) -> None:
        info = dict(status=q.status.value, reason=q.reason[:200], latency_s=q.latency, rows=len(q.tokens),
                    drain_s=time.monotonic() - q.t_term)
        if q.status is self.S.SUCCESS:  # right after SUCCESS, before the pages are reused
            self.succeeded += 1
            if "corrupt_row" in self.inject and self.succeeded == 4 and len(q.tokens):
                self.pool.layers[0][q.table[0], 0, 0] ^= 0xFF  # test hook: a wrong byte landed
            info["bad_rows"], info["tail_violations"] = self.pool.verify(q.table, q.tokens, q.plan.seed)
        else:
            info["foreign_pages"] = self.pool.check_partial(q.table, q.tokens, q.plan.seed)
        self.pool.give_back(q.table)
        self.given_back += 1
        if "stray_write" in self.inject and self.given_back == 8:
            self.pool.layers[0][self.pool.free[0], 0, 0] ^= 0xFF  # test hook: a write into a free page
        self.conn.send(("done", q.plan.index, info))

def _pid() -> int:
    import os

    return os.getpid()


def own_process_group() -> bool:
    """Makes this process the leader of a process group of its own; True if it is one after.

    Why: the kernel sends SIGHUP then SIGCONT to every member of a process group that becomes
    orphaned while one member is stopped (POSIX). The soak stops processes with SIGSTOP; in the
    orchestrator's group, the shell that started the run exiting orphaned it, and the hangup
    reached every worker (UCX dumped debug state on it: `benchmarks/results/soak_netns.md`). In a group of its
    own each worker's group keeps a parent (the orchestrator) in another group of the session,
    so it is not orphaned while the orchestrator lives; the terminal's Ctrl-C reaches only the
    orchestrator, which stops the workers itself."""
    import os

    try:
        os.setpgid(0, 0)
    except OSError:  # already a session or group leader (a namespace launcher may make it one)
        pass
    return os.getpgid(0) == os.getpid()


def _run(make, conn, *args) -> None:
    side = None
    own_group = own_process_group()
    try:
        side = make(conn, *args)
        side.mem["own_process_group"] = own_group
        side.loop()
    except BaseException:  # noqa: BLE001 - reported to the orchestrator, which fails the run
        try:
            conn.send(("error", getattr(side, "name", make.__name__), traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the orchestrator is gone
            pass
        if side is not None and side.conn_obj is not None:
            side.conn_obj.close()
        raise SystemExit(1)


def sender_main(conn, cfg_dict: dict, host: str = "127.0.0.1") -> None:
    """Process main of the prefill side: one `KVSender` over its `PagePool`, listening on ``host``."""
    _run(_Sender, conn, LoadConfig(**cfg_dict), host)


def receiver_main(conn, cfg_dict: dict, rank: int, host: str | None = None) -> None:
    """Process main of decode rank ``rank``: one `KVReceiver` over its `PagePool` (on ``host``)."""
    _run(_Receiver, conn, LoadConfig(**cfg_dict), rank, host)
