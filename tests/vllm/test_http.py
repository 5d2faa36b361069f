"""The HTTP path: two OpenAI-compatible api_server processes with DcpJaxConnector behind vLLM's own
``toy_proxy_server.py`` (from the 0.32.0 sdist, ``VLLM_SRC``); one completion through the proxy
has the same tokens as the decode server answering it alone (no transfer)."""
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from _engines import prompts, write_model

SRC = os.environ.get("VLLM_SRC", "")
PROXY = os.path.join(SRC, "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py")


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _healthy(url, procs, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a server exited with {p.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@pytest.mark.skipif(not os.path.isfile(PROXY), reason="VLLM_SRC does not hold vLLM 0.32.0's sdist (run scripts/vllm_suite.sh)")
def test_completion_through_toy_proxy(tmp_path):
    model = write_model(str(tmp_path), "llama-gqa")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    procs = []

    def server(port, role, kv_port, core):
        kt = {"kv_connector": "DcpJaxConnector", "kv_connector_module_path": "dcp_jax.adapters.vllm",
              "kv_role": role, "kv_connector_extra_config": {"engine": "nixl", "port": kv_port}}
        log = open(tmp_path / f"server-{port}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
             "--host", "127.0.0.1", "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
             "--dtype", "bfloat16", "--max-model-len", "2048", "--no-enable-prefix-caching", "--seed", "0",
             "--distributed-executor-backend", "uni",  # the worker in the engine-core process: one vLLM import less
             "--kv-transfer-config", json.dumps(kt)], stdout=log, stderr=subprocess.STDOUT,
            env=dict(env, VLLM_CPU_OMP_THREADS_BIND=str(core % (os.cpu_count() or 1)))))  # see _engines.Engine

    try:
        server(8150, "kv_producer", 5960, 0)
        server(8250, "kv_consumer", 5960, 1)
        log = open(tmp_path / "proxy.log", "w")
        procs.append(subprocess.Popen([sys.executable, PROXY, "--port", "8050", "--prefiller-hosts", "127.0.0.1",
                                       "--prefiller-ports", "8150", "--decoder-hosts", "127.0.0.1",
                                       "--decoder-ports", "8250"], stdout=log, stderr=subprocess.STDOUT, env=env))
        for port in (8150, 8250, 8050):
            _healthy(f"http://127.0.0.1:{port}/health" if port != 8050 else "http://127.0.0.1:8050/healthcheck",
                     procs, 600)
        body = {"model": model, "prompt": prompts([300], seed=5)[0], "max_tokens": 12, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        via_proxy = _post("http://127.0.0.1:8050/v1/completions", body)
        alone = _post("http://127.0.0.1:8250/v1/completions", body)
        got = via_proxy["choices"][0]["token_ids"]
        assert len(got) == 12 and got == alone["choices"][0]["token_ids"]
        # The prefill server's answer carries our connector's fields (what the proxy hands on).
        pre = _post("http://127.0.0.1:8150/v1/completions",
                    dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        info = pre["kv_transfer_params"]["dcp_jax"]
        assert info["addresses"] == ["tcp://127.0.0.1:5960"] and info["num_tokens"] == 384, info
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
