"""Options of ``dcp-jax load`` and the request plan every process of a run follows.

`LoadConfig` validates every option and names it the way the command line spells it
(``--requests``, ``--abort-fraction``, ...), so the CLI turns a `ValueError` into a usage error as
is. `iter_plans` draws the run from ``--seed`` one request at a time (`plan_requests`: all of
them as a list): each request's length (1 token up
to ``--max-tokens``), its chunking into 1-4 ``send`` calls, and, for a ``--abort-fraction`` of the
requests, who aborts it (the sender or one decode rank) and when (see `AbortPlan`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from dcp_jax.geometry import ModelGeometry, geometry_names, get_geometry
from dcp_jax.transfer._worker import DEFAULT_HEARTBEAT_S, check_seconds, pings_fit

__all__ = ["LoadConfig", "RequestPlan", "AbortPlan", "plan_requests", "iter_plans", "pattern_seed", "ENGINES",
           "DIRECTIONS", "SEND_MODES", "ABORT_POINTS", "MAX_CHUNKS", "MAX_DCP_SIZE"]

ENGINES = ("nixl", "mooncake")
DIRECTIONS = ("push", "pull")
SEND_MODES = ("auto", "packed", "direct", "region")
MAX_CHUNKS = 4          # a request's prefill goes out in 1..MAX_CHUNKS send() calls
MAX_DCP_SIZE = 16       # one process per decode rank on one machine
MAX_REQUESTS = 10_000_000
#: Where a planned abort happens. Both points are chosen so that neither side CAN complete the
#: request whatever the timing: the last chunk is never sent.
#:   before_send: every decode rank has announced it (expect), no chunk was sent;
#:   after_first_chunk: the first of >= 2 chunks was sent (its bytes may be in flight), the rest never.
ABORT_POINTS = ("before_send", "after_first_chunk")
INJECTIONS = ("stray_write", "corrupt_row")
FAULTS = ("link_flap", "pause", "sender_pause")  # dcp_jax.loadgen.soak.FAULTS


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}={v} must be {rng}")
    return v


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """One load run. Field names are the CLI options without the ``--`` (``_`` for ``-``).

    Attributes:
        engine: ``nixl`` or ``mooncake`` (the transfer engine of every side).
        requests: requests in the run (>= 1), warm-up included.
        concurrency: at most this many requests in flight (issued and not yet finished on every
            side, pages freed included), >= 1.
        abort_fraction: fraction of the requests aborted on purpose, in [0, 1]
            (``round(F * requests)`` of them, drawn at random).
        direction: ``push`` (the sender WRITEs) or ``pull`` (the decode ranks READ).
        dcp_size: decode ranks (one receiver process each), 1..16.
        model: KV geometry name from `dcp_jax.geometry` (``tiny``: 3 layers of 64 B rows).
        max_tokens: longest request (tokens); lengths are uniform in [1, max_tokens].
        page_size: tokens per KV page, both sides.
        interleave_size: decode-side interleave I (tokens per ownership block).
        mode: the sender's ``mode`` (auto, packed, direct, region). ``region``: each receiver has a
            receive region of `region_bytes` (its share of one longest request), so concurrent
            requests queue for its room (`dcp_jax.transfer.KVReceiver`, ``region_bytes``).
        seed: seeds the request plan, the page tables and the KV patterns.
        timeout_s: the connector's no-progress timeout of a request (seconds); the run stops
            as stalled when nothing finishes for ``timeout_s + 10`` seconds.
        warmup: the first this many requests run (and finish) before the measured phase; kernel
            compiles and RSS are read after them.
        max_rss_growth_mb: the RSS check's limit (MiB, summed over the processes).
        inject: test hook, comma-separated faults decode rank 0 plays so the checks can be seen
            to fire: ``stray_write`` (one byte written into a free page after its 8th request),
            ``corrupt_row`` (one byte of its 4th succeeded request flipped before the check).
        netns: run the sender and the receivers on two hosts (network namespaces joined by a
            veth link, `dcp_jax.netns`; needs root) instead of loopback.
        duration_s: stop issuing requests after this many seconds of the measured phase (0: run
            all ``requests``); the run then counts the requests it issued.
        faults: comma-separated faults injected at random while the run goes (``--netns`` only):
            ``link_flap`` (the link down, then up), ``pause`` (a receiver SIGSTOPped, then
            SIGCONTed); each lasts less than ``peer_timeout_s``, so requests may FAIL (then
            allowed and counted) but connections stay; ``sender_pause`` (the sender SIGSTOPped
            for 1.2-1.6 x ``peer_timeout_s``: the receivers drop it and connect again).
        fault_every_s: mean gap between faults (seconds; each gap uniform in [0.5, 1.5] x it).
        peer_timeout_s: the connector's peer timeout (seconds) on every side.
    """

    engine: str = "nixl"
    requests: int = 1000
    concurrency: int = 64
    abort_fraction: float = 0.05
    direction: str = "push"
    dcp_size: int = 2
    model: str = "tiny"
    max_tokens: int = 512
    page_size: int = 16
    interleave_size: int = 1
    mode: str = "auto"
    seed: int = 0
    timeout_s: float = 30.0
    warmup: int = 16
    max_rss_growth_mb: float = 100.0
    inject: str = ""
    netns: bool = False
    duration_s: float = 0.0
    faults: str = ""
    fault_every_s: float = 10.0
    peer_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine={self.engine!r} must be one of {', '.join(ENGINES)}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"--direction={self.direction!r} must be one of {', '.join(DIRECTIONS)}")
        if self.mode not in SEND_MODES:
            raise ValueError(f"--mode={self.mode!r} must be one of {', '.join(SEND_MODES)}")
        _int("--requests", self.requests, 1, MAX_REQUESTS)
        _int("--concurrency", self.concurrency, 1, 4096)
        _int("--dcp-size", self.dcp_size, 1, MAX_DCP_SIZE)
        _int("--max-tokens", self.max_tokens, 1, 1 << 20)
        _int("--page-size", self.page_size, 1, 1 << 16)
        _int("--interleave-size", self.interleave_size, 1, 1 << 20)
        _int("--seed", self.seed, 0)
        _int("--warmup", self.warmup, 0)
        f = self.abort_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= float(f) <= 1.0:
            raise ValueError(f"--abort-fraction={f!r} must be a number in [0, 1]")
        for name, v in (("--timeout-s", self.timeout_s), ("--peer-timeout-s", self.peer_timeout_s)):
            try:  # the connector's own rule, (0, 86400] s: what it would refuse at start is refused here
                check_seconds(name, v)
            except TypeError as exc:
                raise ValueError(str(exc)) from None
        v = self.max_rss_growth_mb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < float(v) < math.inf:
            raise ValueError(f"--max-rss-growth-mb={v!r} must be a positive number of MiB")
        bad = set(filter(None, str(self.inject).split(","))) - set(INJECTIONS)
        if bad:
            raise ValueError(f"inject={self.inject!r}: unknown faults {sorted(bad)}; known: {', '.join(INJECTIONS)}")
        bad = set(filter(None, str(self.faults).split(","))) - set(FAULTS)
        if bad:
            raise ValueError(f"--faults={self.faults!r}: unknown faults {sorted(bad)}; known: {', '.join(FAULTS)}")
        if self.faults and not self.netns:
            raise ValueError("--faults needs --netns (faults are played on the two-host network)")
        for name, v in (("--duration-s", self.duration_s),):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= float(v) < math.inf:
                raise ValueError(f"{name}={v!r} must be a number of seconds >= 0")
        v = self.fault_every_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < float(v) < math.inf:
            raise ValueError(f"--fault-every-s={v!r} must be a positive number of seconds")
        if not pings_fit(DEFAULT_HEARTBEAT_S, self.peer_timeout_s):  # else every side refuses it at start
            raise ValueError(f"--peer-timeout-s={self.peer_timeout_s!r} must be >= {2 * DEFAULT_HEARTBEAT_S:g} "
                             f"(twice the connector's ping interval, {DEFAULT_HEARTBEAT_S:g} s)")
        if self.model.strip().lower().replace("_", "-") not in geometry_names():
            raise ValueError(f"--model={self.model!r} must be one of {', '.join(geometry_names())}")
        # Sized as the pools are (`pool_pages`: whole pages), not by tokens: one token per request
        # with 65,536-token pages is a page per request.
        pool = self.pool_pages(self.max_tokens) * self.page_size * self.geometry.row_bytes
        if pool > (8 << 30):
            raise ValueError(f"--max-tokens={self.max_tokens} x --concurrency={self.concurrency} in pages of "
                             f"--page-size={self.page_size} of --model={self.model} needs "
                             f"{pool / 2**30:,.1f} GiB of KV pool per side, more than 8 GiB")

    @property
    def geometry(self) -> ModelGeometry:
        return get_geometry(self.model)

    @property
    def warmup_requests(self) -> int:
        return min(self.warmup, self.requests)

    @property
    def fault_list(self) -> list[str]:
        return [f for f in str(self.faults).split(",") if f]

    def pool_pages(self, rows_per_request: int) -> int:
        """Pages of one side's pool: twice what ``concurrency`` requests of the longest length
        need (so tables stay scattered), plus a few."""
        return 2 * self.concurrency * -(-rows_per_request // self.page_size) + 8

    def rank_rows(self) -> int:
        """Rows decode rank 0 holds of a longest request: the most any rank owns (rank 0 owns
        the first interleave block)."""
        from dcp_jax.loadgen.pool import owned_tokens

        return len(owned_tokens(self.max_tokens, self.dcp_size, 0, self.interleave_size))

    def region_bytes(self) -> int | None:
        """``region_bytes`` of each receiver (bytes): for ``mode="region"``, room for
        `rank_rows` rows, rounded up to the region's alignment; else None (the connector's
        default: no region for host KV)."""
        if self.mode != "region":
            return None
        from dcp_jax.transfer._region import REGION_ALIGN

        return -(-max(1, self.rank_rows()) * self.geometry.row_bytes // REGION_ALIGN) * REGION_ALIGN

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AbortPlan:
    """Who aborts a request (``by``: -1 the sender, r >= 0 decode rank r) and when (`ABORT_POINTS`)."""

    by: int
    point: str

    @property
    def side(self) -> str:
        return "sender" if self.by < 0 else f"receiver{self.by}"


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """One request of the run: ``rid``, ``num_tokens``, its chunks ``[(start, stop), ...]``
    covering ``[0, num_tokens)`` in order, the KV pattern seed and an optional abort."""

    index: int
    rid: str
    num_tokens: int
    chunks: tuple[tuple[int, int], ...]
    seed: int
    abort: AbortPlan | None = None

    def as_msg(self) -> tuple:
        """Plain tuple for the pipes to the worker processes."""
        ab = None if self.abort is None else (self.abort.by, self.abort.point)
        return (self.index, self.rid, self.num_tokens, self.chunks, self.seed, ab)

    @classmethod
    def from_msg(cls, m: tuple) -> "RequestPlan":
        i, rid, n, chunks, seed, ab = m
        return cls(i, rid, n, tuple(tuple(c) for c in chunks), seed, None if ab is None else AbortPlan(*ab))


def pattern_seed(seed: int, index: int) -> int:
    """Seed of request ``index``'s KV pattern (`dcp_jax.kv_data.row_pattern`): distinct per
    request, so a row of one request landing in another's page never matches."""
    return ((seed & 0xFFFFFF) << 32) | (index + 1)


def iter_plans(cfg: LoadConfig) -> Iterator[RequestPlan]:
    """The run's requests in order, drawn from ``cfg.seed`` one at a time as the run issues them
    (the same sequence as `plan_requests`): a ``--duration-s`` run with a large ``--requests``
    builds only the plans it issues (all of a million took 14.5 s and 744 MB before the first)."""
    rng = np.random.default_rng([cfg.seed, 0x10AD])
    n = cfg.requests
    n_abort = int(round(cfg.abort_fraction * n))
    aborted = set(rng.choice(n, size=n_abort, replace=False).tolist()) if n_abort else set()
    tag = f"{cfg.seed:x}"
    for i in range(n):
        length = int(rng.integers(1, cfg.max_tokens + 1))
        k = int(min(rng.integers(1, MAX_CHUNKS + 1), length))
        cuts = sorted(rng.choice(np.arange(1, length), size=k - 1, replace=False).tolist()) if k > 1 else []
        edges = [0, *cuts, length]
        chunks = tuple((edges[j], edges[j + 1]) for j in range(k))
        ab = None
        if i in aborted:
            by = int(rng.integers(-1, cfg.dcp_size))
            point = ABORT_POINTS[int(rng.integers(0, 2))] if k > 1 else "before_send"
            ab = AbortPlan(by, point)
        yield RequestPlan(i, f"load-{tag}-{i}", length, chunks, pattern_seed(cfg.seed, i), ab)


def plan_requests(cfg: LoadConfig) -> list[RequestPlan]:
    """All of the run's requests (`iter_plans` as a list), drawn from ``cfg.seed``."""
    return list(iter_plans(cfg))
