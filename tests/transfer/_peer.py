"""A connector side in its own process (spawned), for tests that kill it mid-request."""
import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_LOG_LEVEL", "fatal")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def receiver_main(conn, engine, address, item_lens, page_size, rid, num_tokens, peer_timeout_s):
    """Connects, expects one request on pages 0.., reports 'ready', then idles until killed."""
    import time

    import numpy as np

    from dcp_jax.transfer import KVCacheSpec, KVReceiver

    spec = KVCacheSpec(len(item_lens), item_lens, page_size)
    kv = [np.zeros((64, page_size, il), np.uint8) for il in item_lens]
    recv = KVReceiver(spec, kv, engine=engine, peer_timeout_s=peer_timeout_s, timeout_s=60)
    recv.connect(address)
    recv.expect(rid, np.arange(-(-num_tokens // page_size)), num_tokens)
    conn.send("ready")
    while True:
        conn.send(recv.poll(rid).value)
        time.sleep(0.05)


def sender_main(conn, engine, item_lens, page_size, peer_timeout_s):
    """Serves one sender; sends its address, then on 'send' queues the first chunk and idles."""
    import time

    import numpy as np

    from dcp_jax.transfer import KVCacheSpec, KVSender

    spec = KVCacheSpec(len(item_lens), item_lens, page_size)
    kv = [np.ones((64, page_size, il), np.uint8) for il in item_lens]
    sender = KVSender(spec, kv, engine=engine, peer_timeout_s=peer_timeout_s, timeout_s=60)
    conn.send(sender.address)
    rid, num_tokens = conn.recv()
    sender.send(rid, np.arange(-(-num_tokens // page_size)), 0, page_size)
    conn.send("sent")
    while True:
        time.sleep(0.05)
