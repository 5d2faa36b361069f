"""The tiny model: prefill vs decode consistency, blocked causal attention, paging, owner-only
in-place append, and bad inputs. In-process, small sizes (a few seconds in all)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dcp_jax.generate.config import GenerateConfig
from dcp_jax.generate.inprocess import generate_in_process
from dcp_jax.merge import make_dcp_mesh
from dcp_jax.model import (PREFILL_CHUNK, DecodeGeometry, ModelConfig, global_caches, init_params,
                           make_decode_step, prefill_logits, replicated)
from dcp_jax.model.forward import _causal_attention
from dcp_jax.model.paging import place_rows, request_pages


@pytest.mark.parametrize("model", ["mla", "gqa"])
def test_decode_steps_equal_teacher_forced_prefill(model):
    """The absorbed paged decode (DCP 4) gives the logits of the non-absorbed full forward."""
    cfg = GenerateConfig(dcp_size=4, prompt_tokens=300, new_tokens=5, model=model, interleave_size=3)
    prompt = np.random.default_rng(1).integers(0, 512, cfg.prompt_tokens).astype(np.int32)
    tokens, logits = generate_in_process(cfg, prompt)
    full = np.concatenate([prompt, tokens[:-1]]).astype(np.int32)
    pad = -(-len(full) // PREFILL_CHUNK) * PREFILL_CHUNK
    mcfg = cfg.model_config()
    ref = np.asarray(prefill_logits(mcfg, init_params(mcfg), jnp.asarray(np.pad(full, (0, pad - len(full))))))
    ref = ref[cfg.kv_tokens: cfg.kv_tokens + cfg.new_tokens]
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-5
    assert list(ref.argmax(-1)) == tokens


def test_blocked_causal_attention_matches_float64():
    s, h, d, dv = 2 * PREFILL_CHUNK, 2, 8, 4
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, s, h, d)).astype(np.float32)
    v = rng.normal(size=(s, h, dv)).astype(np.float32)
    got = np.asarray(_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0.3))
    sc = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * 0.3
    sc[:, ~np.tril(np.ones((s, s), bool))] = -np.inf
    p = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_place_rows_hand_case():
    """N=2, P=4, I=1: token t on rank t % 2 at local row t // 2 of that rank's table."""
    pages = request_pages(10, dcp_size=2, page_size=4, seed=3)
    rows = np.arange(10, dtype=np.float32)[:, None]
    cache = place_rows(rows, 9, pages, fill=-1)
    for t in range(9):
        r, j = t % 2, t // 2
        assert cache[r, pages.tables[r, j // 4], j % 4, 0] == t
    assert (cache == -1).sum() == cache.size - 9
    assert list(pages.rank_table(1, 9)) == list(pages.tables[1, :1])  # 4 rows: one page


def test_append_only_on_owner_rank_in_place():
    n, page = 4, 4
    mesh = make_dcp_mesh(n)
    pages = request_pages(40, dcp_size=n, page_size=page, interleave_size=2, seed=0)
    geo = DecodeGeometry(page, pages.num_pages, pages.max_pages, 2, "ag_rs")
    devs = list(mesh.devices.flat)
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(30, 576)).astype(np.float32)
    placed = [place_rows(rows, 30, pages)]
    # jnp.copy: an XLA-owned buffer (a device_put numpy array may alias it, and XLA never donates those)
    caches = global_caches(mesh, [[jnp.copy(jax.device_put(placed[0][r], devs[r]))] for r in range(n)])
    before = placed[0]  # (not read back from the caches: a host view would block the donation)
    ptrs = [s.data.unsafe_buffer_pointer() for s in caches[0].addressable_shards]
    cfg1 = ModelConfig(num_layers=1)  # one MLA layer entry: the cache above
    step = make_decode_step(cfg1, mesh, geo)
    pt = jax.device_put(pages.tables, NamedSharding(mesh, P("dcp")))
    params = jax.tree.map(lambda a: replicated(mesh, a), init_params(cfg1))
    t = 30  # owner (30 // 2) % 4 = 3, local index (30 // 8) * 2 + 0 = 6
    _, _, _, (new,) = step(params, caches, pt, replicated(mesh, np.int32(5)), replicated(mesh, np.int32(t)))
    after = np.asarray(new).reshape(n, pages.num_pages, page, 576)
    assert [s.data.unsafe_buffer_pointer() for s in new.addressable_shards] == ptrs  # donated: in place
    changed = np.argwhere((after != before).any(-1))
    assert changed.tolist() == [[3, int(pages.tables[3, 6 // page]), 6 % page]]


def test_bad_inputs_name_the_option():
    with pytest.raises(ValueError, match="--dcp-size"):
        GenerateConfig(dcp_size=3)
    with pytest.raises(ValueError, match="--prompt-tokens"):
        GenerateConfig(prompt_tokens=1)
    with pytest.raises(ValueError, match="--engine"):
        GenerateConfig(engine="tcp")
    with pytest.raises(ValueError, match="--dtype"):
        GenerateConfig(dtype="fp8")
    with pytest.raises(ValueError, match="--corrupt-rank"):
        GenerateConfig(dcp_size=2, corrupt_rank=2)
    with pytest.raises(ValueError, match="--prefill-page-size"):
        GenerateConfig(prefill_page_size=0)
    assert GenerateConfig(page_size=16).prefill_page == 16
    assert GenerateConfig(page_size=16, prefill_page_size=64).prefill_page == 64
    with pytest.raises(ValueError, match="kind"):
        ModelConfig(kind="moe")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(kind="gqa", num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="merge"):
        DecodeGeometry(16, 4, 2, 1, "sum")
    with pytest.raises(ValueError, match="page_size"):
        DecodeGeometry(0, 4, 2)
    with pytest.raises(ValueError, match="num_heads"):
        make_decode_step(ModelConfig(num_heads=4), make_dcp_mesh(8), DecodeGeometry(16, 4, 2))


def test_model_geometry():
    assert ModelConfig(dtype="bf16").item_lens == (1152, 1152)  # DeepSeek-V3 MLA bf16 row
    assert ModelConfig(kind="gqa").entry_shapes == ((2, 64),) * 4
    a, b = init_params(ModelConfig()), init_params(ModelConfig())
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_generate_refusals_come_before_any_process(capsys):
    from dcp_jax.generate import matrix

    with pytest.raises(ValueError, match="--prompt-tokens"):
        GenerateConfig(prompt_tokens=100_000_000)
    assert matrix.main(["--help"]) == 0 and "OUT.json" in capsys.readouterr().out
    assert matrix.main([]) == 2


def test_generate_cli_refuses_gpu_without_cupy():
    pytest.importorskip("typer")
    from typer.testing import CliRunner

    from dcp_jax.cli import app

    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy imports here: the refusal is for machines without it")
    except Exception:  # noqa: BLE001 - ImportError or CUDA libraries missing
        pass
    res = CliRunner().invoke(app, ["generate", "--device", "gpu"])
    assert res.exit_code == 2 and "--device gpu" in " ".join(res.output.replace("│", " ").split())
