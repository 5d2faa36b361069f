"""Control-plane and notification messages: msgpack maps checked against a schema, never pickle.

Every message is a msgpack map carrying ``v`` (protocol version), ``k`` (kind), ``rid``
(request id, "" for connection-level messages), ``inc`` (the receiver's incarnation of that
request, so a request id reused after `release` never collects a stale message) and, where it
concerns one, ``chunk``. `decode` refuses anything that is not exactly one of the kinds below
with the right field types and bounds; the caller drops it and counts it. Nothing a peer sends
is trusted before it passed here, and addresses in it are validated again by the engine adapter
against the registrations before any byte moves.

Kinds (receiver -> sender): ``hello``, ``expect``, ``abort``, ``failed``, ``pull_done``,
``region_grant`` (region path: where in this rank's registered receive region a window goes),
``ping``, ``bye``.
Kinds (sender -> receiver): ``hello_ack``, ``hello_nack``, ``abort``, ``failed``, ``pull_ready``,
``sent`` (a batch with a ``done`` notification was just submitted: the receiver polls its engine
while such batches are due, and idles otherwise; a region write sends none: its rank counts the
``done`` as due from its own ``region_grant``), ``region_ask`` (region path: a packed window
wants room in the receive region; ``ctl_done``: its ``done`` comes as a control frame, not an engine
notification, so the rank need not poll its engine for it: the sender's ``region_notify="round"``), ``fused_done`` (fused path: the sender's copy kernel into this
rank's IPC-mapped pages has finished, or, gated, was launched and bumps the flag page to ``seq`` once it has), ``drained`` (after a request ended without success, no WRITE of the sender's into that rank's
pages is in flight any more), ``moving`` (connection-level: which of that rank's requests have
an engine batch or a pull the sender still sees in flight within its bound, each with a lease:
at most `MAX_MOVING` entries ``[rid, inc, lease_ms]``, a lease at most `MAX_LEASE_MS`; the rank
counts such a request as progressing until its lease runs out: `KVReceiver`'s docstring),
``ping``, ``bye``. ``bye`` (either way, connection-level): the
side closed this connection on purpose (``close()``, or it dropped the peer), so the other side
drops it now instead of after ``peer_timeout_s`` of silence; ``drained`` says its engine is torn
down (sent after ``close()`` closed the engine), so nothing of it is in flight any more. Engine notification (sender -> receiver, delivered by the engine after the batch's
bytes landed): ``done``.
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

__all__ = [
    "PROTOCOL_VERSION", "MAX_CONTROL_BYTES", "MAX_FIELD_BYTES", "MAX_EXPECT_PAGES", "MAX_PULL_ROWS",
    "check_expect_pages", "MAX_NOTIF_BYTES", "ProtocolError", "encode", "decode", "unpack", "pack_i64",
    "unpack_i64", "KINDS", "PATHS", "MAX_MOVING", "MAX_LEASE_MS",
]

#: Bumped on any change of a message's meaning; peers of another version are refused at hello.
PROTOCOL_VERSION = 11  # 11: region_ask says whether its done comes as a control frame (ctl_done); 10: moving (a rank's requests with a batch in flight keep their clock); 9: no ``sent`` for a region write (the rank counts its grant as a done due); 8: bye; 7: hello_ack offers the fused path's flag page, fused_done carries its sequence number; 6: (an IPC event instead); 5: hello states the receiver's cache pages; 4: hello and hello_ack state whether the side stages
#: Path names a sender may answer a hello with (`dcp_jax.transfer._region.choose_path`).
PATHS = ("direct", "packed", "region", "fused")
MAX_IPC_HANDLES = 4096     # one CUDA IPC handle per KV layer entry at most (spec.MAX_LAYERS)
#: Largest control message accepted (bytes). A direct pull of 262,144 rows is 2 MiB of rows.
MAX_CONTROL_BYTES = 16 << 20
#: Largest bytes field of a message (a page table, a pull's rows): `MAX_CONTROL_BYTES` less room
#: for the rest of the message (kind, id of up to `MAX_REQUEST_ID` bytes, a few ints), so a field
#: within its bound never makes a frame the peer refuses.
MAX_FIELD_BYTES = MAX_CONTROL_BYTES - 4096
#: Most pages one ``expect`` announces (int64 page ids within `MAX_FIELD_BYTES`): 2,096,640.
MAX_EXPECT_PAGES = MAX_FIELD_BYTES // 8
#: Most rows of one direct window a pull names (``pull_ready.src_rows``, int64): 2,096,640. The
#: planner splits a direct chunk into windows of at most this many rows (`rank_chunk`).
MAX_PULL_ROWS = MAX_FIELD_BYTES // 8
#: Largest engine notification accepted (bytes).
MAX_NOTIF_BYTES = 1024
#: Longest request id in UTF-8 bytes (256 ASCII characters): a ``done`` notification carrying it
#: stays within `MAX_NOTIF_BYTES`.
MAX_REQUEST_ID = 256
MAX_TEXT = 4096            # characters of a reason / message
#: Entries of one ``moving`` frame at most (a sender with more such requests to one rank sends several).
MAX_MOVING = 1024
#: Longest lease a ``moving`` entry may give (ms): a day, the longest ``peer_timeout_s`` a side takes.
MAX_LEASE_MS = 86_400_000
_I64 = (1 << 63) - 1


class ProtocolError(ValueError):
    """A message is malformed, oversized, of another version or of an unknown kind."""


# field -> (type(s), lower bound for ints or max length for str/bytes)
_INT, _STR, _BYTES, _BOOL, _DICT, _LIST, _ANY = int, str, bytes, bool, dict, list, object
_COMMON = {"v": (_INT, 0), "k": (_STR, 32), "rid": (_STR, MAX_REQUEST_ID), "inc": (_INT, 0)}
_CHUNK = {"chunk": (_INT, 0), "part": (_INT, 0), "nparts": (_INT, 1), "start": (_INT, 0),
          "stop": (_INT, 0), "nrows": (_INT, 0)}
KINDS: dict[str, dict[str, tuple]] = {
    # region_addr/region_bytes: the receive region (bytes; 0 = none offered); mem: "DRAM"/"VRAM"
    # of the KV layers; ipc: CUDA IPC handle dicts of the layers (bridge.cuda_ipc, checked by
    # IpcHandle.from_dict before use), [] when not offered; host: where the receiver runs;
    # heartbeat_ms / peer_timeout_ms: its ping interval and silence limit (each side's pings must
    # come well inside the other's limit: `SenderHandshake._check_liveness`); staged: the side's KV is
    # not registered, it stages through host memory (`dcp_jax.transfer.staging`); num_pages: pages
    # of its layer caches (the per-head layouts' plane strides need it: `dcp_jax.transfer.views`).
    "hello": {"spec": (_DICT, 0), "peer": (_DICT, 0), "group": (_STR, 256), "direction": (_STR, 8),
              "name": (_STR, 256), "layer_bases": (_BYTES, 8 * 4096), "region_addr": (_INT, 0),
              "region_bytes": (_INT, 0), "mem": (_STR, 8), "ipc": (_LIST, MAX_IPC_HANDLES),
              "host": (_DICT, 0), "heartbeat_ms": (_INT, 1), "peer_timeout_ms": (_INT, 1),
              "staged": (_BOOL, 0), "num_pages": (_INT, 0)},
    # flag: the name of the fused path's flag page (`bridge.host_flag.SharedFlag`; "" = none): a
    # ``fused_done`` with gated=True is sent right after the copy's launch, and the rank counts its
    # rows only once that page reads ``seq`` or later (`OpenedFlag.done`; seq < 2**32).
    "hello_ack": {"spec": (_DICT, 0), "peer": (_DICT, 0), "layer_bases": (_BYTES, 8 * 4096),
                  "name": (_STR, 256), "path": (_STR, 16), "staged": (_BOOL, 0), "flag": (_STR, 64)},
    "hello_nack": {"field": (_STR, 64), "ours": (_ANY, 0), "theirs": (_ANY, 0), "message": (_STR, MAX_TEXT)},
    "expect": {"num_tokens": (_INT, 0), "prefix_tokens": (_INT, 0), "page_table": (_BYTES, MAX_FIELD_BYTES),
               "dcp_rank": (_INT, 0)},
    "abort": {"reason": (_STR, MAX_TEXT)},
    "failed": {"reason": (_STR, MAX_TEXT)},
    "pull_ready": {**_CHUNK, "lo": (_INT, 0), "src_addr": (_INT, 0), "src_rows": (_BYTES, MAX_FIELD_BYTES)},
    "pull_done": {"chunk": (_INT, 0), "part": (_INT, 0), "ok": (_BOOL, 0), "reason": (_STR, MAX_TEXT)},
    "done": dict(_CHUNK),
    "region_ask": {**_CHUNK, "lo": (_INT, 0), "nbytes": (_INT, 1), "ctl_done": (_BOOL, 0)},
    "region_grant": {"chunk": (_INT, 0), "part": (_INT, 0), "offset": (_INT, 0), "nbytes": (_INT, 1)},
    "fused_done": {**_CHUNK, "gated": (_BOOL, 0), "seq": (_INT, 0)},
    "drained": {},
    "sent": {"chunk": (_INT, 0), "part": (_INT, 0)},
    # reqs: [[rid, inc, lease_ms], ...] (`_check_moving`): requests of the receiving rank with an
    # engine batch (push) or pull in flight on the sender within its bound; rid/inc of the frame
    # itself are "" / 0 (connection-level).
    "moving": {"reqs": (_LIST, MAX_MOVING)},
    "ping": {},
    # drained: the side's engine is torn down (`bridge` engine ``torn_down``): none of its writes
    # or reads is in flight any more, so the peer may give back what it held for them at once.
    "bye": {"reason": (_STR, MAX_TEXT), "drained": (_BOOL, 0)},
}


def check_expect_pages(rows: int, page_size: int, num_tokens: int, name: str = "num_tokens") -> None:
    """Refuses a request whose rank's rows fill more pages than one ``expect`` carries.

    Args:
        rows: the rank's local rows of the request (`dcp_jax.layout.local_len_np`).
        page_size: tokens per page.
        num_tokens: the request's tokens (for the message).
        name: what to call ``num_tokens`` in the message (an option of a CLI, say).

    Raises:
        ValueError: ``ceil(rows / page_size) > MAX_EXPECT_PAGES`` (names ``name``, the pages and
            the bound).
    """
    pages = -(-rows // page_size)
    if pages > MAX_EXPECT_PAGES:
        raise ValueError(f"{name}={num_tokens:,}: a decode rank's {rows:,} local rows fill {pages:,} pages of "
                         f"page_size={page_size}, and one expect announces at most {MAX_EXPECT_PAGES:,} "
                         f"(its page table must fit the control plane's {MAX_CONTROL_BYTES >> 20} MiB frame): "
                         "use a larger page_size or more DCP ranks")


def encode(kind: str, rid: str = "", inc: int = 0, **fields: Any) -> bytes:
    """One message as msgpack bytes (the sender of a message checks it like its receiver will).

    Raises:
        ProtocolError: unknown kind, missing/extra fields, or values outside the schema.
    """
    msg = {"v": PROTOCOL_VERSION, "k": kind, "rid": rid, "inc": inc, **fields}
    _check(msg)
    # Free text (a reason, an exception's words) may hold lone surrogates (`os.fsdecode`'s): sent
    # escaped, never raising here, after the state change the message reports. Ids and group
    # names are checked to be UTF-8 at the API (`check_request_id`), so escaping never alters one.
    data = msgpack.packb(msg, use_bin_type=True, unicode_errors="backslashreplace")
    if len(data) > MAX_CONTROL_BYTES:  # the peer's `decode` would refuse it: fail here, loudly
        raise ProtocolError(f"{kind}: message of {len(data)} bytes exceeds the limit of {MAX_CONTROL_BYTES}")
    return data


def decode(data: Any, *, max_bytes: int = MAX_CONTROL_BYTES) -> dict[str, Any]:
    """Parses and validates one message received from a peer.

    Args:
        data: the raw bytes (a zmq frame or an engine notification).
        max_bytes: refuse anything longer (bytes).

    Returns:
        The message as a dict with exactly the fields of its kind.

    Raises:
        ProtocolError: not bytes, too long, not a msgpack map, another protocol version, an
            unknown kind, or a field missing, extra, of the wrong type or out of bounds.
    """
    msg = unpack(data, max_bytes=max_bytes)
    _check(msg)
    return msg


#: Kinds that concern no one request: a refused one of these names no request to fail.
_NOT_OF_A_REQUEST = frozenset({"hello", "hello_ack", "hello_nack", "ping", "bye", "moving"})


def refusal(data: Any, error: Exception) -> dict[str, Any] | None:
    """The request a frame that `decode` refused (``error``) names, so the side that refused it
    can fail that request at once, saying why, instead of both sides waiting out ``timeout_s``
    for what the frame was to bring: ``{"k": "_refused", "rid", "inc", "what": kind, "reason",
    "window": [chunk, part] or None}`` (an internal message, never sent; ``window`` where the
    frame's ``chunk`` and ``part`` are ints in [0, 2^63)). Only when the frame unpacks (bounded,
    as `decode`) to a map of this protocol version and of a known kind about one request, with
    a ``rid`` of 1 to `MAX_REQUEST_ID` characters and an ``inc`` int in [0, 2^63); else None
    (garbage, another version, a frame that names no request): the frame is only dropped and
    counted."""
    try:
        msg = unpack(data)
    except ProtocolError:
        return None
    if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
        return None
    kind, rid, inc = msg.get("k"), msg.get("rid"), msg.get("inc")
    if not isinstance(kind, str) or kind not in KINDS or kind in _NOT_OF_A_REQUEST:
        return None
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        return None
    if not _int_in(inc, 0):
        return None
    window = [msg.get("chunk"), msg.get("part")]  # a pull_ready's / pull_done's: its pack region can go
    if not all(_int_in(v, 0) for v in window):
        window = None
    return {"k": "_refused", "rid": rid, "inc": inc, "what": kind, "reason": str(error)[:300], "window": window}


def unpack(data: Any, *, max_bytes: int = MAX_CONTROL_BYTES) -> Any:
    """msgpack of a peer, bounded (its length, and each string, bytes, array and map in it),
    not yet checked against a kind's schema (`decode` does that).

    Raises:
        ProtocolError: not bytes, longer than ``max_bytes``, or not msgpack within the bounds.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_bin_len=max_bytes,
                               max_str_len=max_bytes, max_array_len=1 << 16, max_map_len=64,
                               use_list=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for garbage
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None


def _int_in(v: Any, low: int) -> bool:
    """An int (not a bool) in [low, 2^63): what an int field of a message may hold."""
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= _I64


def _check(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise ProtocolError(f"message must be a map, got {type(msg).__name__}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
    kind = msg.get("k")
    schema = KINDS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    want = {**_COMMON, **schema}
    if set(msg) != set(want):
        missing, extra = sorted(set(want) - set(msg)), sorted(map(str, set(msg) - set(want)))
        raise ProtocolError(f"{kind}: missing fields {missing}, unexpected fields {extra}")
    for name, (typ, bound) in want.items():
        v = msg[name]
        if typ is _ANY:
            continue
        if typ is _INT:
            if not _int_in(v, bound):
                raise ProtocolError(f"{kind}.{name}={v!r} must be an int in [{bound}, 2^63)")
        elif typ is _BOOL:
            if not isinstance(v, bool):
                raise ProtocolError(f"{kind}.{name} must be a bool")
        elif not isinstance(v, typ):
            raise ProtocolError(f"{kind}.{name} must be {typ.__name__}, got {type(v).__name__}")
        elif bound and len(v) > bound:
            unit = "bytes" if typ is _BYTES else "characters" if typ is _STR else "items"
            raise ProtocolError(f"{kind}.{name} has {len(v)} {unit}, at most {bound}")
    if "start" in schema and msg["stop"] < msg["start"]:
        raise ProtocolError(f"{kind}: stop={msg['stop']} < start={msg['start']}")
    if "part" in schema and "nparts" in schema and msg["part"] >= msg["nparts"]:
        raise ProtocolError(f"{kind}: part={msg['part']} must be < nparts={msg['nparts']}")
    if kind == "hello_ack" and msg["path"] not in PATHS:
        raise ProtocolError(f"hello_ack.path={msg['path']!r} must be one of {PATHS}")
    if kind == "hello" and msg["mem"] not in ("DRAM", "VRAM"):
        raise ProtocolError(f"hello.mem={msg['mem']!r} must be 'DRAM' or 'VRAM'")
    if kind == "hello" and (msg["region_bytes"] == 0) != (msg["region_addr"] == 0):
        raise ProtocolError("hello: region_addr and region_bytes must both be 0 (no receive region) or both set")
    if kind == "moving":
        _check_moving(msg)


def _check_moving(msg: dict) -> None:
    """A ``moving`` frame: connection-level (rid "", inc 0), at least one entry, each exactly
    ``[rid, inc, lease_ms]``: a request id of 1 to `MAX_REQUEST_ID` UTF-8 bytes, an int
    incarnation in [0, 2^63), an int lease in [0, `MAX_LEASE_MS`]."""
    if msg["rid"] or msg["inc"]:
        raise ProtocolError("moving: a connection-level message (rid must be '' and inc 0)")
    if not msg["reqs"]:
        raise ProtocolError("moving: reqs is empty")
    for i, e in enumerate(msg["reqs"]):
        if not isinstance(e, list) or len(e) != 3:
            raise ProtocolError(f"moving.reqs[{i}] must be [rid, inc, lease_ms]")
        rid, inc, lease = e
        if not isinstance(rid, str) or not 0 < len(rid.encode("utf-8", "surrogatepass")) <= MAX_REQUEST_ID:
            raise ProtocolError(f"moving.reqs[{i}]: rid must be a str of 1 to {MAX_REQUEST_ID} UTF-8 bytes")
        if isinstance(inc, bool) or not isinstance(inc, int) or not 0 <= inc <= _I64:
            raise ProtocolError(f"moving.reqs[{i}]: inc={inc!r} must be an int in [0, 2^63)")
        if isinstance(lease, bool) or not isinstance(lease, int) or not 0 <= lease <= MAX_LEASE_MS:
            raise ProtocolError(f"moving.reqs[{i}]: lease_ms={lease!r} must be an int in [0, {MAX_LEASE_MS}]")


def pack_i64(a: Any) -> bytes:
    """An integer array as little-endian int64 bytes (how arrays cross the control plane)."""
    return np.ascontiguousarray(np.asarray(a, dtype="<i8")).tobytes()


def unpack_i64(b: bytes, name: str, *, max_items: int | None = None) -> np.ndarray:
    """int64 bytes from a peer back to i64[n] (copied, writable).

    Raises:
        ProtocolError: length not a multiple of 8, more than ``max_items`` entries, or a
            negative entry (the message names ``name``).
    """
    if len(b) % 8:
        raise ProtocolError(f"{name}: {len(b)} bytes is not a whole number of int64")
    a = np.frombuffer(b, dtype="<i8").astype(np.int64)
    if max_items is not None and a.size > max_items:
        raise ProtocolError(f"{name}: {a.size} entries, at most {max_items}")
    if a.size and int(a.min()) < 0:
        raise ProtocolError(f"{name}: negative entry {int(a.min())}")
    return a
