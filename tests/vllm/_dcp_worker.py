"""DcpJaxConnector workers outside vLLM's engine, their hooks driven directly (the DCP test).

    python _dcp_worker.py DCP_SIZE PORT ENGINE

One producer and DCP_SIZE consumer workers, each its own process: this launcher imports vLLM
and torch once (~10 s of CPU each time on this machine), then forks the workers before any
engine, thread or torch kernel exists; each worker builds its own connector and engine.
The caches are vLLM's CPU layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
bf16 per layer); the producer's bytes come from a seed, every consumer cache starts as a
sentinel. A consumer checks, for every token of every request, the rows the CPU backend reads
for it (``view(nb, H, 2 * bs, D)``: K at row ``slot``, V at row ``bs + slot`` of each head) against
the producer's, using its own copy of the ownership rule, and that nothing else changed. Prints
one JSON line: the producer's result, then each consumer's (rank order).
"""
import faulthandler
import json
import os
import sys
import time
import types

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

LAYERS, HEADS, HEAD, BS, BLOCKS = 2, 2, 64, 128, 16
# request -> (tokens, producer blocks, consumer blocks); "short" has 3 tokens: rank 3 of 4 owns none.
REQUESTS = {"long": (300, [9, 2, 5], [4, 11, 7]), "short": (3, [13], [1])}
SENTINEL = -7.0


def vllm_config(role, dcp_size, dcp_rank, port, engine):
    from vllm.config import KVTransferConfig

    extra = {"engine": engine, "rows": "token", "port": port, "dcp_rank": dcp_rank, "tp_rank": dcp_rank,
             "timeout_s": 20.0}
    kt = KVTransferConfig(kv_connector="DcpJaxConnector", kv_connector_module_path="dcp_jax.adapters.vllm",
                          kv_role=role, kv_connector_extra_config=extra, engine_id=f"dcp-test-{role}")
    # vLLM's DCP reuses the TP ranks: tp = dcp = N, every rank holds all KV heads.
    par = types.SimpleNamespace(tensor_parallel_size=dcp_size, decode_context_parallel_size=dcp_size,
                                cp_kv_cache_interleave_size=1)
    return types.SimpleNamespace(kv_transfer_config=kt, parallel_config=par,
                                 cache_config=types.SimpleNamespace(block_size=BS))


def kv_cache_config():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def caches(fill_seed=None):
    out = {}
    for i in range(LAYERS):
        if fill_seed is None:
            t = torch.full((BLOCKS, HEADS, BS, 2 * HEAD), SENTINEL, dtype=torch.bfloat16)
        else:
            g = torch.Generator().manual_seed(fill_seed + i)
            t = torch.randn((BLOCKS, HEADS, BS, 2 * HEAD), generator=g).to(torch.bfloat16)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


_SEEN = {"finished_sending": set(), "finished_recving": set(), "failed_recving": set()}


def wait(conn, rid, key, timeout=60.0):
    """Polls until ``rid`` was reported under ``key``; results are "since the last call", so
    every set is accumulated (one poll may report several requests)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = conn.get_transfer_results(set())
        for k, seen in _SEEN.items():
            seen |= getattr(res, k)
        if rid in _SEEN[key]:
            return types.SimpleNamespace(**_SEEN)
        time.sleep(0.01)
    raise TimeoutError(f"{rid} not in {key} after {timeout} s")


def run(role, n, rank, port, engine):
    """One worker (in a forked child): returns its result dict."""
    torch.set_num_threads(1)  # n + 1 workers share 2 cores; no OpenMP pool inherited across fork
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from dcp_jax.adapters.vllm import DcpJaxConnector
    from dcp_jax.adapters.vllm.scheduler import DcpJaxMetadata, RecvJob, SendJob

    producer = role == "producer"
    cfg = vllm_config("kv_producer" if producer else "kv_consumer", 1 if producer else n, 0 if producer else rank,
                      port, engine)
    conn = DcpJaxConnector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    kv = caches(fill_seed=100 if producer else None)
    conn.register_kv_caches(kv)
    result = {"role": role, "rank": rank}
    if producer:
        conn.bind_connector_metadata(DcpJaxMetadata(send=[SendJob(r, b, t) for r, (t, b, _) in REQUESTS.items()]))
        conn.wait_for_save()
        conn.clear_connector_metadata()
        for rid in REQUESTS:
            wait(conn, rid, "finished_sending")
        result["sent"] = sorted(REQUESTS)
        result["stats"] = {k: conn.connector_worker.sender.stats[k] for k in ("succeeded", "failed", "bytes")}
    else:
        addr = f"tcp://127.0.0.1:{port}"
        jobs = [RecvJob(r, r, d, t, 0, [addr]) for r, (t, _, d) in REQUESTS.items()]
        conn.bind_connector_metadata(DcpJaxMetadata(recv=jobs))
        conn.start_load_kv(None)
        conn.clear_connector_metadata()
        failed = set()
        for rid in REQUESTS:
            failed |= wait(conn, rid, "finished_recving").failed_recving
        src = caches(fill_seed=100)
        owned, bad = {}, 0
        for name, t in kv.items():
            want = torch.full_like(t, SENTINEL).view(BLOCKS, HEADS, 2 * BS, HEAD)
            s = src[name].view(BLOCKS, HEADS, 2 * BS, HEAD)
            for rid, (tokens, pblocks, dblocks) in REQUESTS.items():
                mine = [tok for tok in range(tokens) if tok % n == rank]  # token round-robin (I = 1)
                owned[rid] = len(mine)
                for k, tok in enumerate(mine):  # local row k of this rank
                    db, ds = dblocks[k // BS], k % BS
                    sb, ss = pblocks[tok // BS], tok % BS
                    for kvi in (0, 1):
                        want[db, :, kvi * BS + ds] = s[sb, :, kvi * BS + ss]
            bad += int((t.view(torch.int16) != want.view(t.shape).view(torch.int16)).sum())
        result.update(owned=owned, mismatched_elements=bad, failed=sorted(failed))
    conn.shutdown()
    return result


def _child(w, *args):
    faulthandler.dump_traceback_later(float(os.environ.get("DCP_WORKER_STACKS_AFTER_S", "400")), exit=True)
    code = 0
    try:
        out = {"ok": run(*args)}
    except BaseException as e:  # noqa: BLE001 - the parent reports it with the worker's name
        import traceback

        out, code = {"error": f"{args[:3]}: {traceback.format_exc()[-3000:]}"}, 1
    os.write(w, json.dumps(out).encode())
    os.close(w)
    os._exit(code)


def main():
    n, port, engine = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # The heavy imports, once, before the fork (DcpJaxConnector subclasses vLLM's base class).
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: F401

    import dcp_jax.adapters.vllm  # noqa: F401

    workers = [("producer", 0)] + [("consumer", r) for r in range(n)]
    kids = []
    for role, rank in workers:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(w, role, n, rank, port, engine)
        os.close(w)
        kids.append((pid, r))
    results, errors = [], []
    for pid, r in kids:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        out = json.loads(data) if data else {"error": f"worker {pid} died (wait status {status})"}
        results.append(out.get("ok"))
        if "error" in out:
            errors.append(out["error"])
    print("@@" + json.dumps({"results": results, "errors": errors}), flush=True)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
