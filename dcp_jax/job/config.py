"""Configuration of the main job (``dcp-jax transfer``), its test hooks and up-front checks.

`JobConfig` holds every knob of one run, validated on construction (the message names the
argument). Three fields are failure-injection hooks used by the tests: ``corrupt_rank`` (a decode
rank damages one received byte before it verifies), ``die_rank`` / ``die_after_chunks`` (a decode
rank SIGKILLs itself once its first chunks have landed).
"""

from __future__ import annotations

import dataclasses
import math
import os

from dcp_jax.geometry import ModelGeometry, get_geometry
from dcp_jax.layout import local_len_np
from dcp_jax.transfer._worker import DEFAULT_HEARTBEAT_S, pings_fit
from dcp_jax.transfer.protocol import check_expect_pages
from dcp_jax.transfer.spec import check_layout_bounds

__all__ = ["MODES", "PATHS", "ENGINES", "DEVICES", "STAGINGS", "engine_registers", "MAX_RANKS", "MAX_TIMEOUT_S", "JobConfig", "check_device",
           "check_prefill_interleave", "engine_env"]

MODES = ("direct", "packed")
#: Transfer paths a run may ask the connector for (``KVSender(mode=...)``; ``--path``): the two
#: modes, "region" (one descriptor per window into the receiver's receive region), "fused" (a
#: kernel writing through CUDA IPC, GPU only) and "auto" (the connector's rule).
PATHS = ("auto", "direct", "packed", "region", "fused")
ENGINES = ("nixl", "mooncake", "jax-transfer", "auto")
DEVICES = ("cpu", "gpu")
# --staging: the connector's choices (dcp_jax.transfer.staging.STAGINGS; a test checks they agree),
# not imported from there: dcp_jax.transfer pulls in the engines and JAX (0.8 s) at config time.
STAGINGS = ("auto", "none", "host")
# --region-notify: "auto" (chosen by placement) or the connector's values
# (dcp_jax.transfer._sender_region.REGION_NOTIFY; not imported, as STAGINGS; a test checks they agree).
REGION_NOTIFIES = ("auto", "write", "round")
DIRECTIONS = ("push", "pull")  # --direction: the sender WRITEs, or each decode rank READs (pulls) its rows
MAX_RANKS = 64  # dcp_size / prefill_dcp_size: one process per rank
#: Longest request the job and the cost report take (tokens): 4,194,304, 32x the longest
#: context served today; `dcp-jax plan --prompt-tokens 100000000000` took 15 GB before failing.
MAX_PROMPT_TOKENS = 1 << 22
MAX_TIMEOUT_S = 86400.0  # a day: the connector's waits take at most that
MAX_REQUESTS = 100  # timed requests per mode: each one fills, ships and verifies the whole request



def engine_env(device: str = "cpu") -> None:
    """Sets the engines' quiet loopback defaults (and, on the GPU, no JAX preallocation: several
    processes share the device) unless the user set them."""
    from bridge.engine_env import quiet_engines

    quiet_engines(loopback=True)  # engines log to stderr on their own; traffic stays on loopback
    if device == "gpu":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def engine_registers(engine_kind: str, device: str) -> bool:
    """Whether ``engine_kind`` can register KV memory of ``device`` ("cpu": host memory; "gpu":
    CUDA device memory): the connector's rule (`dcp_jax.transfer.staging.engine_registers`)."""
    from dcp_jax.transfer.staging import engine_registers as registers

    return registers(engine_kind, "VRAM" if device == "gpu" else "DRAM")


def check_job_timeout(timeout_s: float) -> None:
    """A job's ``--timeout-s``: its connectors' peer timeout is ``min(timeout_s, PEER_TIMEOUT_S)``,
    which must leave room for two pings (`pings_fit`, the connector's own rule).

    Raises:
        ValueError: not a number of seconds in [2 x the ping interval, `MAX_TIMEOUT_S`] (names
            ``timeout_s`` and ``--timeout-s``).
    """
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not (ok and timeout_s <= MAX_TIMEOUT_S and pings_fit(DEFAULT_HEARTBEAT_S, timeout_s)):
        raise ValueError(f"timeout_s={timeout_s!r} (--timeout-s) must be in [{2 * DEFAULT_HEARTBEAT_S:g}, "
                         f"{MAX_TIMEOUT_S:g}] seconds (at least twice the connector's ping interval, "
                         f"{DEFAULT_HEARTBEAT_S:g} s)")


def check_prefill_interleave(prefill_dcp_size: int, prefill_interleave_size: int) -> None:
    """Refuses a prefill interleave with one prefill rank: that rank holds every token whatever
    the interleave, so the option would be silently ignored. Ints >= 1 are the caller's to check.

    Raises:
        ValueError: ``prefill_interleave_size != 1`` with ``prefill_dcp_size == 1``, naming
            ``--prefill-interleave-size`` and ``--prefill-dcp-size``.
    """
    if prefill_dcp_size == 1 and prefill_interleave_size != 1:
        raise ValueError(f"--prefill-interleave-size={prefill_interleave_size} needs --prefill-dcp-size > 1: "
                         "one prefill rank holds every token, so its interleave would be ignored "
                         "(leave --prefill-interleave-size out, or give --prefill-dcp-size M > 1)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Knobs of one ``dcp-jax transfer`` run (all sizes in tokens unless stated).

    Attributes:
        model: geometry name (``dcp_jax.geometry``), e.g. ``"deepseek-v3"``.
        prompt_tokens: request length L (prefix included).
        page_size: tokens per KV page P, both sides.
        dcp_size: decode ranks N (processes, one `KVReceiver` each).
        prefill_dcp_size: prefill ranks M (processes, one `KVSender` each, each holding its shard).
        interleave_size: decode-side interleave I (1 = token round-robin).
        prefill_interleave_size: prefill-side interleave; other than 1 only with
            ``prefill_dcp_size > 1`` (`check_prefill_interleave`).
        chunk_tokens: chunked prefill: one ``send`` per chunk of this many tokens (a multiple of
            ``page_size``); None sends the request as one chunk.
        prefix_tokens: tokens the decode side already holds (not sent); a multiple of
            ``lcm(P*N, I*N)``. Both sides' page tables still cover them (spec section 10).
        modes: paths of :data:`PATHS` (usually :data:`MODES`), run in this order, one run each
            (``KVSender(mode=...)``; ``--mode`` or ``--path``).
        engine: ``"nixl"``, ``"mooncake"``, ``"jax-transfer"`` (jax.experimental.transfer through
            `bridge.jax_engine`: every batch a pull, host memory only) or ``"auto"``.
        max_batch_indices: at most this many rows per engine batch.
        pack_tokens: the pack buffer holds ``N * ceil(pack_tokens / N)`` tokens (spec section 6);
            default: as many as the prefill rank sends (nothing is sliced). Smaller values force
            sliced packing.
        round_rows: the most index rows one sender round packs or copies in one launch
            (``KVSender.warm_up(round_rows=...)``); default: the bucket of one window (its default),
            and on the region path with ``region_notify`` "round", every row the prefill rank
            sends (one round: its ranks hear ``done`` once every write of it landed).
        region_notify: ``KVSender(region_notify=...)`` on the region path: "write", "round" or
            "auto" (default: "round" when every process shares one GPU, `shares_one_gpu`:
            there the ranks' unpacks time-slice with the copies still moving; else "write").
        verify: also compare a CRC-32 per (chunk, rank, layer) of what the prefill sent with what
            arrived (the full byte verification runs regardless).
        seed: seeds the KV pattern and the page allocators.
        timeout_s: a request with no progress for this long fails (seconds, >= 1: the connectors'
            peer timeout is the smaller of it and 30 s, and holds two 0.5 s pings); also the deadline of
            the job's control messages, except the senders' kernel warm-up (compiles, bounded by
            ``run.WARM_UP_LIMIT_S`` or this, whichever is longer).
        requests: timed requests per mode, one after another through the same connectors, each
            verified (the run reports the median one, every one under ``repeats``); <=
            `MAX_REQUESTS`.
        pool_slack: each side's page pool is this many times the pages the request needs.
        corrupt_rank: test hook: this decode rank flips one received byte (of its first chunk)
            before it verifies (checks that verification catches it).
        die_rank: test hook: the decode process started as this rank SIGKILLs itself once the
            rows of its first ``die_after_chunks`` chunks have landed (or the request completed).
        die_after_chunks: see ``die_rank``.
        device: ``"cpu"`` (host memory, numpy gather) or ``"gpu"`` (CuPy device memory of GPU 0
            registered as VRAM, the Pallas gather); ``"gpu"`` needs NIXL (``"auto"`` then means
            NIXL). :func:`check_device` checks CuPy and a CUDA device.
        staging: ``"auto"`` (each side stages through pinned host memory where its engine cannot
            register its KV: ``jax-transfer`` on the GPU), ``"none"`` (never) or ``"host"``
            (always): given to every `KVSender` / `KVReceiver` (`dcp_jax.transfer.staging`), whose
            KV then stays in device memory, unregistered. Both sides staged take the ``region``
            path (the default ``modes`` become ``("region",)``; others are refused).
        prefill_page_size: tokens per page on the prefill side (``--prefill-page-size``; None: the
            decode ``page_size``). The connector moves rows between different page sizes.
        direction: ``"push"`` (the sender WRITEs) or ``"pull"`` (each decode rank READs its rows
            from the sender's pack region or KV and answers on the control plane: how tpu-inference
            and sglang-jax use jax.experimental.transfer).
        pack_backend: registry backend (``pallas_kernels.registry``) of the senders' pack
            (``KVSender(pack_backend=...)``), staged or not; ``"auto"``.
        prefill_gpus: GPU ordinals of the prefill ranks, round-robin (``--prefill-gpus``); None:
            the inherited device 0. Needs ``device="gpu"``. See :mod:`dcp_jax.job.gpus`.
        decode_gpus: GPU ordinals of the decode processes, round-robin (``--decode-gpus``).
        mps: run every process as a client of a private CUDA MPS daemon the job starts and
            quits (``--mps``, `dcp_jax.job.mps`): processes sharing a GPU then share one server
            context instead of time-slicing it. Needs ``device="gpu"`` and
            ``nvidia-cuda-mps-control`` on PATH (the run fails with a RuntimeError naming it).

    Raises:
        ValueError: any value out of range; the message names the argument.
    """

    model: str = "deepseek-v3"
    prompt_tokens: int = 32768
    page_size: int = 64
    dcp_size: int = 8
    prefill_dcp_size: int = 1
    interleave_size: int = 1
    prefill_interleave_size: int = 1
    chunk_tokens: int | None = None
    prefix_tokens: int = 0
    modes: tuple[str, ...] = MODES
    engine: str = "nixl"
    max_batch_indices: int | None = None
    pack_tokens: int | None = None
    round_rows: int | None = None
    region_notify: str = "auto"
    verify: bool = False
    seed: int = 0
    timeout_s: float = 300.0
    requests: int = 1
    pool_slack: float = 1.25
    corrupt_rank: int | None = None
    die_rank: int | None = None
    die_after_chunks: int = 1
    device: str = "cpu"
    staging: str = "auto"
    pack_backend: str = "auto"
    direction: str = "push"
    prefill_page_size: int | None = None
    prefill_gpus: tuple[int, ...] | None = None
    decode_gpus: tuple[int, ...] | None = None
    mps: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(self.modes))
        for name in ("prefill_gpus", "decode_gpus"):
            v = getattr(self, name)
            if v is None:
                continue
            v = tuple(v)
            if not v or not all(_is_int(g) and g >= 0 for g in v) or len(set(v)) != len(v):
                raise ValueError(f"{name}={v!r} (--{name.replace('_', '-')}) must be distinct GPU numbers >= 0")
            if self.device != "gpu":
                raise ValueError(f"{name}={v!r} (--{name.replace('_', '-')}) places processes on GPUs: "
                                 "it needs --device gpu")
            object.__setattr__(self, name, v)
        get_geometry(self.model)  # raises ValueError listing the valid names
        for name in ("prompt_tokens", "page_size", "dcp_size", "prefill_dcp_size",
                     "interleave_size", "prefill_interleave_size", "die_after_chunks"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                flag = "" if name == "die_after_chunks" else f" (--{name.replace('_', '-')})"  # a test hook
                raise ValueError(f"{name}={v!r}{flag} must be an int >= 1")
        for name in ("dcp_size", "prefill_dcp_size"):  # one process per rank
            if getattr(self, name) > MAX_RANKS:
                raise ValueError(f"{name}={getattr(self, name)} (--{name.replace('_', '-')}) must be <= "
                                 f"{MAX_RANKS} (the job starts one process per rank)")
        check_prefill_interleave(self.prefill_dcp_size, self.prefill_interleave_size)
        if self.prompt_tokens > MAX_PROMPT_TOKENS:  # before any plan or buffer is sized by it
            raise ValueError(f"prompt_tokens={self.prompt_tokens:,} (--prompt-tokens) must be <= "
                             f"{MAX_PROMPT_TOKENS:,}: plans and buffers are sized by it")
        if not _is_int(self.prefix_tokens) or self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens={self.prefix_tokens!r} (--prefix-tokens) must be an int >= 0")
        if not _is_int(self.seed) or self.seed < 0:  # as `dcp-jax load`: -3 drew the tables of 3
            raise ValueError(f"seed={self.seed!r} (--seed) must be an int >= 0")
        if self.prefix_tokens >= self.prompt_tokens:
            raise ValueError(f"prefix_tokens={self.prefix_tokens} (--prefix-tokens) must be < prompt_tokens={self.prompt_tokens}")
        n, p, i = self.dcp_size, self.page_size, self.interleave_size
        align = math.lcm(p * n, i * n)
        if self.prefix_tokens % align:
            raise ValueError(
                f"prefix_tokens={self.prefix_tokens} (--prefix-tokens) must be a multiple of {align} "
                f"(lcm(page_size*dcp_size, interleave_size*dcp_size))")
        if self.prefill_page_size is not None and (not _is_int(self.prefill_page_size) or self.prefill_page_size < 1):
            raise ValueError(f"prefill_page_size={self.prefill_page_size!r} (--prefill-page-size) must be an int >= 1")
        # The connector's bounds, here before any process starts (a rank's KVCacheSpec refused
        # them only once the job ran, reported as unverified bytes).
        check_layout_bounds(p, n, i, names=("--page-size", "--dcp-size", "--interleave-size"))
        check_layout_bounds(self.src_page_size, self.prefill_dcp_size, self.prefill_interleave_size,
                            names=("--prefill-page-size", "--prefill-dcp-size", "--prefill-interleave-size"))
        # Each decode rank announces its pages in one expect (rank 0 holds the most rows).
        try:
            check_expect_pages(int(local_len_np(self.prompt_tokens, n, 0, i)), p, self.prompt_tokens,
                               name="prompt_tokens")
        except ValueError as exc:
            raise ValueError(f"{exc} (--prompt-tokens, --page-size, --dcp-size)") from None
        if self.chunk_tokens is not None:
            if not _is_int(self.chunk_tokens) or self.chunk_tokens < 1:
                raise ValueError(f"chunk_tokens={self.chunk_tokens!r} (--chunk-tokens) must be an int >= 1 "
                                 "(None, the option left out: no chunking)")
            if self.chunk_tokens % p:
                raise ValueError(f"chunk_tokens={self.chunk_tokens} (--chunk-tokens) must be a multiple of page_size={p}")
            if self.chunk_tokens % self.src_page_size:
                raise ValueError(f"chunk_tokens={self.chunk_tokens} (--chunk-tokens) must be a multiple of "
                                 f"prefill_page_size={self.src_page_size}")
        if not self.modes or any(md not in PATHS for md in self.modes) or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes={self.modes!r} (--path) must be distinct names of {PATHS}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} (--engine) must be one of {ENGINES}")
        for name in ("max_batch_indices", "pack_tokens", "round_rows"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                left_out = "one window's index bucket" if name == "round_rows" else "no limit"
                raise ValueError(f"{name}={v!r} (--{name.replace('_', '-')}) must be an int >= 1 "
                                 f"(None, the option left out: {left_out})")
        if not _is_int(self.requests) or not 1 <= self.requests <= MAX_REQUESTS:
            raise ValueError(f"requests={self.requests!r} (--requests) must be an int in [1, {MAX_REQUESTS}]")
        check_job_timeout(self.timeout_s)
        if not self.pool_slack >= 1.0:
            raise ValueError(f"pool_slack={self.pool_slack!r} must be >= 1.0")
        for name in ("corrupt_rank", "die_rank"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v) and 0 <= v < self.dcp_size):
                raise ValueError(f"{name}={v!r} must be in [0, dcp_size={self.dcp_size})")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} (--device) must be one of {DEVICES}")
        if self.region_notify not in REGION_NOTIFIES:
            raise ValueError(f"region_notify={self.region_notify!r} (--region-notify) must be one of {REGION_NOTIFIES}")
        if self.region_notify != "auto" and (self.direction == "pull" or not {"region", "auto"} & set(self.modes)):
            # Only a pushed region window is told so: a run none of whose paths is would report a choice it ignored.
            raise ValueError(f"region_notify={self.region_notify!r} (--region-notify) applies to region pushes only: "
                             f"modes={self.modes!r} (--path{'' if self.modes != MODES else ', left out: the default paths'}), "
                             f"direction={self.direction!r} (--direction); "
                             + ("a pull ignores it" if self.direction == "pull" else "add --path region"))
        if not isinstance(self.mps, bool):
            raise ValueError(f"mps={self.mps!r} (--mps) must be a bool")
        if self.mps and self.device != "gpu":
            raise ValueError("mps=True (--mps) needs --device gpu: CUDA MPS shares a GPU between the job's processes")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction={self.direction!r} (--direction) must be one of {DIRECTIONS}")
        if self.staging not in STAGINGS:
            raise ValueError(f"staging={self.staging!r} (--staging) must be one of {STAGINGS}")
        if self.staged and self.modes == MODES:  # the defaults: the one path two staged sides take
            object.__setattr__(self, "modes", ("region",))
        if self.staged and not set(self.modes) <= {"region", "auto"}:
            raise ValueError(f"modes={self.modes!r} (--path): both sides stage (--staging {self.staging}), so the "
                             "decode KV is not registered and only the region path reaches it: use --path region")
        if "fused" in self.modes and (self.device != "gpu" or self.staged):
            # fused = one copy kernel writing through the ranks' CUDA IPC handles: device memory on one host
            raise ValueError(f"modes={self.modes!r} (--path fused) needs --device gpu without staging: the fused "
                             "path writes through CUDA IPC handles of the decode ranks' device memory")
        if self.device == "gpu" and self.engine == "jax-transfer" and self.staging == "none":
            raise ValueError("engine='jax-transfer' (--engine) moves host memory only: with --device gpu "
                             "use --staging auto or host (or --engine nixl / mooncake)")
        if self.pack_backend != "auto":
            from pallas_kernels.registry import get_backend

            try:
                b = get_backend(self.pack_backend)
            except ValueError as exc:
                raise ValueError(f"pack_backend={self.pack_backend!r} (--pack-backend): {exc}") from None
            # the sender packs every layer per window, at 64-byte aligned offsets (KVSender checks again)
            why = b.unavailable() or b.unsupported(tuple(int(il) for il in self.geometry.kv_item_lens), 0)
            if why is not None:
                raise ValueError(f"pack_backend={self.pack_backend!r} (--pack-backend) cannot run here: {why}")
        # engine="mooncake" with device="gpu" needs Mooncake's CUDA build (nvlink_intra); the
        # engine itself refuses VRAM with a clear RegistrationError on a host-only build.

    @property
    def geometry(self) -> ModelGeometry:
        return get_geometry(self.model)

    @property
    def engine_kind(self) -> str:
        """The engine kind the processes create: ``engine``, except that ``"auto"`` on the GPU is NIXL."""
        return "nixl" if self.device == "gpu" and self.engine == "auto" else self.engine

    @property
    def src_page_size(self) -> int:
        """Tokens per page on the prefill side (``prefill_page_size``, else ``page_size``)."""
        return self.page_size if self.prefill_page_size is None else self.prefill_page_size

    @property
    def staged(self) -> bool:
        """True when the KV stays in (unregistered) device memory and both sides stage through
        pinned host memory: ``staging="host"``, or ``"auto"`` where the engine cannot register
        the KV's memory (:func:`engine_registers`)."""
        if self.staging != "auto":
            return self.staging == "host"
        return not engine_registers(self.engine_kind, self.device)

    @property
    def shares_one_gpu(self) -> bool:
        """True on ``device="gpu"`` when every prefill and decode process runs on one GPU: no
        placement (all on visible GPU 0, `dcp_jax.job.gpus`), or both sides placed on the same one."""
        return self.device == "gpu" and len(set(self.prefill_gpus or (0,)) | set(self.decode_gpus or (0,))) == 1

    @property
    def sender_region_notify(self) -> str:
        """The senders' ``region_notify``: ``region_notify``, with "auto" resolved to "round"
        when `shares_one_gpu` (the decode ranks' unpacks time-slice with the copies) and the
        ranks are pushed to, else "write" (a pull ignores it)."""
        if self.region_notify != "auto":
            return self.region_notify
        return "round" if self.shares_one_gpu and self.direction == "push" else "write"

    @property
    def send_tokens(self) -> int:
        """Tokens actually sent: ``prompt_tokens - prefix_tokens``."""
        return self.prompt_tokens - self.prefix_tokens

    def chunks(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every chunk in absolute token positions, in order."""
        c = self.chunk_tokens or self.send_tokens
        return [(s, min(c, self.prompt_tokens - s)) for s in range(self.prefix_tokens, self.prompt_tokens, c)]

    def to_dict(self) -> dict:
        """Plain fields (what crosses the process boundary; ``JobConfig(**d)`` rebuilds it)."""
        return dataclasses.asdict(self)


def check_device(device: str) -> None:
    """Checks that ``device`` can run here.

    Raises:
        ValueError: unknown device, or ``"gpu"`` without CuPy or without a CUDA device; the
            message names the ``--device`` option.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} (--device) must be one of {DEVICES}")
    if device == "cpu":
        return
    try:
        import cupy as cp
    except Exception as exc:  # noqa: BLE001 - ImportError, or CuPy failing to load its CUDA libraries
        raise ValueError(f"device='gpu' (--device gpu) needs CuPy and a CUDA GPU, but CuPy does not import here "
                         f"({type(exc).__name__}: {exc}); install the gpu extra or use --device cpu") from None
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
        why = f"{count} CUDA devices"
    except Exception as exc:  # noqa: BLE001 - no driver: CUDARuntimeError
        count, why = 0, f"{type(exc).__name__}: {exc}"
    if count < 1:
        raise ValueError(f"device='gpu' (--device gpu) needs a CUDA GPU, found none ({why}); use --device cpu")
