"""The connector's control plane: one ZeroMQ ROUTER on the sender's address, a DEALER per receiver.

Only byte frames cross it; `dcp_jax.transfer.protocol` parses and validates them. A frame that
fails validation is dropped and counted (`rejected`) and the connection lives on. Sockets are
used by the thread that polls them (the owner's worker thread). Closing never waits for a peer:
zmq's close returns at once, and ``linger_ms`` only lets the I/O thread try a little longer to
deliver the last frames (a ``bye``) in the background.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from dcp_jax._validate import check_int_type
from dcp_jax.transfer import protocol

__all__ = ["ControlServer", "ControlClient", "check_local_host", "zmq_context", "engine_options_for", "make_side_engine"]

logger = logging.getLogger(__name__)
#: How long a closed socket's I/O thread still tries to deliver its last frames (the ``bye`` and
#: the ``failed`` of live requests), in the background (ms).
BYE_LINGER_MS = 500
#: Refused frames logged per socket before the log goes quiet (a flood of garbage must not
#: flood the log; every refusal is still counted in ``rejected``).
MAX_LOGGED_REJECTIONS = 10


def engine_options_for(engine: str, host: str | None, options: dict | None) -> dict:
    """The engine options of a connector side bound to ``host``: Mooncake and jax-transfer (its
    side channel and transfer server) listen where the control plane is (their ``hostname``
    defaults to ``host``); NIXL/UCX picks its interfaces from ``UCX_NET_DEVICES``. An explicit
    ``options["hostname"]`` wins."""
    out = dict(options or {})
    if host is not None and "hostname" not in out:
        from bridge import available_engines

        kind = engine if engine != "auto" else (available_engines() or ["nixl"])[0]
        if kind in ("mooncake", "jax-transfer"):
            out["hostname"] = host
    return out


def make_side_engine(engine: str, name: str, host: str | None, options: dict | None):
    """`bridge.make_engine` for a connector side: `engine_options_for` its ``host``.

    Raises:
        TypeError: ``options`` not a dict, or a key the engine adapter does not take (the message
            names ``engine_options``); and what `bridge.make_engine` raises.
    """
    from bridge import make_engine

    if options is not None and not isinstance(options, dict):
        raise TypeError(f"engine_options must be a dict or None, got {type(options).__name__}")
    kw = engine_options_for(engine, host, options)
    try:
        return make_engine(engine, name, **kw)
    except TypeError as exc:  # an adapter's __init__ refusing a keyword: say where it came from
        if "keyword argument" not in str(exc):
            raise
        raise TypeError(f"engine_options={options!r}: {exc}") from None


def _log_rejection(sock_owner: Any, peer: str, why: str) -> None:
    if sock_owner.rejected <= MAX_LOGGED_REJECTIONS:
        logger.warning("control plane: refused a frame from %s: %s%s", peer, why,
                       " (further refusals are counted, not logged)" if sock_owner.rejected == MAX_LOGGED_REJECTIONS else "")

_CTX_LOCK = threading.Lock()
_CTX: dict[int, zmq.Context] = {}


def zmq_context() -> zmq.Context:
    """This process's ZeroMQ context (made once per pid, so a forked child makes its own)."""
    import os

    with _CTX_LOCK:
        pid = os.getpid()
        if pid not in _CTX:
            _CTX[pid] = zmq.Context()
        return _CTX[pid]


def _socket(kind: int) -> zmq.Socket:
    s = zmq_context().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    # Frames larger than this would be refused by `protocol.decode` anyway; zmq drops the
    # connection beyond MAXMSGSIZE, so the limit there is generous and the real one is ours.
    s.setsockopt(zmq.MAXMSGSIZE, 4 * protocol.MAX_CONTROL_BYTES)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    return s


class ControlServer:
    """The sender's ROUTER socket: frames from many receivers, replies by their identity.

    Args:
        host: interface to bind (an address of this machine, e.g. "127.0.0.1").
        port: TCP port, 0 for any free one.

    Attributes:
        address: ``"tcp://host:port"``, what receivers `connect` to.
        rejected: frames dropped by validation.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        port = check_int_type("port", port)  # TypeError for 1.5 or True, as every int argument
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be an int in [0, 65535] (0: any free port)")
        self.sock = _socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises, not drops
        try:
            if port == 0:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise ValueError(f"cannot listen on host={host!r}, port={port}: {exc}") from None
        self.address = f"tcp://{host}:{port}"
        self.rejected = 0
        self.last_error = ""

    def recv(self) -> list[tuple[bytes, dict[str, Any]]]:
        """Every frame waiting now, validated: ``[(identity, message)]``; never blocks. A refused
        frame is dropped and counted; one that names a request (`protocol.refusal`) comes back
        as a ``_refused`` message for it, a ``hello`` of another version as ``_bad_version``."""
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            if len(frames) != 2:
                self.rejected += 1
                _log_rejection(self, frames[0].hex(), f"{len(frames) - 1} frames in one message, 1 expected")
                continue
            try:
                out.append((frames[0], protocol.decode(frames[1])))
            except protocol.ProtocolError as exc:
                self.rejected += 1
                self.last_error = str(exc)
                _log_rejection(self, frames[0].hex(), str(exc)[:300])
                bad = _hello_of_another_version(frames[1])
                if bad is not None:  # answered with a refusal naming the version, not silence
                    out.append((frames[0], {"k": "_bad_version", "v": bad}))
                elif (refused := protocol.refusal(frames[1], exc)) is not None:  # its request fails now
                    out.append((frames[0], refused))

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Sends one frame to a receiver; False if it is gone (nothing raised)."""
        try:
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def close(self, linger_ms: int = 0) -> None:
        """Closes the socket at once; frames already queued get ``linger_ms`` more to leave."""
        self.sock.close(linger=linger_ms)


def _hello_of_another_version(frame: bytes):
    """The version a refused frame claims if it is a ``hello`` of another protocol version."""
    try:  # bounded as `protocol.decode` is: a refused frame may be up to 4 x that long, or a bomb
        msg = protocol.unpack(frame)
    except protocol.ProtocolError:  # garbage: no answer
        return None
    if isinstance(msg, dict) and msg.get("k") == "hello" and msg.get("v") != protocol.PROTOCOL_VERSION:
        v = msg.get("v")
        return v if isinstance(v, (int, str)) and not isinstance(v, bool) else repr(v)[:64]
    return None


def check_address(address: Any) -> None:
    """Raises ValueError (naming ``address``) unless it is ``"tcp://host:port"``, port 1..65535:
    zmq would accept a bad port and the connect would only time out."""
    host, _, port = address[6:].rpartition(":") if isinstance(address, str) and address.startswith("tcp://") \
        else ("", "", "")
    if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"address={address!r} must be 'tcp://host:port' with a port in 1..65535 (KVSender.address)")


def check_local_host(host: str) -> None:
    """Raises ValueError (naming ``host``) unless a socket can be bound to it: an address of this
    machine. Otherwise connections made from it would only time out, pointing at the peer."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as exc:
        raise ValueError(f"host={host!r} is not an address of this machine: {exc.strerror or exc}") from None


class ControlClient:
    """A receiver's DEALER socket to one sender.

    Args:
        address: the sender's ``"tcp://host:port"``.
        source: local address to connect from (an address of this machine; None: any).

    Raises:
        ValueError: ``address`` is not a ``tcp://host:port`` string with a port in 1..65535.
    """

    def __init__(self, address: str, source: str | None = None):
        check_address(address)
        self.address = address
        self.sock = _socket(zmq.DEALER)
        # zmq's "tcp://source:0;host:port" binds the connection's local end to ``source``.
        self.sock.connect(address if source is None else f"tcp://{source}:0;{address[6:]}")
        self.rejected = 0
        self.last_error = ""

    def send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def recv(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Every validated frame waiting (waits up to ``timeout_ms`` for the first). A refused
        frame is dropped and counted; one that names a request comes back as a ``_refused``
        message for it (`protocol.refusal`)."""
        out = []
        if timeout_ms and not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            try:
                out.append(protocol.decode(frame))
            except protocol.ProtocolError as exc:
                self.rejected += 1
                self.last_error = str(exc)
                _log_rejection(self, self.address, str(exc)[:300])
                refused = protocol.refusal(frame, exc)
                if refused is not None:  # the request it names fails now, saying why
                    out.append(refused)

    def close(self, linger_ms: int = 0) -> None:
        """Closes the socket at once; frames already queued get ``linger_ms`` more to leave."""
        self.sock.close(linger=linger_ms)
