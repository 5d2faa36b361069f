"""Knobs of one ``dcp-jax generate`` run, checked once (ValueError naming the option)."""
from __future__ import annotations

import dataclasses

from dcp_jax.job.config import MAX_RANKS, check_prefill_interleave
from dcp_jax.merge import MERGE_FORMS
from dcp_jax.transfer._worker import check_seconds
from dcp_jax.transfer.spec import check_layout_bounds

__all__ = ["GenerateConfig", "ENGINES", "TOLERANCES"]

ENGINES = ("nixl", "mooncake")
# dtype -> (relative logit tolerance, leading tokens that must equal the reference; None = all)
TOLERANCES = {"fp32": (1e-5, None), "bf16": (2e-2, 8)}


def _pos(name: str, v, low: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"--{name.replace('_', '-')}={v!r} must be an int >= {low}")


# The largest prompt a run takes: 4x the 32k-token TTFT run of benchmarks/results/generate_cpu.md.
MAX_PROMPT_TOKENS = 131_072
# The most new tokens a run takes: one decode step each on every rank, then again in the
# single-process reference (1e9 asked each rank for a 1.1 TB cache and died out of memory).
MAX_NEW_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """One disaggregated generation: prefill DCP-M processes -> decode DCP-N processes.

    Positions: the prompt has ``prompt_tokens`` tokens; the prefill computes and ships the KV of
    the first ``prompt_tokens - 1``; the first decode step consumes the last prompt token
    (appending its KV on its owner rank) and emits the first new token, so the time to first
    token is prefill + transfer + first decode step.
    """

    dcp_size: int = 2
    prompt_tokens: int = 3001
    new_tokens: int = 32
    engine: str = "nixl"
    dtype: str = "fp32"
    model: str = "mla"
    interleave_size: int = 1
    page_size: int = 16
    prefill_page_size: int | None = None  # None: the decode side's page_size
    prefill_dcp_size: int = 1
    prefill_interleave_size: int = 1
    merge: str = "ag_rs"
    seed: int = 0
    timeout_s: float = 600.0
    device: str = "cpu"  # gpu: decode rank r on GPU r (N GPUs), prefill and reference on GPU 0
    corrupt_rank: int | None = None  # test hook: that decode rank changes one received row

    def __post_init__(self):
        for name in ("dcp_size", "new_tokens", "interleave_size", "page_size", "prefill_dcp_size",
                     "prefill_interleave_size"):
            _pos(name, getattr(self, name))
        if self.prefill_page_size is not None:
            _pos("prefill_page_size", self.prefill_page_size)
        check_prefill_interleave(self.prefill_dcp_size, self.prefill_interleave_size)
        _pos("prompt_tokens", self.prompt_tokens, 2)
        if self.prompt_tokens > MAX_PROMPT_TOKENS:  # refused before any process allocates its KV
            raise ValueError(f"--prompt-tokens={self.prompt_tokens} must be <= {MAX_PROMPT_TOKENS:,} (the prefill "
                             "holds the whole prompt's activations and KV in one process)")
        if self.new_tokens > MAX_NEW_TOKENS:
            raise ValueError(f"--new-tokens={self.new_tokens} must be <= {MAX_NEW_TOKENS:,} (a decode step per "
                             "token on every rank, then again in the reference)")
        _pos("seed", self.seed, 0)
        if self.seed >= 2 ** 63:  # the ranks seed JAX and numpy with a C long
            raise ValueError(f"--seed={self.seed} must be < 2**63")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine={self.engine!r} must be one of {ENGINES}")
        if self.dtype not in TOLERANCES:
            raise ValueError(f"--dtype={self.dtype!r} must be one of {tuple(TOLERANCES)}")
        if self.model not in ("mla", "gqa"):
            raise ValueError(f"--model={self.model!r} must be mla or gqa")
        if self.merge not in MERGE_FORMS:
            raise ValueError(f"--merge={self.merge!r} must be one of {MERGE_FORMS}")
        if self.model_config().num_heads % self.dcp_size:
            raise ValueError(f"--dcp-size={self.dcp_size} must divide the model's "
                             f"{self.model_config().num_heads} heads")
        for name in ("dcp_size", "prefill_dcp_size"):  # as the transfer job: one process per rank
            if getattr(self, name) > MAX_RANKS:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be <= {MAX_RANKS} "
                                 "(one process per rank)")
        check_seconds("--timeout-s", self.timeout_s)  # the connector's own bound: (0, 86400]
        # The connector's layout bounds, before any process starts (a child refusing them at
        # start-up left the parent with a broken pipe and an empty exit 1).
        check_layout_bounds(self.page_size, self.dcp_size, self.interleave_size,
                            names=("--page-size", "--dcp-size", "--interleave-size"))
        check_layout_bounds(self.prefill_page, self.prefill_dcp_size, self.prefill_interleave_size,
                            names=("--prefill-page-size", "--prefill-dcp-size", "--prefill-interleave-size"))
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"--device={self.device!r} must be cpu or gpu")
        if self.corrupt_rank is not None and not 0 <= self.corrupt_rank < self.dcp_size:
            raise ValueError(f"--corrupt-rank={self.corrupt_rank} must lie in [0, {self.dcp_size})")

    @property
    def prefill_page(self) -> int:
        """Tokens per page on the prefill side (``prefill_page_size``, else ``page_size``)."""
        return self.page_size if self.prefill_page_size is None else self.prefill_page_size

    @property
    def kv_tokens(self) -> int:
        """Tokens the prefill ships (all prompt tokens but the last)."""
        return self.prompt_tokens - 1

    @property
    def total_tokens(self) -> int:
        """Tokens the decode side holds at the end (pages are drawn for all of them)."""
        return self.prompt_tokens + self.new_tokens

    def model_config(self):
        from dcp_jax.model.config import ModelConfig

        return ModelConfig(kind=self.model, dtype=self.dtype, seed=self.seed)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
