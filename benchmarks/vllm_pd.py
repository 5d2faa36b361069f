"""TTFT and KV bytes/s of a vLLM P/D pair: DcpJaxConnector vs vLLM's stock NixlConnector.

Same model (the tiny GQA Llama of tests/vllm, dummy weights), same 2,000-token prompts, same
machine, one run: per connector a prefill and a decode engine (two processes, vLLM 0.32.0 CPU
backend, NixlConnector with ``kv_buffer_device="cpu"``), one warm-up request, then ``--reps``
requests one after another. TTFT = prefill ``generate(max_tokens=1)`` + decode ``generate(
max_tokens=1)`` as timed inside each engine process (the hand-off between them excluded);
KV bytes/s = the request's KV bytes (layers x 2 x kv_heads x head_size x 2 B x tokens) over the
decode's seconds (the load plus one decode step: a lower bound on the transfer rate).
Descriptors per request: DcpJaxConnector's own counters (sender + receiver ``descriptors``);
the stock NixlConnector's, counted on the decode's ``make_prepped_xfer`` (its READs).

Run in vLLM's environment: ``.venv-vllm/bin/python benchmarks/vllm_pd.py`` (scripts/vllm_suite.sh
creates it). Writes ``benchmarks/results/vllm_pd_cpu_<date>.{md,json}``.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))
from _engines import MODELS, Engine, prompts, write_model  # noqa: E402


def run(connector, model, args, tmp):
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    extra = {"engine": "nixl", "port": 5990} if connector == "dcp_jax" else {}
    p = Engine(model, "kv_producer", connector, extra, env=dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT="5690"),
               log=os.path.join(tmp, f"{connector}-p.log"), core=0)
    d = Engine(model, "kv_consumer", connector, extra, env=dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT="5691"),
               log=os.path.join(tmp, f"{connector}-d.log"), core=1)
    rows = []
    try:
        p.wait_ready()
        d.wait_ready()
        descs = []
        for i in range(args.reps + 1):
            before = _descs(connector, p, d)
            ps = prompts([args.tokens], seed=100 + i)
            pr = p.generate(ps, 1, params=[{"do_remote_decode": True}])
            dr = d.generate(ps, 1, params=[pr["outputs"][0]["kv_transfer_params"]])
            assert dr["outputs"][0]["finish_reason"] == "length", dr
            if i:  # the first is the warm-up (handshake, first registration use)
                rows.append(dict(prefill_s=pr["seconds"], decode_s=dr["seconds"],
                                 ttft_s=pr["seconds"] + dr["seconds"],
                                 descriptors=_descs(connector, p, d) - before))
    finally:
        p.close()
        d.close()
    return rows


def _descs(connector, p, d):
    """Descriptors the pair has submitted so far."""
    if connector == "dcp_jax":
        n = 0
        for e in (p, d):
            n += sum(side.get("descriptors", 0) for side in e.call(op="stats")["stats"].values())
        return n
    return d.call(op="stats")["stats"]["descriptors"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", f"vllm_pd_cpu_{datetime.date.today()}"),
                    help="path without extension: writes .json and .md")
    args = ap.parse_args()
    cfg = MODELS["llama-gqa"]
    kv_bytes = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * args.tokens
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(tmp, "llama-gqa")
        for c in ("dcp_jax", "nixl"):
            rows = run(c, model, args, tmp)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            out[c] = dict(runs=rows, median=med, kv_bytes=kv_bytes, kv_bytes_per_s=kv_bytes / med["decode_s"])
    import vllm

    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=f"CPU, {os.cpu_count()} cores, {platform.machine()} (shared with other helpers' jobs)",
               versions=dict(vllm=vllm.__version__, python=platform.python_version()),
               model="llama-gqa (2 layers, 2 KV heads x 64, bf16, dummy weights)", prompt_tokens=args.tokens,
               reps=args.reps, results=out,
               ratio_ttft_nixl_over_dcp_jax=out["nixl"]["median"]["ttft_s"] / out["dcp_jax"]["median"]["ttft_s"])
    lines = [f"| connector | TTFT ms | prefill ms | decode ms | KV MB/s | descriptors / request |",
             "|---|---|---|---|---|---|"]
    for c, label in (("dcp_jax", "DcpJaxConnector"), ("nixl", "stock NixlConnector (kv_buffer_device=cpu)")):
        m = out[c]["median"]
        lines.append(f"| {label} | {m['ttft_s'] * 1e3:.1f} | {m['prefill_s'] * 1e3:.1f} | {m['decode_s'] * 1e3:.1f} | "
                     f"{out[c]['kv_bytes_per_s'] / 1e6:.1f} | {m['descriptors']:g} |")
    note = (f"\n{args.tokens}-token prompt, {res['model']}, {res['device']}; medians of {args.reps} requests "
            f"after one warm-up; KV {kv_bytes} B per request. TTFT NixlConnector / DcpJaxConnector = "
            f"{res['ratio_ttft_nixl_over_dcp_jax']:.2f}. {res['date']}, vLLM {res['versions']['vllm']}.\n")
    text = "\n".join(lines) + "\n" + note
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("# vLLM P/D on CPU: DcpJaxConnector vs stock NixlConnector\n\n" + text)


if __name__ == "__main__":
    main()
