"""A hostile or broken peer for the two-host tests: raw control frames, raw TCP bytes, and a
handshake of its own over a real engine, so that it can send announcements a `KVReceiver` never
would (page ids outside its cache, a page table longer than the request, another connection's
request id).

It speaks the connector's wire format through `dcp_jax.transfer.protocol` (msgpack maps) but
builds messages itself, so the sender's checks are what stands between it and the sender's
engine. Its own cache is the first ``pages`` pages of larger arrays; the ``guard`` pages after
them are never registered and hold `SENTINEL`: `guard_ok` tells whether anything wrote there.
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any

import msgpack
import numpy as np
import zmq

from dcp_jax.netns.agents import SENTINEL

__all__ = ["Attacker", "hello_fields"]


def hello_fields(spec_dict: dict, peer: dict, name: str, layer_bases: bytes, group: str) -> dict:
    """Every field the current protocol's ``hello`` has, ours filled in and the rest at their
    neutral value (0, "", [], {}; ``mem`` "DRAM"), so this peer follows schema changes."""
    from dcp_jax.transfer import protocol as proto

    ours = dict(spec=spec_dict, peer=peer, group=group, direction="push", name=name, layer_bases=layer_bases,
                heartbeat_ms=500, peer_timeout_ms=5000)
    out = {}
    for field, (typ, _) in proto.KINDS["hello"].items():
        if field in ours:
            out[field] = ours[field]
        elif field == "mem":
            out[field] = "DRAM"
        else:
            out[field] = {int: 0, str: "", bytes: b"", list: [], dict: {}, bool: False}.get(typ, 0)
    return out


class Attacker:
    """Args: ``engine`` (its own engine's kind), ``host`` (its address), ``address`` (the
    sender's control plane), ``item_lens``/``page_size`` (the geometry it claims), ``pages`` and
    ``guard`` (its cache and the unregistered pages after it)."""

    def __init__(self, engine: str, host: str, address: str, item_lens, page_size: int, pages: int = 16,
                 guard: int = 8):
        from bridge import make_engine
        from bridge.regions import MemoryRegion

        self.host, self.address = host, address
        self.item_lens, self.page_size, self.pages = tuple(item_lens), page_size, pages
        self.full = [np.full((pages + guard, page_size, il), SENTINEL, np.uint8) for il in item_lens]
        opts = {"hostname": host} if engine == "mooncake" else {}
        self.engine = make_engine(engine, f"evil-{os.getpid()}-{uuid.uuid4().hex[:6]}", **opts)
        self.engine.register([MemoryRegion(a.ctypes.data, pages * page_size * il) for a, il in
                              zip(self.full, item_lens)])
        self.ctx = zmq.Context()
        self.sock = None  # the handshaked connection, once `handshake` was acked
        self.acked = None
        self.obj = None

    def hello(self):
        return None

    # ---- raw frames ---------------------------------------------------------------------------
    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{self.host}:0;{self.address[6:]}")
        return s

    @staticmethod
    def _drain(s: zmq.Socket, wait_s: float, until: tuple = ()) -> list:
        """Replies within ``wait_s`` (stops early at the first of kind in ``until``)."""
        out, deadline = [], time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0 and not (out and out[-1].get("k") in until):
            if not s.poll(int(left * 1000) + 1):
                break
            frame = s.recv()
            try:
                msg = msgpack.unpackb(frame, raw=False)
                out.append(msg if isinstance(msg, dict) else {"k": "?"})
            except Exception:  # noqa: BLE001 - the sender only sends valid frames; record if not
                out.append({"k": "undecodable"})
        return out

    def raw(self, frames: list, wait_s: float = 1.0, multipart: bool = False) -> list:
        """Sends ``frames`` (bytes each) on a fresh, never-handshaked connection; returns the
        replies (decoded maps) that came within ``wait_s``."""
        s = self._dealer()
        try:
            if multipart:
                s.send_multipart(frames)
            else:
                for f in frames:
                    s.send(f)
            return self._drain(s, wait_s)
        finally:
            s.close(0)

    def tcp_garbage(self, nbytes: int, seed: int, connections: int = 4) -> int:
        """Opens ``connections`` plain TCP connections to the control port and writes
        ``nbytes`` random bytes on each (no ZMTP greeting); returns bytes written."""
        host, port = self.address[6:].rsplit(":", 1)
        rng = np.random.default_rng(seed)
        sent = 0
        for _ in range(connections):
            with socket.create_connection((host, int(port)), timeout=5, source_address=(self.host, 0)) as c:
                try:
                    c.sendall(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
                    sent += nbytes
                except OSError:  # the peer hung up on the garbage: fine
                    pass
                time.sleep(0.05)
        return sent

    def connect_tcp(self, host: str, port: int) -> bool:
        """A plain TCP connect from this peer's address (raises ConnectionRefusedError)."""
        with socket.create_connection((host, port), timeout=5, source_address=(self.host, 0)):
            return True

    # ---- a handshaked connection --------------------------------------------------------------
    def handshake(self, dcp_size: int = 1, dcp_rank: int = 0, group: str = "evil", **spec_changes) -> dict:
        """A valid hello (own engine metadata, own layers) on a connection kept open; returns
        the answer (``hello_ack`` or ``hello_nack``). Once acked, the same call returns that
        answer again and keeps the connection (a second one would be refused as a duplicate)."""
        from dcp_jax.transfer import KVCacheSpec
        from dcp_jax.transfer import protocol as proto

        kw = dict(num_layers=len(self.item_lens), item_lens=list(self.item_lens), page_size=self.page_size,
                  dcp_size=dcp_size, dcp_rank=dcp_rank)
        kw.update(spec_changes)
        if self.acked is not None and not spec_changes:
            return self.acked
        spec = KVCacheSpec(**kw).to_dict()
        bases = proto.pack_i64([a.ctypes.data for a in self.full])
        fields = hello_fields(spec, self.engine.peer_info().to_dict(), self.engine.name, bases, group)
        if self.sock is not None and self.acked is None:
            self.sock.close(0)
        sock = self._dealer()
        sock.send(proto.encode("hello", **fields))
        for msg in self._drain(sock, 10.0, until=("hello_ack", "hello_nack")):
            if msg.get("k") in ("hello_ack", "hello_nack"):
                ans = {k: v for k, v in msg.items() if k in ("k", "field", "ours", "theirs", "message", "name")}
                if msg["k"] == "hello_ack":
                    from bridge import PeerInfo

                    self.engine.add_peer(PeerInfo.from_dict(msg["peer"]))
                    self.sock, self.acked = sock, ans
                else:
                    sock.close(0)
                return ans
        raise TimeoutError("no answer to the hello")

    def send_msg(self, kind: str, rid: str = "", inc: int = 0, wait_s: float = 0.5, **fields: Any) -> list:
        """One well-formed message on the handshaked connection; returns what came back."""
        from dcp_jax.transfer import protocol as proto

        self.sock.send(proto.encode(kind, rid, inc, **fields))
        return self._drain(self.sock, wait_s)

    def send_raw_on_conn(self, frame: bytes, wait_s: float = 0.5) -> list:
        """Any bytes on the handshaked connection; returns what came back."""
        self.sock.send(frame)
        return self._drain(self.sock, wait_s)

    def expect(self, rid: str, inc: int, num_tokens: int, table, dcp_rank: int = 0, wait_s: float = 0.5) -> list:
        from dcp_jax.transfer import protocol as proto

        return self.send_msg("expect", rid, inc, wait_s, num_tokens=num_tokens, prefix_tokens=0,
                             page_table=proto.pack_i64(table), dcp_rank=dcp_rank)

    def notes(self) -> int:
        """Engine notifications that reached this peer (a sender that wrote to it says so)."""
        return sum(len(v) for v in self.engine.notifications().values())

    def guard_ok(self) -> bool:
        """True when no byte of this peer's memory changed: neither its registered cache (it
        announced nothing valid) nor the unregistered guard pages after it."""
        return all(bool((a == SENTINEL).all()) for a in self.full)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.engine.close()
        self.ctx.term()
