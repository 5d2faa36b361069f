"""Argument messages a fresh-user trial found wrong (2027): a float64 ``kv_lens`` named as the
float32 it was converted to, a uint64 token index printed wrapped negative, and "1 pages of 1
tokens are required" in the page-table messages of the planning layer."""
import jax
import numpy as np
import pytest

from dcp_jax import layout
from dcp_jax._validate import pages_required_text
from dcp_jax.attention import dcp_gqa_decode_emulated, dcp_mla_decode_emulated, paginate_kv
from dcp_jax.plan_mxn import build_mxn_transfer_plans
from dcp_jax.send_range import rows_from_page_table
from dcp_jax.transfer.schedule import SideLayout, token_rows

HUGE = 2**63 + 5


def _mla(kv_lens):
    rng = np.random.default_rng(5)
    ql, qr = (rng.standard_normal((2, 1, 4, d)).astype(np.float32) for d in (8, 4))
    kv = rng.standard_normal((2, 7, 12)).astype(np.float32)
    cache, pt = paginate_kv(kv, np.array(kv_lens), dcp_size=2, page_size=4)
    return ql, qr, cache, pt


def _gqa(kv_lens):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 7, 2, 8)).astype(np.float32)
    kc, pt = paginate_kv(k, np.array(kv_lens), dcp_size=2, page_size=4)
    return q, kc, pt


@pytest.mark.parametrize("form", ["mla", "gqa"])
def test_float64_kv_lens_and_page_table_are_named_as_given(form):
    # Before: "kv_lens must be integer, got kv_lens.dtype=dtype('float32')" (jnp.asarray's copy).
    if form == "mla":
        ql, qr, cache, pt = _mla([5, 7])
        call = lambda t, lens: dcp_mla_decode_emulated(ql, qr, cache, t, lens, softmax_scale=0.3)  # noqa: E731
    else:
        q, kc, pt = _gqa([5, 7])
        call = lambda t, lens: dcp_gqa_decode_emulated(q, kc, kc, t, lens, softmax_scale=0.3)  # noqa: E731
    with pytest.raises(TypeError, match=r"^kv_lens must be integer, got kv_lens.dtype=float64$"):
        call(pt, np.array([5, 7], np.float64))
    with pytest.raises(TypeError, match=r"^kv_lens must be integer, got kv_lens.dtype=float64$"):
        call(pt, [5.0, 7.0])
    with pytest.raises(TypeError, match=r"^page_table must be integer, got page_table.dtype=float64$"):
        call(np.asarray(pt, np.float64), np.array([5, 7]))
    with pytest.raises(TypeError, match=r"^kv_lens must be integer, got kv_lens.dtype=float32"):
        jax.jit(call)(pt, np.array([5, 7], np.float32))  # traced: the tracer's dtype, as given


@pytest.mark.parametrize("fn, args, name", [
    (layout.owner_np, (2,), "t"),
    (layout.local_index_np, (2,), "t"),
    (lambda x, *a: layout.local_len_np(x, 2, 0), (), "length"),
    (lambda x, *a: layout.count_np(0, x, 2, 0), (), "length"),
])
def test_uint64_token_index_past_int64_is_printed_as_given(fn, args, name):
    # Before: "t must be >= 0, got min t=-9223372036854775803" (the value wrapped through int64).
    with pytest.raises(ValueError, match=rf"^{name} must hold values <= 2\*\*63 - 1 \(int64\), got {name}\[1\]={HUGE}$"):
        fn(np.array([3, HUGE], np.uint64), *args)
    with pytest.raises(ValueError, match=rf"got {name}={HUGE}$"):  # a scalar: no index
        fn(np.uint64(HUGE), *args)
    with pytest.raises(ValueError, match=rf"got {name}={HUGE}$"):
        fn(HUGE, *args)  # a Python int numpy holds as uint64
    assert int(np.asarray(fn(np.array([7], np.uint64), *args)).ravel()[0]) >= 0  # small uint64: fine


def test_pages_required_wording():
    assert pages_required_text(1, 4) == "1 page of 4 tokens is required"
    assert pages_required_text(2, 1) == "2 pages of 1 token are required"
    assert pages_required_text(1) == "1 page is required"


def test_page_table_messages_agree_in_number():
    # Before: "too few pages: 1 pages of 4 tokens are required for local row 0, got 0".
    with pytest.raises(ValueError, match=r"too few pages: 1 page of 4 tokens is required for local row 0, got 0"):
        rows_from_page_table([0], [], 4)
    with pytest.raises(ValueError, match=r"too few pages: 2 pages of 4 tokens are required for local row 4, got 1"):
        rows_from_page_table([4], [0], 4)
    with pytest.raises(ValueError, match=r"page_table is too short: 1 page of 4 tokens is required for local row 2"):
        token_rows(np.array([2]), SideLayout(1, 0, 1, 4), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match=r"too few pages in dst_page_tables\[1\]: 1 page of 4 tokens is required "
                                         r"for local row 0, got 0"):
        build_mxn_transfer_plans([[0]], [[0], []], page_size=4, prefill_dcp_size=1, dcp_size=2, num_kv_tokens=2)


def test_int_arguments_take_0d_integer_arrays_and_refuse_0d_float_ones():
    """np.array(8) (a numpy reduction's result) was refused as 'got ndarray' (final trial)."""
    from dcp_jax._validate import check_int, check_int_type

    for v in (np.array(8), np.array(8, np.uint16), np.int64(8), 8):
        assert check_int_type("num_tokens", v) == 8 and type(check_int_type("num_tokens", v)) is int
    assert check_int("pack_bytes", np.array(4096), minimum=1) == 4096
    for bad in (np.array(8.0), np.array([8]), np.array(True)):
        with pytest.raises(TypeError, match="num_tokens must be an int"):
            check_int_type("num_tokens", bad)
