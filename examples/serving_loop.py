"""A JAX serving loop on the dcp-jax connector: one prefill process, two decode ranks.

Prefill/decode disaggregation with decode context parallelism (DCP): the prefill process runs
each request chunk by chunk (a jitted stand-in for the model writes the KV cache) and hands each
chunk to a `KVSender`. Each decode rank's `KVReceiver` over its own paged JAX cache gets only the
tokens it owns: rank r owns tokens t with t % 2 == r, stored densely (token t at local row t // 2)
in the pages of its own page table (docs/conventions.md, sections 2, 3 and 10).

    python examples/serving_loop.py [--engine nixl|mooncake] [--direction push|pull]
"""
import argparse
import multiprocessing as mp
import os
import time
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dcp_jax.layout import local_index, local_len, owner
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus

NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_DIM = 3, 64, 16, 576  # MLA: one 576-wide bf16 row per token
DCP_SIZE, CHUNK, MAX_TOKENS = 2, 64, 256  # decode ranks, prefill chunk, longest prompt (tokens)
ITEM_LENS = [KV_DIM * 2] * NUM_LAYERS  # bytes per token of each layer (what the engines move)
ENGINE_ENV = dict(UCX_NET_DEVICES="lo", UCX_LOG_LEVEL="fatal", NIXL_LOG_LEVEL="WARN",
                  MC_LOG_LEVEL="ERROR")  # one machine: engines on loopback, and quiet
REQUESTS = {"req-0": 1, "req-1": 17, "req-2": 64, "req-3": 100, "req-4": 200}  # id -> prompt tokens


def prompt(rid):  # (both sides derive the prompt here; in a real stack the router knows it)
    """A request's token ids, zero-padded to MAX_TOKENS: fixed shapes, so JAX compiles once."""
    ids = np.random.default_rng(int(rid[4:])).integers(0, 32000, REQUESTS[rid]).astype(np.int32)
    return np.pad(ids, (0, MAX_TOKENS - len(ids)))


@jax.jit
def model_kv(token_ids, positions):
    """Stand-in for the model's prefill: the KV row of every (layer, token), bf16 [layers, T, D]."""
    layer = jnp.arange(NUM_LAYERS)[:, None, None]
    x = (token_ids[None, :, None] * 31 + positions[None, :, None] * 7 + layer * 1009
         + jnp.arange(KV_DIM)[None, None, :]) % 251
    return (x.astype(jnp.float32) / 8).astype(jnp.bfloat16)


def prefill_main(engine, addr_q, ranks_done, result_q):
    # The prefill cache is host numpy (bf16) and the engine reads these very bytes. (A JAX array
    # an engine has registered cannot be updated in place: XLA would copy it, not donate it.)
    cache = [np.zeros((NUM_PAGES, PAGE_SIZE, KV_DIM), ml_dtypes.bfloat16) for _ in range(NUM_LAYERS)]
    sender = KVSender(KVCacheSpec(NUM_LAYERS, ITEM_LENS, PAGE_SIZE), cache, engine=engine)
    for _ in range(DCP_SIZE):
        addr_q.put(sender.address)  # out of band: how the decode ranks find this sender
    # (GPU caches: once the decode ranks have linked, `sender.warm_up()` compiles the pack and
    # fused launches before the first request; host numpy compiles nothing.)
    free_pages = list(range(NUM_PAGES))  # this process's page allocator
    for rid, n in REQUESTS.items():  # the scheduler's loop: prefill one request after another
        pages = np.array([free_pages.pop() for _ in range(-(-n // PAGE_SIZE))])  # its page table
        for start in range(0, n, CHUNK):  # chunked prefill: one forward pass per chunk
            stop = min(start + CHUNK, n)
            kv = np.asarray(model_kv(prompt(rid)[start:start + CHUNK], np.arange(start, start + CHUNK)))
            t = np.arange(start, stop)
            for layer in range(NUM_LAYERS):  # the model writes the chunk's KV into its pages
                cache[layer][pages[t // PAGE_SIZE], t % PAGE_SIZE] = kv[layer, :stop - start]
            sender.send(rid, pages, start, stop)  # returns at once; the transfer runs behind
    for _ in range(DCP_SIZE):
        ranks_done.acquire(timeout=60)  # keep serving until every decode rank has its rows
    status = "/".join(sorted({sender.poll(rid).name for rid in REQUESTS}))
    result_q.put(("prefill", f"{len(REQUESTS)} requests sent, status {status}", status == "SUCCESS"))
    sender.close()


def decode_main(rank, engine, direction, addr_q, ranks_done, result_q):
    cache = [jnp.zeros((NUM_PAGES, PAGE_SIZE, KV_DIM), jnp.bfloat16) for _ in range(NUM_LAYERS)]
    spec = KVCacheSpec(NUM_LAYERS, ITEM_LENS, PAGE_SIZE, dcp_size=DCP_SIZE, dcp_rank=rank)
    receiver = KVReceiver(spec, cache, engine=engine, direction=direction)
    receiver.warm_up()  # GPU caches: compiles the region unpack before any window (host: nothing)
    receiver.connect(addr_q.get(timeout=60))  # versioned handshake: both geometries checked
    tables, free_pages = {}, list(range(NUM_PAGES))  # this rank's own page allocator
    for rid, n in REQUESTS.items():  # announce where this rank's rows of each request go
        rows = int(local_len(n, DCP_SIZE, rank))  # tokens of [0, n) this rank owns
        tables[rid] = np.array([free_pages.pop() for _ in range(-(-rows // PAGE_SIZE))], np.int32)
        receiver.expect(rid, tables[rid], n)
    pending, ok, checked, done = set(REQUESTS), True, 0, 0
    while pending:  # the decode scheduler polls; a request joins the decode batch once SUCCESS
        time.sleep(0.001)  # (a real loop runs decode steps here)
        for rid in [r for r in sorted(pending) if receiver.poll(r).terminal]:
            pending.discard(rid)
            if (status := receiver.poll(rid)) is not TransferStatus.SUCCESS:
                print(f"rank {rank}: {rid} {status.name}: {receiver.failure_reason(rid)}")
                ok = False
                continue
            table = np.pad(tables[rid], (0, MAX_TOKENS // PAGE_SIZE - len(tables[rid])))
            same, n = rows_match(rank, cache, table, prompt(rid), REQUESTS[rid])
            ok, checked, done = ok and bool(same), checked + int(n), done + 1
            receiver.release(rid)  # the connector forgets it; the pages now serve decode steps
    ranks_done.release()
    result_q.put((f"decode rank {rank}", f"{done}/{len(REQUESTS)} requests SUCCESS, {checked} owned "
                  f"tokens x {NUM_LAYERS} layers {'byte-exact' if ok else 'MISMATCH'}", ok))
    receiver.close()


@jax.jit
def rows_match(rank, cache, table, token_ids, n):
    """Reads this rank's rows of a request from its cache; True if each is the model's value."""
    t = jnp.arange(MAX_TOKENS)  # token positions (padded: only those < n count)
    j = local_index(t, DCP_SIZE)  # the dense local row of token t on its owner rank...
    rows = table[j // PAGE_SIZE] * PAGE_SIZE + j % PAGE_SIZE  # ...in the page the table names
    got = jnp.stack([layer.reshape(-1, KV_DIM)[rows] for layer in cache])
    same = (got.view(jnp.uint16) == model_kv(token_ids, t).view(jnp.uint16)).all(axis=(0, 2))
    mine = (owner(t, DCP_SIZE) == rank) & (t < n)  # the tokens this rank owns
    return jnp.all(same | ~mine), mine.sum()


def child(fn, result_q, *args):
    try:
        fn(*args, result_q)
    except Exception:  # report to the parent, which then exits non-zero
        result_q.put((fn.__name__, traceback.format_exc(), False))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="nixl", choices=["nixl", "mooncake"])
    ap.add_argument("--direction", default="push", choices=["push", "pull"])
    args = ap.parse_args()
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)  # (the child processes inherit it)
    ctx = mp.get_context("spawn")  # engines and JAX want fresh processes, not forks
    addr_q, result_q, ranks_done = ctx.Queue(), ctx.Queue(), ctx.Semaphore(0)
    jobs = [(prefill_main, args.engine, addr_q, ranks_done)]
    jobs += [(decode_main, r, args.engine, args.direction, addr_q, ranks_done) for r in range(DCP_SIZE)]
    procs = [ctx.Process(target=child, args=(fn, result_q, *a), daemon=True) for fn, *a in jobs]
    for p in procs:
        p.start()
    print(f"{args.engine} {args.direction}: 1 prefill process, {DCP_SIZE} decode ranks, {NUM_LAYERS} layers")
    try:
        results = [result_q.get(timeout=90) for _ in procs]
    except Exception:  # (queue.Empty) a process died without reporting
        results = [("main", "timed out waiting for a process", False)]
    for name, line, _ in sorted(results):
        print(f"  {name}: {line}")
    for p in procs:
        p.join(10)  # (daemon processes: one still stuck is stopped when this one exits)
    ok = all(good for _, _, good in results)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
