"""CPU: what the fused fan-out's launch without JAX (`pallas_kernels.triton_launch`) needs from JAX
and Triton, checked without a GPU: the fan-out's Triton module is captured at JAX's lowering (for
an abstract H200, as XLA would get it) and the ``triton`` package compiles it for sm_90 into a
kernel whose parameters are the ``pallas_call``'s operands then its aliased outputs; the launch
stays off where it cannot run; a host flag refuses a stream bump. The launch itself is tested on
the GPU (`tests/gpu/test_triton_launch_gpu.py`)."""
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import triton_launch
from pallas_kernels.config import GatherConfig
from pallas_kernels.fanout_kernel import _fanout_jit

triton = pytest.importorskip("triton")


def _abstract_h200():
    from jax._src.mesh import AbstractDevice

    return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                    platform="cuda"))


@pytest.mark.parametrize("D,L,first", [(8, 61, 0), (3, 5, 31)])
def test_the_fanout_module_is_captured_and_compiles_for_sm90(D, L, first):
    config = GatherConfig(block_rows=32, num_warps=8)
    R, W, m = 4096, 288, 1024
    sds = jax.ShapeDtypeStruct
    with triton_launch.capture_triton_modules() as got, jax.sharding.use_abstract_mesh(_abstract_h200()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _fanout_jit.trace(sds((L, R, W), jnp.uint32), sds((m,), jnp.int32),
                          tuple(sds(((first + L) * 512 * W,), jnp.uint32) for _ in range(D)),
                          sds((m,), jnp.int32), sds((4 * m // 32,), jnp.int32), first_layer=first,
                          dst_rows=(512,) * D, config=config, backend="triton").lower(lowering_platforms=("cuda",))
    assert len(got) == 1
    text, grid = got[0]
    assert grid == (m // 32, L)  # (row blocks, layers): what the launch passes
    assert f"kv_copy_fanout_br=32_D={D}_L={L}".replace("=", "_") in text.replace("=", "_")
    from triton.backends.compiler import GPUTarget

    kernel = triton_launch.compile_module(text, num_warps=8, num_stages=1, target=GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)
    params = re.findall(r"\.param \.u64 \.ptr", entry.group(2))
    # table, sidx, didx, source, D destinations in, D destinations out (aliased): all pointers.
    assert len(params) >= 4 + 2 * D, entry.group(2)[:400]
    assert len(kernel.asm["cubin"]) > 0
    assert kernel.metadata.num_warps == 8
    # The capture is undone after the block.
    from jax._src.pallas.triton import pallas_call_registration as reg

    assert reg.lowering.lower_jaxpr_to_triton_module.__name__ == "lower_jaxpr_to_triton_module"


def test_no_direct_launch_where_it_cannot_run(monkeypatch):
    # On CPU the fan-out's backend is "interpret" (or numpy): JAX's launch (or the host) serves.
    assert not triton_launch.enabled("interpret") and not triton_launch.enabled("numpy")
    monkeypatch.setitem(triton_launch._STATE, "off_kinds", set())
    monkeypatch.setitem(triton_launch._STATE, "off", True)
    assert not triton_launch.enabled("triton")
    monkeypatch.setitem(triton_launch._STATE, "off", False)
    assert triton_launch.enabled("triton")  # triton importable here: only the backend decides
    triton_launch.synchronize()  # no stream made: nothing to wait for


def test_disable_turns_a_kind_or_all_off_for_the_process_and_says_why(monkeypatch, caplog):
    monkeypatch.setitem(triton_launch._STATE, "off", False)
    monkeypatch.setitem(triton_launch._STATE, "why", "")
    monkeypatch.setitem(triton_launch._STATE, "off_kinds", set())
    with caplog.at_level("WARNING"):
        triton_launch.disable("RuntimeError: no luck", "gather")
        triton_launch.disable("again", "gather")  # logged once per kind
    assert not triton_launch.enabled("triton", "gather") and triton_launch.enabled("triton", "fanout")
    with caplog.at_level("WARNING"):
        triton_launch.disable("ImportError: no torch")
    assert not triton_launch.enabled("triton", "fanout")
    assert triton_launch._STATE["why"] == "ImportError: no torch"
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["gather: launching through JAX from now on (RuntimeError: no luck)",
                        "direct launches: through JAX from now on (ImportError: no torch)"], messages


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked source", "61 layer views"])
def test_the_pack_rows_gather_module_is_captured_and_compiles_for_sm90(stacked):
    """`pack_rows`' kernel (`_gather_rows_jit`, Triton backend): ONE module, whose parameters are
    meta, indices, the sources (one stacked view or 61), the pack, and the pack again (aliased)."""
    from triton.backends.compiler import GPUTarget

    from pallas_kernels.gather import _gather_rows_jit
    from pallas_kernels.triton_plans import _fresh_jit

    config, L, R, W, m = GatherConfig.default(), 61, 4096, 288, 256
    sds = jax.ShapeDtypeStruct
    srcs = sds((L, R, W), jnp.uint32) if stacked else [sds((R, W), jnp.uint32)] * L
    # As `triton_plans.GatherPlan` traces it: a fresh callable with the static arguments bound.
    fn = _fresh_jit(_gather_rows_jit.__wrapped__, config=config, backend="triton", offset_align=4)
    params, entry, args = _sm90_pointer_params(fn, (srcs, sds((m,), jnp.int32), sds((m * L * W + 64,), jnp.uint32),
                                                    sds((3,), jnp.int32)), "kv_gather_", config)
    assert params >= 2 + (1 if stacked else L) + 2, entry[:400]
    assert args == 2 + (1 if stacked else L) + 2  # GatherPlan's launch: meta, indices, sources, pack, pack


def _sm90_pointer_params(fn, args, tag, config):
    """Lowers `fn` on `args` for an abstract H200, checks ONE Triton module holding `tag` was
    captured, compiles it for sm_90; returns (its kernel's pointer parameters, the entry text)."""
    from triton.backends.compiler import GPUTarget

    with triton_launch.capture_triton_modules() as got, jax.sharding.use_abstract_mesh(_abstract_h200()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fn.trace(*args).lower(lowering_platforms=("cuda",))
    assert len(got) == 1 and tag in got[0][0]
    kernel = triton_launch.compile_module(got[0][0], num_warps=config.num_warps, num_stages=config.num_stages,
                                          target=GPUTarget("cuda", 90, 32))
    entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", kernel.asm["ptx"]).group(2)
    return len(re.findall(r"\.param \.u64 \.ptr", entry)), entry, _module_args(got[0][0])


def _module_args(text: str) -> int:
    """Arguments of the captured module's kernel (what a launch passes; Triton's launcher adds
    its own scratch pointers to the PTX entry after them)."""
    sig = re.search(r"tt\.func public @[\w$.]+\((.*?)\)\s*(attributes|\{)", text, re.S).group(1)
    return len(re.findall(r"%arg\d+:", sig))


def test_the_row_unpacker_module_is_captured_and_compiles_for_sm90():
    """`RowUnpacker`'s kernel into a layer-major cache (`_unpack_flat_jit`, Triton backend), as
    `triton_plans.UnpackPlan` traces it: ONE module, whose pointer parameters are meta, the
    destination rows, the region, the flat cache and the cache again (aliased)."""
    from triton.backends.compiler import GPUTarget

    from pallas_kernels.scatter import _unpack_flat_jit
    from pallas_kernels.triton_plans import _fresh_jit

    config, L, R, W, m = GatherConfig.default(), 61, 4096, 288, 512
    sds = jax.ShapeDtypeStruct
    fn = _fresh_jit(_unpack_flat_jit.__wrapped__, layers=((R, W),) * L, config=config, backend="triton",
                    offset_align=64)
    params, entry, args = _sm90_pointer_params(fn, (sds((m * L * W + 4096,), jnp.uint32), sds((m,), jnp.int32),
                                                    sds((L * R * W,), jnp.uint32), sds((3,), jnp.int32)),
                                               "kv_unpack_flat", config)
    assert params >= 5, entry[:400]
    assert args == 5  # UnpackPlan's launch: meta, rows, region, cache, cache (aliased)


def test_a_host_flag_refuses_a_stream_bump():
    from bridge.host_flag import FlagError, SharedFlag

    with SharedFlag.create() as flag:
        with pytest.raises(FlagError, match="host flag"):
            flag.bump_on_stream(object())
        assert flag.seq == 0 and flag.value() == 0
        assert flag.bump_after() == 1 and flag.value() == 1
    with pytest.raises(RuntimeError, match="closed"):
        flag.bump_on_stream(object())


def test_the_same_shapes_lower_again_for_every_capture():
    """JAX caches a jitted function's lowering: the jitted entry point lowered twice on the same
    shapes reaches the Pallas lowering only once, so a second capture (another device, or shapes
    the JAX launch lowered first) found no module and turned direct launches off. The plans trace
    a fresh callable every time (`triton_plans._fresh_jit`)."""
    from pallas_kernels.fanout_kernel import _fanout_call
    from pallas_kernels.triton_plans import _fresh_jit

    config, sds = GatherConfig(block_rows=32, num_warps=8), jax.ShapeDtypeStruct
    args = (sds((2, 256, 288), jnp.uint32), sds((64,), jnp.int32), (sds((2 * 128 * 288,), jnp.uint32),) * 2,
            sds((64,), jnp.int32), sds((8,), jnp.int32))
    static = dict(first_layer=0, dst_rows=(128, 128), config=config, backend="triton")
    counts = []
    with jax.sharding.use_abstract_mesh(_abstract_h200()), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for fresh in (False, False, True, True):
            with triton_launch.capture_triton_modules() as got:
                fn = _fresh_jit(_fanout_call, **static).trace(*args) if fresh else _fanout_jit.trace(*args, **static)
                fn.lower(lowering_platforms=("cuda",))
            counts.append(len(got))
    assert counts == [1, 0, 1, 1], counts  # the cached entry point lowers once; a fresh one always


@pytest.mark.parametrize("text", ["module {}", "", None, "// tt.func\nmodule {\n}\n",
                                  'module attributes {"tt.func" = 1 : i32} {\n}\n',
                                  "module {\n  tt.func private @f(%arg0: i32)\n}\n"])
def test_compile_module_refuses_text_without_a_kernel(text):
    # Triton 3.6 ends the process (SIGSEGV) on each of these (the last three passed a first,
    # substring check: final fresh-user trial).
    with pytest.raises(ValueError, match="tt.func"):
        triton_launch.compile_module(text, num_warps=4, num_stages=1)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(num_warps=0), ValueError, "num_warps=0 must be an int >= 1"),
    (dict(num_warps=3), ValueError, "num_warps=3 must be a power of 2"),
    (dict(num_warps="8"), ValueError, "num_warps='8' must be an int"),
    (dict(num_stages=0), ValueError, "num_stages=0 must be"),
    (dict(target="sm_90"), TypeError, "target must be a triton GPUTarget"),
])
def test_compile_module_names_a_bad_option(kw, exc, match):
    # Before: Triton's own AssertionError / TypeError, naming nothing.
    text = ("module {\n  tt.func public @k(%arg0: !tt.ptr<i32>) {\n    tt.return\n  }\n}\n")
    args = dict(num_warps=4, num_stages=1, target=None)
    args.update(kw)
    with pytest.raises(exc, match=match):
        triton_launch.compile_module(text, **args)


def test_compiled_kernels_are_bounded_oldest_dropped_first(monkeypatch):
    # A long-lived process that meets ever new geometries keeps at most _MAX_KERNELS modules.
    monkeypatch.setattr(triton_launch, "_KERNELS", {})
    monkeypatch.setattr(triton_launch, "_MAX_KERNELS", 3)
    for k in range(5):
        assert triton_launch._remember(("fanout", k), (f"kernel {k}", (k, 1, 1))) == (f"kernel {k}", (k, 1, 1))
    assert list(triton_launch._KERNELS) == [("fanout", 2), ("fanout", 3), ("fanout", 4)]
    assert triton_launch._KERNELS[("fanout", 4)] == ("kernel 4", (4, 1, 1))


def test_warm_pack_rows_compiles_nothing_for_host_buffers_and_refuses_bad_sizes():
    import numpy as np

    from pallas_kernels import warm_pack_rows

    layers = [np.zeros((8, 16), np.uint8) for _ in range(2)]
    pack = np.zeros(1024, np.uint8)
    assert warm_pack_rows(layers, pack, 8) == []
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_rows"):
            warm_pack_rows(layers, pack, bad)


def test_a_gather_launch_whose_metadata_says_no_rows_writes_nothing():
    """What `warm_pack_rows` relies on (its one launch compiles the bucket while the pack buffer
    may hold live regions): meta (n = 0, ok = 0) masks every row of the bucket (interpret mode,
    the same kernel body as the Triton one)."""
    import numpy as np

    from pallas_kernels.gather import _gather_rows_jit

    L, R, W, m = 3, 128, 8, 64
    src = jnp.asarray(np.random.default_rng().integers(0, 2**31, (L, R, W)).astype(np.uint32))
    idx = jnp.asarray(np.random.default_rng().integers(0, R, m).astype(np.int32))
    for meta in [(0, 0, 0), (0, 0, 1), (m, 0, 0)]:
        out = _gather_rows_jit(src, idx, jnp.full((m * L * W + 64,), 7, jnp.uint32), jnp.asarray(meta, jnp.int32),
                               config=GatherConfig.default(), backend="interpret", offset_align=4)
        assert int((np.asarray(out) != 7).sum()) == 0, meta


def test_the_environment_switches_refuse_what_they_do_not_know(monkeypatch):
    """A typo in an A/B switch must not leave both runs measuring the same thing."""
    from pallas_kernels.config import EnvSwitchError, env_flag

    for raw, want in [("1", True), (" TRUE ", True), ("on", True), ("0", False), ("No", False), ("", None)]:
        monkeypatch.setenv("DCP_X_FLAG", raw)
        assert env_flag("DCP_X_FLAG", None) is want, raw
    monkeypatch.delenv("DCP_X_FLAG")
    assert env_flag("DCP_X_FLAG", True) is True
    for raw in ("2", "yes please", "-1"):
        monkeypatch.setenv("DCP_X_FLAG", raw)
        with pytest.raises(ValueError, match="DCP_X_FLAG="):
            env_flag("DCP_X_FLAG", False)
    assert triton_launch._off_kinds(" unpack, GATHER ,") == {"unpack", "gather"}
    assert triton_launch._off_kinds("") == set()
    for raw in ("unpak", "all", "*", "unpack,fanouts"):
        with pytest.raises(ValueError, match="DCP_JAX_DIRECT_OFF="):
            triton_launch._off_kinds(raw)
    with pytest.raises(ValueError, match="DCP_JAX_DIRECT_ON="):
        triton_launch._off_kinds("window", "DCP_JAX_DIRECT_ON")
    env = {"DCP_JAX_DIRECT_ON": "windows", "DCP_JAX_DIRECT_OFF": "unpack, Windows"}
    with pytest.raises(EnvSwitchError, match=r"both name \['windows'\]"):
        triton_launch._env_off_kinds(env)
    assert triton_launch._env_off_kinds({"DCP_JAX_DIRECT_ON": "unpack"}) == {"windows"}  # on already


@pytest.mark.parametrize("env, off", [({}, {"windows"}), ({"DCP_JAX_DIRECT_ON": "windows"}, set()),
                                      ({"DCP_JAX_DIRECT_ON": "windows", "DCP_JAX_DIRECT_OFF": "unpack"}, {"unpack"}),
                                      ({"DCP_JAX_DIRECT_OFF": "gather"}, {"gather", "windows"})])
def test_the_windowed_pack_launch_is_off_unless_turned_on(env, off):
    """`DEFAULT_OFF` kinds (the sender's round in one launch: not measured faster) are off
    unless ``DCP_JAX_DIRECT_ON`` names them; ``DCP_JAX_DIRECT_OFF`` adds to them."""
    assert triton_launch._env_off_kinds(env) == off


def test_a_fresh_process_takes_its_off_kinds_from_its_environment():
    """`_STATE` is `_env_off_kinds` of the process's own environment, read at import."""
    import json
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("DCP_JAX_DIRECT")}
    code = "import json; from pallas_kernels import triton_launch as t; print(json.dumps(sorted(t._STATE['off_kinds'])))"
    for env, off in [({}, {"windows"}), ({"DCP_JAX_DIRECT_ON": "windows", "DCP_JAX_DIRECT_OFF": "unpack"}, {"unpack"})]:
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert set(json.loads(out.stdout.strip().splitlines()[-1])) == off


def test_the_plans_stage_indices_and_pass_pointers_in_the_kernels_order(monkeypatch):
    """`GatherPlan` / `UnpackPlan` launches without a GPU: the kernel and the stream stubbed,
    the slot a numpy buffer. Indices zero-padded to the bucket, meta after them on its 64-word
    line, and the pointer arguments as each ``pallas_call`` orders them (meta, indices, then the
    gather's sources and pack twice, the unpack's region and cache twice)."""
    import numpy as np

    from pallas_kernels.mapped_ring import slot_layout
    from pallas_kernels.triton_plans import GatherPlan, UnpackPlan

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, stream: calls.append((grid, args, stream))

    def enqueue(device_id, size, fill, launches, on_phase=None):
        slot = np.full(size, -1, np.int32)
        fill(slot)
        for launch in launches:
            launch(1 << 20, 77)
        return slot

    monkeypatch.setattr(triton_launch, "enqueue", enqueue)
    m, idx, meta = 128, np.array([5, 3, 9]), (3, 2, 1)
    stride, size = slot_layout(m, 1, 3)
    srcs = [jnp.zeros((16, 8), jnp.uint32), jnp.zeros((16, 8), jnp.uint32)]
    pack = jnp.zeros(4096, jnp.uint32)
    plans = [(GatherPlan(srcs, 0xA000, 4096, GatherConfig.default()),
              tuple(int(s.unsafe_buffer_pointer()) for s in srcs) + (0xA000, 0xA000)),
             (UnpackPlan(pack, 0xB000, 2048, ((16, 8),) * 2, GatherConfig.default()),
              (int(pack.unsafe_buffer_pointer()), 0xB000, 0xB000))]
    for plan, ptrs in plans:
        plan.kernels[(m, 4)] = (Kernel(), (2, 3, 1))  # as compiled: no Triton here
        calls.clear()
        slot = plan.launch(idx, m, meta, 4)
        assert list(slot[:3]) == [5, 3, 9] and not slot[3:m].any() and list(slot[stride:stride + 3]) == list(meta)
        (grid, args, stream), = calls
        assert grid == (2, 3, 1) and stream == 77
        assert args == ((1 << 20) + 4 * stride, 1 << 20) + ptrs
