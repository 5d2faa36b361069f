"""Cross-check ``dcp_jax.merge`` against a PyTorch DCP combine written in the project.

The PyTorch reference follows the conventions of vLLM's and sglang's DCP combine (facts, not
code): natural-log LSE, token-major ``[T, H]``; the LSEs of all ranks are all-gathered to
``[N, T, H]``; each rank scales its partial output by ``exp(lse_r - lse)``; a reduce-scatter over
heads leaves rank r with heads ``[r*H/N, (r+1)*H/N)`` (AG+RS). Empty shards (``-inf`` / ``+inf`` /
NaN LSE) contribute zero; all-empty gives ``out = 0``, ``lse = -inf``.

Our side receives the torch tensors by DLPack (zero-copy on GPU: the JAX array aliases the torch
memory), runs the merge, and the two results are compared in float64 on the host.

torch is imported lazily: this module imports without it; the functions that need it raise
``ModuleNotFoundError`` with an install hint.

Run ``python -m dcp_jax.crosscheck`` for a printed report on random and edge-case inputs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax import merge as _merge

__all__ = [
    "CrosscheckReport",
    "FORMS",
    "crosscheck_merge",
    "edge_case_inputs",
    "from_torch",
    "torch_ag_rs_reference",
    "torch_merge_reference",
]

FORMS = ("flat",) + _merge.MERGE_FORMS


def _torch():
    try:
        import torch
    except ModuleNotFoundError as e:  # optional dependency
        raise ModuleNotFoundError(
            "dcp_jax.crosscheck needs PyTorch: pip install 'dcp-jax[torch]' (torch==2.11.0)"
        ) from e
    return torch


def _check_torch_pair(out, lse):
    torch = _torch()
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError(
            f"out and lse must be torch.Tensor, got {type(out).__name__} and {type(lse).__name__}"
        )
    if out.ndim != 4 or lse.ndim != 3 or tuple(lse.shape) != tuple(out.shape[:3]):
        raise ValueError(
            f"need out [N, T, H, D] and lse [N, T, H], got out.shape={tuple(out.shape)} "
            f"lse.shape={tuple(lse.shape)}"
        )
    if not (out.is_floating_point() and lse.is_floating_point()):
        raise TypeError(f"out and lse must be floating, got {out.dtype=} {lse.dtype=}")
    return torch


# --------------------------------------------------------------------------------------------
# PyTorch reference (vLLM / sglang DCP combine conventions)
# --------------------------------------------------------------------------------------------


def _torch_lse_and_factors(lse):
    """lse f32[N, T, H] natural log -> (merged lse [T, H], per-rank factors [N, T, H])."""
    torch = _torch()
    neg_inf = torch.tensor(float("-inf"), dtype=lse.dtype, device=lse.device)
    valid = torch.isfinite(lse)
    lse = torch.where(valid, lse, neg_inf)
    m = lse.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    sumexp = torch.exp(lse - m).sum(dim=0)
    merged = torch.where(sumexp > 0, m + torch.log(sumexp), neg_inf)
    ok = valid & torch.isfinite(merged)
    # exp(lse_r - lse) grouped as exp((lse_r - m) - log(sumexp)): subtracting the pivot first
    # keeps float32 rounding of a large |lse| (ulp(60) = 4e-6) out of the exponent.
    log_sum = torch.where(sumexp > 0, torch.log(sumexp), torch.zeros_like(sumexp))
    factors = torch.where(ok, torch.exp((lse - m) - log_sum), torch.zeros_like(lse))
    return merged, factors


def _compute_dtype(dtype):
    """float32 arithmetic, or float64 for a float64 input (then the reference is an oracle)."""
    torch = _torch()
    return torch.promote_types(dtype, torch.float32)


def torch_ag_rs_reference(out, lse):
    """PyTorch AG+RS DCP combine, simulated for all N ranks in one process.

    Args:
      out: torch [N, T, H, D] partial outputs (rank r's is ``out[r]``), any float dtype.
      lse: torch f32[N, T, H] natural-log LSEs (what the all-gather of the LSEs yields).
        Arithmetic in float32, or float64 when ``out`` is float64.

    Returns:
      A list of N pairs ``(out_r [T, H/N, D] in out's dtype, lse_r [T, H/N] in the compute
      dtype)``: what rank r holds after the reduce-scatter over heads.

    Raises:
      TypeError / ValueError: not torch tensors, bad shapes, ``H % N != 0``.
    """
    torch = _check_torch_pair(out, lse)
    n, _, h, _ = out.shape
    if h % n != 0:
        raise ValueError(f"heads H={h} must divide by N={n} for AG+RS")
    ct = _compute_dtype(out.dtype)
    merged, factors = _torch_lse_and_factors(lse.to(ct))
    # Each rank corrects its own partial; a zero factor selects 0 (0 * NaN would be NaN).
    f = factors.unsqueeze(-1)
    corrected = torch.where(f > 0, out.to(ct) * f, torch.zeros((), dtype=ct, device=out.device))
    reduced = corrected.sum(dim=0)  # the reduction half of the reduce-scatter
    hs = h // n
    return [
        (reduced[:, r * hs:(r + 1) * hs].to(out.dtype), merged[:, r * hs:(r + 1) * hs])
        for r in range(n)
    ]


def torch_merge_reference(out, lse):
    """PyTorch DCP combine of N partials, all heads: the AG+RS slices concatenated over heads.

    Args:
      out: torch [N, T, H, D]; lse: torch f32[N, T, H] natural log.

    Returns:
      ``(out [T, H, D] in out's dtype, lse f32[T, H])``. For ``H % N != 0`` (no head split
      possible) the merge is done without slicing.
    """
    torch = _check_torch_pair(out, lse)
    n, _, h, _ = out.shape
    if h % n == 0:
        parts = torch_ag_rs_reference(out, lse)
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    ct = _compute_dtype(out.dtype)
    merged, factors = _torch_lse_and_factors(lse.to(ct))
    f = factors.unsqueeze(-1)
    zero = torch.zeros((), dtype=ct, device=out.device)
    return torch.where(f > 0, out.to(ct) * f, zero).sum(dim=0).to(out.dtype), merged


# --------------------------------------------------------------------------------------------
# Our side and the comparison
# --------------------------------------------------------------------------------------------


def from_torch(t) -> jax.Array:
    """A JAX array viewing a torch tensor through DLPack (zero-copy on GPU; CPU copies only
    when the pointer is not 64-byte aligned). Non-contiguous tensors are made contiguous first.
    """
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return jnp.from_dlpack(t.detach().contiguous())


@dataclasses.dataclass(frozen=True)
class CrosscheckReport:
    """Errors of our merge against the PyTorch reference (both in the input dtype).

    Attributes:
      form: "flat" (``merge_states``) or a collective form ("ag_rs", "ag_ar", "a2a").
      shape: ``(N, T, H, D)`` of the stacked input.
      dtype: the output dtype, as a string.
      max_abs_err: ``max |ours - ref|`` over out (inf if ours has a NaN the reference lacks).
      max_rel_err: ``max_abs_err / max |ref|`` (normwise relative error of out).
      lse_max_abs_err: ``max |ours - ref|`` over the finite LSEs.
      lse_max_rel_err: ``lse_max_abs_err / max(1, max |ref lse|)``.
      lse_inf_mismatch: entries where exactly one side's LSE is -inf (must be 0).
      nan_count: NaNs in our out and lse (must be 0).
      zero_copy: our input array aliases the torch memory (pointer equal).
    """

    form: str
    shape: tuple[int, int, int, int]
    dtype: str
    max_abs_err: float
    max_rel_err: float
    lse_max_abs_err: float
    lse_max_rel_err: float
    lse_inf_mismatch: int
    nan_count: int
    zero_copy: bool

    def passed(self, tol: float) -> bool:
        """True when out and lse agree within ``tol`` (relative) with no NaN / -inf mismatch."""
        return (self.max_rel_err <= tol and self.lse_max_rel_err <= tol
                and self.lse_inf_mismatch == 0 and self.nan_count == 0)

    def __str__(self) -> str:
        n, t, h, d = self.shape
        return (f"{self.form:5s} N={n} T={t} H={h} D={d} {self.dtype:8s} "
                f"out: abs {self.max_abs_err:.3e} rel {self.max_rel_err:.3e} | "
                f"lse: abs {self.lse_max_abs_err:.3e} rel {self.lse_max_rel_err:.3e} "
                f"-inf mismatch {self.lse_inf_mismatch} | NaN {self.nan_count} | "
                f"zero-copy {self.zero_copy}")


def _pointer(x) -> int | None:
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # sharded or deleted arrays have no single pointer
        return None


def crosscheck_merge(out, lse, *, form: str = "flat", base: str = "e", mesh=None) -> CrosscheckReport:
    """Runs our merge on torch inputs (by DLPack) and compares it with the PyTorch reference.

    Args:
      out: torch [N, T, H, D] partial outputs (float32, bf16 or f16; CPU or CUDA).
      lse: torch f32[N, T, H] LSEs, token-major, in ``base``.
      form: "flat" (``merge_states``), or "ag_rs" / "ag_ar" / "a2a" on ``mesh``.
      base: "e" (default) or "2"; the reference works in natural log, so base-2 LSEs are
        converted for it (``lse * ln 2``) and its result converted back.
      mesh: for collective forms, a mesh with a "dcp" axis of size N (default: the first N
        devices).

    Returns:
      A :class:`CrosscheckReport`.

    Raises:
      ValueError: bad ``form`` / ``base`` / shapes; TypeError: inputs not torch tensors.
    """
    _check_torch_pair(out, lse)
    if form not in FORMS:
        raise ValueError(f"{form=} must be one of {FORMS}")
    base = _merge._check_base(base)
    out_j, lse_j = from_torch(out), from_torch(lse)
    zero_copy = _pointer(out_j) == out.data_ptr()
    if form == "flat":
        o, l = _merge.merge_states(out_j, lse_j, base=base)
    else:
        fn = {"ag_rs": _merge.ag_rs, "ag_ar": _merge.ag_ar, "a2a": _merge.a2a}[form]
        o, l = fn(out_j, lse_j, base=base, mesh=mesh)
    o = np.asarray(jnp.asarray(o, jnp.float32), dtype=np.float64)
    l = np.asarray(l, dtype=np.float64)

    ln2 = math.log(2.0)
    lse_ref_in = lse.float() * ln2 if base == "2" else lse.float()
    ro_t, rl_t = torch_merge_reference(out, lse_ref_in)
    ro = ro_t.float().cpu().numpy().astype(np.float64)
    rl = rl_t.cpu().numpy().astype(np.float64)
    if base == "2":
        rl = rl / ln2

    nan_count = int(np.isnan(o).sum() + np.isnan(l).sum())
    diff = np.abs(o - ro)
    max_abs = float(np.max(np.where(np.isnan(diff), np.inf, diff), initial=0.0))
    scale = float(np.max(np.abs(ro), initial=0.0))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    inf_mismatch = int(np.sum(np.isneginf(l) != np.isneginf(rl)))
    fin = np.isfinite(l) & np.isfinite(rl)
    lse_abs = float(np.max(np.abs(l[fin] - rl[fin]), initial=0.0))
    lse_rel = lse_abs / max(1.0, float(np.max(np.abs(rl[fin]), initial=0.0)))
    return CrosscheckReport(
        form=form, shape=tuple(int(s) for s in out.shape), dtype=str(out.dtype).replace("torch.", ""),
        max_abs_err=max_abs, max_rel_err=max_rel, lse_max_abs_err=lse_abs,
        lse_max_rel_err=lse_rel, lse_inf_mismatch=inf_mismatch, nan_count=nan_count,
        zero_copy=bool(zero_copy),
    )


def edge_case_inputs(n: int = 8, t: int = 4, h: int = 16, d: int = 8, *, seed: int = 0,
                     dtype=None, device: str = "cpu"):
    """Random torch partials with every edge case planted (for tests and the CLI).

    Whole empty ranks (LSE -inf / +inf / NaN with NaN outputs), an all-empty (token, head), a
    single live shard, and a spread of 60 in LSE (exp overflow without the max pivot).

    Returns:
      ``(out torch[N, T, H, D] in dtype (default float32), lse torch f32[N, T, H])``.
    """
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, t, h, d, generator=g)
    lse = torch.randn(n, t, h, generator=g) * 20.0
    if n > 1:
        lse[1] = float("-inf")
        out[1] = float("nan")
    if n > 3:
        lse[2, :, : h // 2] = float("nan")
        lse[3, 1] = float("inf")
        out[2, :, : h // 2] = float("nan")
        out[3, 1] = float("nan")
    lse[:, 0, 0] = float("-inf")
    out[:, 0, 0] = float("nan")
    if t > 2:
        lse[1:, 2, 1] = float("-inf")  # only rank 0 is live here
        out[1:, 2, 1] = float("nan")
    out = out.to(dtype or torch.float32).to(device)
    return out, lse.to(device)


def main() -> None:  # pragma: no cover - exercised by hand / on the GPU machine
    torch = _torch()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Collective forms need N devices; a single GPU runs the flat merge with N = 8 partials.
    n = 8
    forms = FORMS if len(jax.devices()) >= n else ("flat",)
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            out = torch.randn(n, 64, 16, 32, generator=g).to(dtype).to(device)
            lse = (torch.randn(n, 64, 16, generator=g) * 5).to(device)
            for form in forms:
                print(crosscheck_merge(out, lse, form=form))
        out, lse = edge_case_inputs(n, dtype=dtype, device=device)
        for form in forms:
            print(crosscheck_merge(out, lse, form=form), "(edge cases)")


if __name__ == "__main__":  # pragma: no cover
    main()
