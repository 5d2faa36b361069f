"""Zero-width states (H = 0, D = 0) in the collective merges and the DCP attention forms.

XLA:CPU's collectives crash the process (SIGSEGV) on a zero-width operand, and ``psum_scatter``
over 0 heads fails MLIR verification; the forms must refuse them at trace time with a
``ValueError`` naming the argument. In-process checks go through ``jax.eval_shape`` (tracing
only, nothing executes), so a regressed check fails the test instead of killing pytest; the one
test that calls the forms for real runs them in a child process.
"""

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dcp_jax.attention import (
    dcp_gqa_decode,
    dcp_gqa_decode_emulated,
    dcp_mla_decode,
    dcp_mla_decode_emulated,
)
from dcp_jax.merge import (
    MERGE_FORMS,
    a2a,
    ag_ar,
    ag_rs,
    local_merge_fn,
    make_dcp_mesh,
    merge_states,
    merge_states_reference,
)

pytestmark = pytest.mark.needs_8_devices

FORMS = {"ag_rs": ag_rs, "ag_ar": ag_ar, "a2a": a2a}
f32 = np.float32


def _spec(shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("form", MERGE_FORMS)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("h, d", [(4, 0), (0, 4), (0, 0)], ids=["D=0", "H=0", "H=D=0"])
def test_mesh_forms_refuse_zero_width_naming_out(form, n, h, d):
    fn = FORMS[form]
    with pytest.raises(ValueError, match=r"\bout\b.*H >= 1, D >= 1"):
        jax.eval_shape(lambda o, l: fn(o, l, mesh=make_dcp_mesh(n)),
                       _spec((n, 3, h, d)), _spec((n, 3, h)))


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_local_forms_refuse_zero_width_at_trace_time(form):
    local = local_merge_fn(form)
    f = jax.shard_map(lambda o, l: local(o[0], l[0], axis_name="dcp"), mesh=make_dcp_mesh(2),
                      in_specs=(P("dcp"), P("dcp")), out_specs=(P(), P()), check_vma=False)
    for h, d in [(2, 0), (0, 2)]:
        with pytest.raises(ValueError, match=rf"merge_{form}: out needs"):
            jax.eval_shape(f, _spec((2, 3, h, d)), _spec((2, 3, h)))


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_zero_tokens_still_give_empty_results(form):
    # T = 0 reaches the collectives fine (the attention forms' B = 0 / Q = 0 rely on it).
    o, l = FORMS[form](np.zeros((2, 0, 4, 3), f32), np.zeros((2, 0, 4), f32))
    assert o.shape == (0, 4, 3) and l.shape == (0, 4)


def test_merge_states_takes_zero_widths():
    rng = np.random.default_rng()
    for shape in [(3, 2, 4, 0), (3, 2, 0, 5), (3, 0, 4, 5)]:
        out = rng.standard_normal(shape).astype(f32)
        lse = rng.standard_normal(shape[:3]).astype(f32)
        o, l = merge_states(out, lse)
        ref_o, ref_l = merge_states_reference(out, lse)
        assert o.shape == ref_o.shape and l.shape == ref_l.shape
        # atol: a float32 lse is good to a few ulps of its inputs' scale, so an lse near 0
        # (seen: 0.0287, off by 5e-8) fails a purely relative check.
        np.testing.assert_allclose(np.asarray(l), ref_l, rtol=1e-6, atol=1e-6)


def _mla_specs(dl, dr, *, n=2, h=2):
    return (_spec((1, 1, h, dl)), _spec((1, 1, h, dr)), _spec((n, 1, 4, dl + dr)),
            _spec((n, 1, 1), np.int32), _spec((1,), np.int32))


def _gqa_specs(d, dv, *, n=2, h=2):
    return (_spec((1, 1, h, d)), _spec((n, 1, 4, 1, d)), _spec((n, 1, 4, 1, dv)),
            _spec((n, 1, 1), np.int32), _spec((1,), np.int32))


@pytest.mark.parametrize("dl, dr, name", [(0, 4, "q_latent"), (4, 0, "q_rope"), (0, 0, "q_latent")])
def test_mla_refuses_zero_width_features(dl, dr, name):
    mesh = make_dcp_mesh(2)
    sharded = lambda *a: dcp_mla_decode(*a, softmax_scale=0.5, mesh=mesh)  # noqa: E731
    emulated = lambda *a: dcp_mla_decode_emulated(*a, softmax_scale=0.5)  # noqa: E731
    for fn in (sharded, emulated):  # the same checks, so the twins agree
        with pytest.raises(ValueError, match=rf"^{name} needs at least one feature"):
            jax.eval_shape(fn, *_mla_specs(dl, dr))


@pytest.mark.parametrize("d, dv, name", [(4, 0, "v_cache"), (0, 4, "q")])
def test_gqa_refuses_zero_width_features(d, dv, name):
    mesh = make_dcp_mesh(2)
    sharded = lambda *a: dcp_gqa_decode(*a, softmax_scale=0.5, mesh=mesh)  # noqa: E731
    emulated = lambda *a: dcp_gqa_decode_emulated(*a, softmax_scale=0.5)  # noqa: E731
    for fn in (sharded, emulated):
        with pytest.raises(ValueError, match=rf"^{name} needs at least one feature"):
            jax.eval_shape(fn, *_gqa_specs(d, dv))


# Every case called for real: before the checks each of these killed the process (SIGSEGV) or,
# for ag_rs with H = 0, raised an MLIR verifier error.
_CHILD = textwrap.dedent("""
    import numpy as np
    from dcp_jax.attention import dcp_gqa_decode, dcp_mla_decode
    from dcp_jax.merge import a2a, ag_ar, ag_rs, make_dcp_mesh
    z = lambda *s: np.zeros(s, np.float32)
    o = lambda *s: np.ones(s, np.float32)
    pt, lens, mesh = np.zeros((2, 1, 1), np.int32), np.array([4]), make_dcp_mesh(2)
    cases = {
        "ag_rs D=0": lambda: ag_rs(z(2, 1, 2, 0), z(2, 1, 2)),
        "ag_ar D=0": lambda: ag_ar(z(2, 1, 2, 0), z(2, 1, 2)),
        "a2a D=0": lambda: a2a(z(2, 1, 2, 0), z(2, 1, 2)),
        "ag_rs H=0": lambda: ag_rs(z(2, 1, 0, 4), z(2, 1, 0)),
        "gqa Dv=0": lambda: dcp_gqa_decode(o(1, 1, 2, 4), o(2, 1, 4, 1, 4), o(2, 1, 4, 1, 0),
                                           pt, lens, softmax_scale=0.5, mesh=mesh),
        "gqa D=0": lambda: dcp_gqa_decode(o(1, 1, 2, 0), o(2, 1, 4, 1, 0), o(2, 1, 4, 1, 4),
                                          pt, lens, softmax_scale=0.5, mesh=mesh),
        "mla Dl=0": lambda: dcp_mla_decode(o(1, 1, 2, 0), o(1, 1, 2, 4), o(2, 1, 4, 4),
                                           pt, lens, softmax_scale=0.5, mesh=mesh),
        "mla Dr=0": lambda: dcp_mla_decode(o(1, 1, 2, 4), o(1, 1, 2, 0), o(2, 1, 4, 4),
                                           pt, lens, softmax_scale=0.5, mesh=mesh),
    }
    for name, call in cases.items():
        try:
            call()
            print(name, "returned", sep="|", flush=True)
        except ValueError as e:
            print(name, "ValueError " + str(e).split()[0], sep="|", flush=True)
""")


def test_real_calls_raise_value_error_in_a_child_process():
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    got = dict(line.split("|") for line in r.stdout.strip().splitlines())
    want_arg = {"ag_rs D=0": "ag_rs:", "ag_ar D=0": "ag_ar:", "a2a D=0": "a2a:",
                "ag_rs H=0": "ag_rs:", "gqa Dv=0": "v_cache", "gqa D=0": "q",
                "mla Dl=0": "q_latent", "mla Dr=0": "q_rope"}
    assert got == {k: f"ValueError {v}" for k, v in want_arg.items()}, r.stdout
