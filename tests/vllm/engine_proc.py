"""One vLLM engine (offline ``LLM``, CPU, dummy weights) in its own process, driven by JSON lines.

    python engine_proc.py MODEL_DIR ROLE CONNECTOR EXTRA_JSON
      ROLE: kv_producer | kv_consumer | none;  CONNECTOR: dcp_jax | nixl

stdin, one JSON object per line; stdout, one JSON answer per line (prefixed ``@@`` so vLLM's
own prints are skipped):

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": k, "params": [dict|null], "ids": [...]}``
  -> ``{"outputs": [{"tokens", "finish_reason", "kv_transfer_params"}], "seconds"}``
- ``{"op": "corrupt"}``: overwrite every KV cache tensor with noise (the negative control).
- ``{"op": "exit"}``.

Prefix caching is off, so a request either computes or loads its whole prompt.
"""
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _corrupt(worker):
    import torch

    g = torch.Generator().manual_seed(1234)
    for t in worker.model_runner.kv_caches:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * 4)
    return len(worker.model_runner.kv_caches)


def _reinit(worker):
    """Deterministic random weights (``DCP_TEST_INIT_STD``), the same in every engine.

    vLLM's dummy loader seeds every parameter with the same seed and draws from +-1e-3: for the
    OPT shape the logits then tie (every greedy token is 0 whatever the KV), so a token check
    would prove nothing. Norms become identity, biases zero, the rest N(0, std) seeded by name.
    """
    import zlib

    import torch

    std = float(os.environ["DCP_TEST_INIT_STD"])
    with torch.no_grad():
        for name, p in sorted(worker.model_runner.model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return 1


def _stats(worker):
    """Counters of this engine's connector: DcpJaxConnector's sender/receiver `stats`; for the
    stock NixlConnector, descriptors handed to NIXL's ``make_prepped_xfer`` (counted by a wrapper
    installed on the first call)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    w = conn.connector_worker
    if hasattr(w, "sender"):
        keys = ("requests", "succeeded", "failed", "bytes", "descriptors", "batches", "engine_calls", "reads")
        return {side: {k: v for k, v in getattr(w, side).stats.items() if k in keys}
                for side in ("sender", "receiver") if getattr(w, side) is not None}
    nw = w.nixl_wrapper
    if not hasattr(nw, "_dcp_count"):
        nw._dcp_count = {"xfers": 0, "descriptors": 0}
        orig = nw.make_prepped_xfer

        def counted(op, lh, lids, rh, rids, *a, **k):
            nw._dcp_count["xfers"] += 1
            nw._dcp_count["descriptors"] += len(lids)
            return orig(op, lh, lids, rh, rids, *a, **k)

        nw.make_prepped_xfer = counted
    return dict(nw._dcp_count)


def main() -> None:
    model, role, connector, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kt = None
    if role != "none":
        if connector == "dcp_jax":
            kt = KVTransferConfig(kv_connector="DcpJaxConnector", kv_connector_module_path="dcp_jax.adapters.vllm",
                                  kv_role=role, kv_connector_extra_config=extra)
        else:
            kt = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu")
    if connector == "nixl":
        # vLLM 0.32's CPU AMX attention never asks Linux for AMX state; a decode whose first
        # forward is a loaded request's one-token step dies with SIGILL. DcpJaxConnector asks at
        # registration (adapters/vllm/worker.py); the stock connector needs it from us.
        from dcp_jax.adapters.vllm.worker import _request_amx

        _request_amx()
    t0 = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=4096, max_num_seqs=8, enable_prefix_caching=False,
              kv_transfer_config=kt, seed=0)
    if os.environ.get("DCP_TEST_INIT_STD"):
        llm.collective_rpc(_reinit)
    print("@@" + json.dumps({"ready": True, "seconds": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "corrupt":
            n = llm.collective_rpc(_corrupt)
            print("@@" + json.dumps({"corrupted": n}), flush=True)
            continue
        if op == "stats":
            print("@@" + json.dumps({"stats": llm.collective_rpc(_stats)[0]}), flush=True)
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
        params = cmd.get("params") or [None] * len(prompts)
        sps = [SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                              extra_args=None if p is None else {"kv_transfer_params": p}) for p in params]
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        res = [{"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                "kv_transfer_params": o.kv_transfer_params} for o in outs]
        print("@@" + json.dumps({"outputs": res, "seconds": time.perf_counter() - t}, default=str), flush=True)
    os._exit(0)  # vLLM's and the engines' teardown at interpreter exit is slow; nothing is left to flush


if __name__ == "__main__":
    main()
