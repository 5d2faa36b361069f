"""`KVCacheSpec`: the KV cache geometry one side of a transfer declares, and the handshake check.

Each side (the prefill `KVSender`, every decode `KVReceiver`) describes its own paged cache.
At ``receiver.connect`` both specs cross the control plane and `check_compatible` refuses any
pair the transfer cannot serve, naming the field and both values, before any byte moves.

Conventions (``docs/conventions.md`` sections 2, 3 and 10): ``kv_layers[l]`` is
``[num_pages, page_size, item]`` with ``item_lens[l]`` bytes per token; the decode rank
``dcp_rank`` of ``dcp_size`` owns token ``t`` iff ``(t // interleave_size) % dcp_size == dcp_rank``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dcp_jax._validate import check_int

__all__ = ["KVCacheSpec", "HandshakeError", "check_compatible", "check_layout_bounds", "dtype_name",
           "MAX_DCP_SIZE", "MAX_TP_SIZE", "MAX_LAYERS", "MAX_PAGE_SIZE"]

MAX_DCP_SIZE = 1024      # DCP groups beyond this are not a serving configuration
MAX_TP_SIZE = 1024       # likewise; the head plan loops over both sides' TP ranks (a peer's hello sets one)
MAX_LAYERS = 4096        # layer entries per cache (one per layer for MLA; more for hybrid models)
MAX_ITEM_LEN = 1 << 24   # bytes per token per layer entry (16 MiB)
MAX_PAGE_SIZE = 1 << 20  # tokens per page (engines use 16..2048)
_INT32_MAX = (1 << 31) - 1


class HandshakeError(ValueError):
    """Two sides cannot be connected: one field differs or a geometry cannot be served.

    Attributes:
        field: the field that decided it (``"num_layers"``, ``"item_lens"``, ``"version"``, ...).
        ours: this side's value (None with ``theirs`` None: no two values, ``detail`` says why).
        theirs: the peer's value.
        detail: why, beyond the two values ("" when they say it all).
    """

    def __init__(self, field: str, ours: Any, theirs: Any, detail: str = ""):
        self.field, self.ours, self.theirs, self.detail = field, ours, theirs, detail
        if ours is None and theirs is None:  # not two values that differ: a refusal with its reason
            msg = f"handshake refused ({field})"
        else:
            msg = f"handshake refused: {field} differs (this side {ours!r}, peer {theirs!r})"
        super().__init__(msg + (f": {detail}" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.field, self.ours, self.theirs, self.detail))


# Element types numpy does not name but ml_dtypes (JAX) and torch do, with the same spelling.
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4")


def check_layout_bounds(page_size: int, dcp_size: int, interleave_size: int, *,
                        names: tuple[str, str, str] = ("page_size", "dcp_size", "interleave_size")) -> None:
    """The connector's bounds on one side's layout, for callers that size processes or plans
    from it before any `KVCacheSpec` exists (the job, ``generate``): ``page_size`` at most
    `MAX_PAGE_SIZE` tokens (page x row byte offsets stay far inside int64) and
    ``interleave_size * dcp_size`` within int32 (the owner formula's ``t // I % N`` runs in
    int32 on device). Ints >= 1 are the caller's to check first.

    Raises:
        ValueError: naming the argument as ``names`` spells it (e.g. ``"page_size (--page-size)"``).
    """
    if page_size > MAX_PAGE_SIZE:
        raise ValueError(f"{names[0]}={page_size} must be <= {MAX_PAGE_SIZE} tokens")
    if interleave_size * dcp_size > _INT32_MAX:
        raise ValueError(f"{names[2]} * {names[1]} = {interleave_size} * {dcp_size} exceeds int32 "
                         f"({_INT32_MAX})")


def dtype_name(dtype) -> str:
    """The element type name of ``dtype``: a name (``"bfloat16"``) as given; a numpy dtype or
    scalar type (``np.float16``), an ml_dtypes / JAX one (``jnp.bfloat16``) or a torch dtype
    (``torch.float8_e4m3fn``) as its canonical name, which the other side compares.

    Raises:
        TypeError: ``dtype`` names no element type (the message names ``dtype``).
        ValueError: a numpy dtype of the other byte order (``">f2"`` on this machine): its name
            would hide that its bytes differ from the native ones of that name.
    """
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch.") and type(dtype).__module__ == "torch":  # torch.dtype: "torch.float16"
        return text[len("torch."):]
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"dtype must be an element type name or a numpy / ml_dtypes / torch dtype, got {dtype!r}") from None
    if not dt.isnative:
        raise ValueError(f"dtype={dtype!r} is not in this machine's byte order: the bytes would move as they are "
                         f"but read as {dt.name} differently")
    return dt.name


def _known_dtype(name: str) -> bool:
    """True for a canonical element type name (``"float32"``, not ``"f4"``)."""
    if name in _ML_DTYPES:
        return True
    try:
        dt = np.dtype(name)
    except TypeError:
        return False
    return dt.name == name and dt.kind in "biufc"


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache one side of a transfer holds.

    Attributes:
        num_layers: layer entries (registered KV buffers), >= 1.
        item_lens: bytes per token of each layer entry, ``num_layers`` ints > 0 (DeepSeek-V3
            MLA bf16: 576 x 2 = 1152).
        page_size: tokens per page, 1..2**20.
        dcp_size: this side's DCP group size (prefill M, decode N), 1..`MAX_DCP_SIZE`.
        dcp_rank: this side's rank in it, ``0 <= dcp_rank < dcp_size``.
        interleave_size: tokens per ownership block I (1 = token round-robin), >= 1.
        dtype: element type name of the cache (``"bfloat16"``, ``"float8_e4m3fn"``, ...), or a
            numpy, ml_dtypes/JAX or torch dtype (``np.float16``, ``jnp.bfloat16``,
            ``torch.bfloat16``: kept as its name, `dtype_name`); bytes move as bytes, but both
            sides must agree on what they mean.
        layout: cache layout name (``"mla"``: one latent row per token; or a name of
            `dcp_jax.hetero.layouts.LAYOUTS`, ``"nhd"``, ``"hnd"``, ``"tpu_gqa"``, ``"tpu_mla"``, whose
            ``kv_layers[l]`` have that layout's shape, `dcp_jax.hetero.layouts.cache_shape`). Any
            other name is a label both sides must spell alike (adapters tag their engine's cache
            this way, e.g. ``"vllm-cpu-LBHNC/token"``): the pair moves whole rows, and the
            handshake refuses two different labels.
        tp_size, tp_rank: tensor-parallel size (1..`MAX_TP_SIZE`) and rank; with ``tp_size > 1`` on either side
            (or differing layouts) the pair moves the heads both ranks hold (`dcp_jax.transfer.views`).
        num_kv_heads: KV heads of the model (MLA: 1, the latent), >= 1; head_dim: elements per
            head, >= 1, or None (the whole row: MLA's latent). `dcp_jax.hetero.plan.HeteroSide`
            takes the same names; both sides must agree.

    Raises:
        TypeError: a field has the wrong type (the message names it).
        ValueError: a value is out of range, or ``len(item_lens) != num_layers``. Item lengths
            are bytes whatever ``dtype`` says (the DCP spec, section 10: "any dtype; bytes are
            what move"), so an odd length under the default bfloat16 is accepted.
    """

    num_layers: int
    item_lens: tuple[int, ...]
    page_size: int
    dcp_size: int = 1
    dcp_rank: int = 0
    interleave_size: int = 1
    dtype: str = "bfloat16"
    layout: str = "mla"
    tp_size: int = 1
    tp_rank: int = 0
    num_kv_heads: int = 1
    head_dim: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        set_("num_layers", check_int("num_layers", self.num_layers, minimum=1))
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"num_layers={self.num_layers} must be <= {MAX_LAYERS}")
        if isinstance(self.item_lens, (str, bytes, set, frozenset, dict)) or not hasattr(self.item_lens, "__len__"):
            raise TypeError(f"item_lens must be a sequence of ints (bytes per token), one per layer entry in "
                            f"order, got {type(self.item_lens).__name__}")
        lens = tuple(check_int(f"item_lens[{k}]", v, minimum=1) for k, v in enumerate(self.item_lens))
        if len(lens) != self.num_layers:
            raise ValueError(f"item_lens has {len(lens)} entries, num_layers={self.num_layers}")
        if max(lens) > MAX_ITEM_LEN:
            raise ValueError(f"item_lens: {max(lens)} bytes per token exceeds {MAX_ITEM_LEN}")
        set_("item_lens", lens)
        set_("page_size", check_int("page_size", self.page_size, minimum=1))
        set_("dcp_size", check_int("dcp_size", self.dcp_size, minimum=1))
        if self.dcp_size > MAX_DCP_SIZE:
            raise ValueError(f"dcp_size={self.dcp_size} must be <= {MAX_DCP_SIZE}")
        set_("dcp_rank", check_int("dcp_rank", self.dcp_rank, minimum=0))
        if self.dcp_rank >= self.dcp_size:
            raise ValueError(f"dcp_rank={self.dcp_rank} must be < dcp_size={self.dcp_size}")
        set_("interleave_size", check_int("interleave_size", self.interleave_size, minimum=1))
        check_layout_bounds(self.page_size, self.dcp_size, self.interleave_size)
        set_("tp_size", check_int("tp_size", self.tp_size, minimum=1))
        if self.tp_size > MAX_TP_SIZE:
            raise ValueError(f"tp_size={self.tp_size} must be <= {MAX_TP_SIZE}")
        set_("tp_rank", check_int("tp_rank", self.tp_rank, minimum=0))
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be < tp_size={self.tp_size}")
        set_("num_kv_heads", check_int("num_kv_heads", self.num_kv_heads, minimum=1))
        if self.head_dim is not None:
            set_("head_dim", check_int("head_dim", self.head_dim, minimum=1))
        if self.dtype is not None:  # None stays: the check below names it
            set_("dtype", dtype_name(self.dtype))
        for name in ("dtype", "layout"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or len(v) > 64:
                raise TypeError(f"{name} must be a non-empty string of at most 64 characters, got {v!r}")
        if not _known_dtype(self.dtype):
            raise ValueError(f"dtype={self.dtype!r} is not an element type name numpy, ml_dtypes or torch use "
                             f"(e.g. {', '.join(map(repr, _ML_DTYPES[:3]))}, 'float16', 'float32', 'uint8')")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token over every layer entry, ``sum(item_lens)``."""
        return sum(self.item_lens)

    @property
    def group_size(self) -> int:
        """Ranks of this side's group over DCP and TP, ``dcp_size * tp_size``."""
        return self.dcp_size * self.tp_size

    @property
    def group_rank(self) -> int:
        """This rank in that group, ``tp_rank * dcp_size + dcp_rank`` (``dcp_rank`` without TP):
        the key a sender files a decode rank under."""
        return self.tp_rank * self.dcp_size + self.dcp_rank

    def to_dict(self) -> dict[str, Any]:
        """Plain-type dict (msgpack-able): what crosses the control plane at the handshake."""
        d = dataclasses.asdict(self)
        d["item_lens"] = list(self.item_lens)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "KVCacheSpec":
        """Builds (and validates) a spec from `to_dict` output received from a peer.

        Raises:
            TypeError, ValueError: not a dict, unknown or missing keys, or invalid values.
        """
        if not isinstance(d, dict):
            raise TypeError(f"spec must be a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"spec has unknown fields {sorted(map(str, unknown))}")
        return cls(**d)


def check_compatible(prefill: KVCacheSpec, decode: KVCacheSpec, *, side: str = "prefill") -> None:
    """Refuses a (prefill, decode) pair the transfer cannot serve.

    The rows move as bytes: both sides must hold the same layer entries of the same sizes,
    dtype, layout, TP size and heads. Any page sizes, DCP sizes and interleaves on either side are
    served (``dcp_jax.transfer.schedule`` maps every token between them). A pair whose layouts
    differ, with ``tp_size > 1`` on a side, or in a layout that splits a token's row (``nhd``,
    ``hnd``) moves head pieces (`dcp_jax.transfer.views.uses_views`): there
    ``item_lens``, ``layout`` and ``tp_size`` may differ, and `views.check_view_pair` decides.

    Args:
        prefill: the sender's spec.
        decode: the receiver's spec.
        side: which one is "this side" in the message (``"prefill"`` or ``"decode"``).

    Raises:
        HandshakeError: the first field that differs, with both values.
    """
    ours, theirs = (prefill, decode) if side == "prefill" else (decode, prefill)
    from dcp_jax.transfer.views import check_view_pair, uses_views  # views import this module
    if uses_views(prefill, decode):  # TP or layout differ: head pieces through both layouts
        try:
            check_view_pair(prefill, decode)
        except HandshakeError as exc:
            if side == "prefill" or exc.ours is None:
                raise
            raise HandshakeError(exc.field, exc.theirs, exc.ours, exc.detail) from None
        return
    # page_size may differ: the schedule maps every token through each side's own page table
    # and page size (runs split at the smaller page boundary), every path byte-exact.
    for field in ("num_layers", "item_lens", "dtype", "layout", "tp_size", "num_kv_heads", "head_dim"):
        a, b = getattr(ours, field), getattr(theirs, field)
        if a != b:
            raise HandshakeError(field, a, b, _WHY.get(field, ""))


_WHY = {
    "dtype": "the KV caches hold different element types; the connector moves bytes and never "
             "converts them (cast one side's cache, or declare the dtype its bytes really are)",
    "item_lens": "a token's bytes differ per layer entry: the rows would not line up",
    "layout": "the caches are laid out differently; the connector's rows need one layout on both sides",
    "tp_size": "a TP split on one side only needs the heterogeneous plan (dcp_jax.hetero); the connector's rows are whole",
    "num_kv_heads": "the two sides describe different models",
    "head_dim": "the two sides describe different models",
}
