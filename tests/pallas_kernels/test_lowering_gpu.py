"""CPU: ahead-of-time lowering of the GPU pack kernels for abstract A100, H200, B200 (CUDA) and
gfx942 / gfx950 (ROCm) devices, so lowering errors show without the GPU.

This runs Pallas' real Triton-IR and Mosaic GPU lowerings (PTX/HSACO compilation happens
later, in XLA:GPU, and is not covered). It calls `pallas_kernels.gather._gather_rows_jit`, the
jitted kernel entry point behind `gather_rows`, whose public wrapper refuses GPU backends on
a CPU machine (`select_backend`). The abstract device API is private to JAX
(`jax._src.mesh.AbstractDevice`, 0.11).
"""

import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import GatherConfig, gather

CUDA = [("A100", "NVIDIA A100-SXM4-80GB", 108), ("H200", "NVIDIA H200", 132),
        ("B200", "NVIDIA B200", 148)]
ROCM = [("gfx942", "gfx942", 304), ("gfx950", "gfx950", 256)]

# (name, words per row of each layer entry (uint32), layers): MLA 1152 B, GQA 512 B, fp8 576 B.
GEOMETRIES = [("mla-1152", 288, 61), ("gqa-512", 128, 16), ("fp8-576", 144, 4)]


def _mesh(device_kind, cores, platform):
    from jax._src.mesh import AbstractDevice

    return jax.sharding.AbstractMesh(
        (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
        abstract_device=AbstractDevice(device_kind=device_kind, num_cores=cores,
                                       platform=platform))


def _lower(device_kind, cores, platform, backend, width, num_layers, m=64, rows=8192):
    mesh = _mesh(device_kind, cores, platform)
    src = [jax.ShapeDtypeStruct((rows, width), jnp.uint32)] * num_layers
    args = (src, jax.ShapeDtypeStruct((m,), jnp.int32),
            jax.ShapeDtypeStruct((m * width * num_layers + 64,), jnp.uint32),
            jax.ShapeDtypeStruct((3,), jnp.int32))  # meta: rows, offset units, ok
    config = GatherConfig.default() if backend == "triton" else GatherConfig(block_rows=32)
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Pallas Triton is deprecated
        traced = gather._gather_rows_jit.trace(*args, config=config, backend=backend,
                                               offset_align=4)
        return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("name,kind,cores,platform",
                         [(*c, "cuda") for c in CUDA] + [(*r, "rocm") for r in ROCM],
                         ids=[c[0] for c in CUDA] + [r[0] for r in ROCM])
def test_triton_lowers(name, kind, cores, platform, geometry):
    _, width, num_layers = geometry
    text = _lower(kind, cores, platform, "triton", width, num_layers)
    assert "__gpu$xla.gpu.triton" in text
    # The pack is aliased to the output: the kernel writes in place.
    assert "tf.aliasing_output = 0" in text


@pytest.mark.parametrize("name,kind,cores", CUDA[1:], ids=[c[0] for c in CUDA[1:]])
def test_mosaic_gpu_lowers_for_hopper_and_blackwell(name, kind, cores):
    # DeepSeek-V3's 61 layers, two 32-row blocks. The row copies are loops: unrolled, this module
    # was 6.3 MB of MLIR (11 s to lower here) and did not finish compiling on the H200 in 95 s;
    # looped it is about 0.4 MB. The bound catches a return to unrolling.
    text = _lower(kind, cores, "cuda", "mosaic", 288, 61, m=64)
    assert "mosaic_gpu" in text
    assert len(text) < 1_500_000, len(text)


def test_mosaic_gpu_refuses_rocm():
    with pytest.raises(AssertionError):  # JAX 0.11 has no Mosaic GPU lowering rule for ROCm
        _lower("gfx942", 304, "rocm", "mosaic", 288, 2, m=32)


def _lower_windows(device_kind, cores, platform, width, num_layers, m=256, rows=8192):
    """The windowed kernel of `pack_windows` (`pallas_kernels.windows._gather_windows_jit`)."""
    from pallas_kernels.windows import _gather_windows_jit

    config = GatherConfig.default()
    src = [jax.ShapeDtypeStruct((rows, width), jnp.uint32)] * num_layers
    args = (src, jax.ShapeDtypeStruct((m,), jnp.int32),
            jax.ShapeDtypeStruct((m * width * num_layers + 64,), jnp.uint32),
            jax.ShapeDtypeStruct((4 * (m // config.block_rows),), jnp.int32))  # block table
    with jax.sharding.use_abstract_mesh(_mesh(device_kind, cores, platform)), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = _gather_windows_jit.trace(*args, config=config, backend="triton",
                                           offset_align=4)
        return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("name,kind,cores,platform",
                         [(*c, "cuda") for c in CUDA] + [(*r, "rocm") for r in ROCM[:1]],
                         ids=[c[0] for c in CUDA] + [r[0] for r in ROCM[:1]])
def test_windowed_triton_lowers(name, kind, cores, platform, geometry):
    _, width, num_layers = geometry
    text = _lower_windows(kind, cores, platform, width, num_layers)
    assert "__gpu$xla.gpu.triton" in text
    assert "tf.aliasing_output = 0" in text  # one launch, in place into the pack
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("name,kind,cores", CUDA, ids=[c[0] for c in CUDA])
def test_flat_unpack_triton_lowers(name, kind, cores):
    """The one-buffer unpack (`scatter._unpack_flat_jit`): one aliased output for 61 layers."""
    from pallas_kernels.scatter import _unpack_flat_jit

    layers = ((8192, 288),) * 61
    args = (jax.ShapeDtypeStruct((64 * 288 * 61,), jnp.uint32),
            jax.ShapeDtypeStruct((64,), jnp.int32),
            jax.ShapeDtypeStruct((8192 * 288 * 61,), jnp.uint32),
            jax.ShapeDtypeStruct((3,), jnp.int32))
    with jax.sharding.use_abstract_mesh(_mesh(kind, cores, "cuda")), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = _unpack_flat_jit.trace(*args, layers=layers, config=GatherConfig.default(),
                                      backend="triton", offset_align=4).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "tf.aliasing_output = 0" in text and "tf.aliasing_output = 1" not in text


@pytest.mark.parametrize("stacked", [False, True], ids=["61 sources", "stacked source"])
@pytest.mark.parametrize("name,kind,cores", CUDA, ids=[c[0] for c in CUDA])
def test_flat_copy_triton_lowers(name, kind, cores, stacked):
    """The fused path's one-buffer copy (`scatter._copy_flat_jit`): 61 source layers read (one
    argument each, or ONE stacked [61, R, W] view of a layer-major prefill cache), ONE aliased
    output for the decode rank's 61 destination layers."""
    from pallas_kernels.scatter import _copy_flat_jit

    layers = ((8192, 288),) * 61
    src = jax.ShapeDtypeStruct((61, 4096, 288), jnp.uint32) if stacked else \
        [jax.ShapeDtypeStruct((4096, 288), jnp.uint32)] * 61
    args = (src, jax.ShapeDtypeStruct((64,), jnp.int32),
            jax.ShapeDtypeStruct((8192 * 288 * 61,), jnp.uint32),
            jax.ShapeDtypeStruct((64,), jnp.int32),
            jax.ShapeDtypeStruct((3,), jnp.int32))
    with jax.sharding.use_abstract_mesh(_mesh(kind, cores, "cuda")), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = _copy_flat_jit.trace(*args, layers=layers, config=GatherConfig.default(),
                                    backend="triton").lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "tf.aliasing_output = 0" in text and "tf.aliasing_output = 1" not in text


@pytest.mark.parametrize("name,kind,cores", CUDA, ids=[c[0] for c in CUDA])
def test_fanout_copy_triton_lowers(name, kind, cores):
    """The fused round in one launch (`fanout._fanout_jit`): a stacked [61, R, W] source, eight
    decode ranks' flat caches, ONE Triton call whose eight outputs alias the eight inputs."""
    from pallas_kernels.fanout import _fanout_jit

    D, L, W = 8, 61, 288
    args = (jax.ShapeDtypeStruct((L, 40960, W), jnp.uint32),
            jax.ShapeDtypeStruct((D * 4096,), jnp.int32),
            tuple(jax.ShapeDtypeStruct((L * 5120 * W,), jnp.uint32) for _ in range(D)),
            jax.ShapeDtypeStruct((D * 4096,), jnp.int32),
            jax.ShapeDtypeStruct((D * 4096 // 64 * 4,), jnp.int32))
    with jax.sharding.use_abstract_mesh(_mesh(kind, cores, "cuda")), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = _fanout_jit.trace(*args, first_layer=0, dst_rows=(5120,) * D, config=GatherConfig.default(),
                                 backend="triton").lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert all(f"tf.aliasing_output = {k}" in text for k in range(D))
