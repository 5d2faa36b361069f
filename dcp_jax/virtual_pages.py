"""sglang's virtual pages (spec section 3): one shared table of virtual pages of ``P*N`` slots.

:func:`sglang_virtual_dst_pages` gives a rank's ``dst_pages`` for the send range,
:func:`virtual_page_rows` the rank and physical row of virtual slots. Moved out of
:mod:`dcp_jax.plan`, which re-exports every name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.layout import check_layout_args, local_index_np, owner_np
from dcp_jax.send_range import _check_prefix, _int_array, _pages

__all__ = ["sglang_virtual_dst_pages", "virtual_page_rows"]


# --------------------------------------------------------------------------------------------
# sglang's virtual pages (spec section 3).
# --------------------------------------------------------------------------------------------


def _check_virtual(page_size: Any, dcp_size: Any, interleave_size: Any) -> tuple[int, int, int]:
    page_size = _int("page_size", page_size, minimum=1)
    n, i, _ = check_layout_args(dcp_size, interleave_size)
    if page_size % i:
        # A virtual page of P*N slots gives every rank exactly P of them only if I divides P.
        raise ValueError(
            f"virtual pages need interleave_size to divide page_size, got {interleave_size=}, {page_size=}"
        )
    return page_size, n, i


def sglang_virtual_dst_pages(
    virtual_pages,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave_size: int = 1,
    decode_prefix_len: int = 0,
) -> np.ndarray:
    """Rank ``dcp_rank``'s page table for the send range under sglang's virtual-page convention.

    sglang's allocator hands out *virtual pages* of ``P*N`` token slots; virtual page ``q`` is
    physical page ``q`` on every rank, so one table serves all ranks. The table covers the
    request from position 0; the send range starts at ``decode_prefix_len`` (a multiple of
    ``P*N``), i.e. at virtual page ``decode_prefix_len // (P*N)``. The result is the
    ``dst_pages`` argument of :func:`build_token_transfer_plan` (the same for every rank).

    Args:
        virtual_pages: int ``[num_virtual_pages]`` the request's virtual page ids, >= 0.
        page_size: P (tokens per physical page; a virtual page has ``P*N`` slots).
        dcp_size: N.
        dcp_rank: r (validated; every rank gets the same table).
        interleave_size: I; must divide P.
        decode_prefix_len: tokens decode already holds, a multiple of ``P*N``.

    Returns:
        int64 ``[num_virtual_pages - decode_prefix_len // (P*N)]`` physical page ids.

    Raises:
        ValueError: negative ids, I not dividing P, misaligned ``decode_prefix_len``, bad sizes,
            or a table shorter than the prefix.
    """
    page_size, n, i = _check_virtual(page_size, dcp_size, interleave_size)
    check_layout_args(n, i, dcp_rank)
    decode_prefix_len = _check_prefix(decode_prefix_len, page_size, n, i)
    pages = _pages("virtual_pages", virtual_pages, page_size)
    skip = decode_prefix_len // (page_size * n)
    if skip > pages.size:
        raise ValueError(
            f"virtual_pages has {pages.size} pages but decode_prefix_len={decode_prefix_len} already spans {skip}"
        )
    return pages[skip:].copy()


def virtual_page_rows(
    virtual_slots, *, page_size: int, dcp_size: int, interleave_size: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Rank and physical row of sglang virtual slots ``q*P*N + i`` (``0 <= i < P*N``).

    The slot's position in its virtual page, ``i``, decides ownership as a token position would
    (virtual pages start at multiples of ``P*N`` tokens): rank ``owner(i)``, physical row
    ``q*P + local_index(i)``. With ``I = 1``: rank ``i % N``, row ``q*P + i // N``.

    Args:
        virtual_slots: int ``[n]`` virtual slot addresses (>= 0).
        page_size: P.
        dcp_size: N.
        interleave_size: I; must divide P.

    Returns:
        ``(ranks, rows)``, int64 ``[n]`` each.

    Raises:
        ValueError: negative slots, I not dividing P, bad sizes.

    Example:
        >>> virtual_page_rows([2 * 8 + 5], page_size=4, dcp_size=2)
        (array([1]), array([10]))
    """
    page_size, n, i = _check_virtual(page_size, dcp_size, interleave_size)
    slots = _int_array("virtual_slots", np.atleast_1d(np.asarray(virtual_slots)))
    if slots.size and slots.min() < 0:
        raise ValueError(f"virtual_slots must be >= 0, got min {int(slots.min())}")
    q, within = np.divmod(slots, page_size * n)
    return owner_np(within, n, i), q * page_size + local_index_np(within, n, i)
