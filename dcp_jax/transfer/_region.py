"""The connector's transfer paths: which one a (sender, receiver) pair takes, receive regions, IPC.

Four paths move a (chunk, decode rank) unit (`dcp_jax.transfer.schedule` counts each):

- ``direct``: descriptors straight from the prefill pages to the decode pages (page runs x layers);
- ``packed``: the sender gathers the rank's rows into its pack region (`PackArena`), then one
  descriptor per destination page run per layer;
- ``region``: gathered likewise, then ONE descriptor per window into the decode rank's registered
  receive region (`ReceiveRegion`), which the receiver places into its pages with
  `pallas_kernels.unpack_rows` before it reports SUCCESS;
- ``fused``: same host, GPU caches on both sides: the receiver exports CUDA IPC handles of its KV
  layers at the handshake, the sender maps them once per connection and one
  `pallas_kernels.copy_rows` kernel writes the rank's rows from the prefill pages straight into the
  decode pages; completion travels over the control plane after the kernel finished.

`choose_path` is the one rule that picks a path per peer, at the handshake (the sender decides and
tells the receiver in ``hello_ack``).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
from typing import Any

from dcp_jax.transfer.arena import PackArena, PackRegion
from dcp_jax.transfer.spec import HandshakeError

logger = logging.getLogger(__name__)

__all__ = ["SEND_MODES", "PeerOffer", "choose_path", "ReceiveRegion", "DEFAULT_REGION_BYTES", "REGION_ALIGN",
           "ipc_export", "ipc_open", "host_info", "fused_refusal"]

#: What `KVSender(mode=...)` accepts: a path for every peer, or ``"auto"`` (`choose_path`).
SEND_MODES = ("auto", "direct", "packed", "region", "fused")
#: Default size of a receiver's receive region (bytes): as the sender's default pack buffer.
DEFAULT_REGION_BYTES = 64 << 20
#: Receive-region offsets are multiples of this (bytes): the alignment `unpack_rows` wants of a
#: region offset on every backend (16-byte words for the Mosaic form, cache lines elsewhere).
REGION_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class PeerOffer:
    """What a receiver can take, as its ``hello`` says (checked by `protocol.decode` first).

    Attributes:
        mem: ``"DRAM"`` or ``"VRAM"``: where its KV layers live.
        region_addr, region_bytes: its registered receive region (bytes); 0, 0 = none.
        ipc: CUDA IPC handle dicts of its KV layers (empty: not offered).
        host: the receiver's `host_info` (decides whether IPC can work at all).
        staged: its KV is not registered (it stages through its receive region in host memory:
            `dcp_jax.transfer.staging`); only the region path reaches it.
    """

    mem: str
    region_addr: int = 0
    region_bytes: int = 0
    ipc: tuple = ()
    host: dict = dataclasses.field(default_factory=dict)
    staged: bool = False

    @classmethod
    def of_hello(cls, msg: dict) -> "PeerOffer":
        return cls(msg["mem"], msg["region_addr"], msg["region_bytes"], tuple(msg["ipc"]), dict(msg["host"]),
                   bool(msg["staged"]))


def host_info() -> dict:
    """This machine as the IPC check sees it: ``{"hostname", "boot_id"}`` (str each).

    ``bridge.cuda_ipc.host_info`` when that module is there (it owns the rule), else the same two
    facts read here: a CUDA IPC handle only opens in another process of the same boot of the same
    machine.
    """
    try:
        from bridge import cuda_ipc

        return dict(cuda_ipc.host_info())
    except (ImportError, AttributeError):
        pass
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {"hostname": socket.gethostname(), "boot_id": boot}


def fused_refusal(sender_mem: str, offer: PeerOffer, sender_host: dict | None = None) -> str:
    """Why the fused path cannot serve this peer ("" when it can).

    It needs GPU caches on both sides, IPC handles from the receiver, and the receiver on this
    very host (same hostname and boot id: `bridge.cuda_ipc.same_host` when available).
    """
    if sender_mem != "VRAM":
        return "the sender's KV layers are in host memory (fused needs GPU caches on both sides)"
    if offer.mem != "VRAM":
        return "the receiver's KV layers are in host memory (fused needs GPU caches on both sides)"
    if not offer.ipc:
        return "the receiver exported no CUDA IPC handles"
    mine = host_info() if sender_host is None else sender_host
    try:
        from bridge import cuda_ipc

        same = bool(cuda_ipc.same_host(offer.host))
    except (ImportError, AttributeError):
        same = None
    if same is None:
        same = bool(offer.host) and offer.host.get("hostname") == mine.get("hostname") \
            and offer.host.get("boot_id") == mine.get("boot_id") and bool(mine.get("boot_id"))
    if not same:
        return (f"the receiver is on another host ({offer.host.get('hostname')!r}, this sender on "
                f"{mine.get('hostname')!r}): CUDA IPC works within one host only")
    return ""


def choose_path(mode: str, *, sender_mem: str, offer: PeerOffer, dst_interleave: int, page_size: int,
                row_bytes: int, sender_staged: bool = False) -> str:
    """The path this sender takes to one receiver (the one rule; documented in docs/connector.md).

    ``mode`` other than ``"auto"`` is taken as asked, or refused when the peer cannot take it.
    Staging first (`dcp_jax.transfer.staging`): a staged receiver (``offer.staged``: its pages are
    not registered) takes only ``region``; a staged sender (its pages are not registered) only
    ``packed`` or ``region``, and under ``"auto"`` ``region`` when offered, else ``packed``.
    Otherwise ``"auto"``:

    1. ``fused`` when `fused_refusal` finds nothing against it (no pack, no region, no descriptor);
    2. on the host (both sides DRAM) ``direct`` when the decode interleave is a multiple of the
       page size (block round-robin keeps pages whole: page-run descriptors, no copy at all);
    3. ``region`` when the receiver offers a receive region of at least one token (one descriptor
       per window instead of page runs x layers; on a GPU each descriptor costs 4-7 us);
    4. otherwise ``direct`` / ``packed`` by the same interleave rule as 2.

    Args:
        mode: one of `SEND_MODES`.
        sender_mem: ``"DRAM"`` or ``"VRAM"`` (the sender's KV layers).
        offer: the receiver's `PeerOffer`.
        dst_interleave: the decode side's interleave (tokens); page_size: tokens per page.
        row_bytes: bytes of one token over every layer entry.
        sender_staged: the sender's KV is not registered (it stages through its pack buffer).

    Raises:
        HandshakeError: field ``"path"``: an explicit mode the peer cannot take (says why).
        ValueError: unknown ``mode``.
    """
    if mode not in SEND_MODES:
        raise ValueError(f"mode={mode!r} must be one of {SEND_MODES}")
    whole_pages = dst_interleave % page_size == 0
    has_region = offer.region_bytes >= row_bytes
    if offer.staged or sender_staged:
        return _staged_path(mode, offer.staged, sender_staged, has_region)
    if mode == "fused":
        why = fused_refusal(sender_mem, offer)
        if why:
            raise HandshakeError("path", None, None, f"the fused path cannot be served: {why}")
        return "fused"
    if mode == "region":
        if not has_region:
            raise HandshakeError("path", None, None,
                                 f"the region path cannot be served: the receiver offers a receive region of {offer.region_bytes} bytes, less than "
                                 f"one token's {row_bytes} (KVReceiver(region_bytes=...))")
        return "region"
    if mode in ("direct", "packed"):
        return mode
    if not fused_refusal(sender_mem, offer):
        return "fused"
    if sender_mem == "DRAM" and offer.mem == "DRAM" and whole_pages:
        return "direct"
    if has_region:
        return "region"
    return "direct" if whole_pages else "packed"


def _staged_path(mode: str, recv_staged: bool, sender_staged: bool, has_region: bool) -> str:
    """`choose_path` when either side stages: what the unregistered pages leave."""
    who = "the receiver" if recv_staged else "the sender"
    allowed = ("region",) if recv_staged else ("packed", "region")
    if mode != "auto" and mode not in allowed:
        raise HandshakeError("path", None, None, f"the {mode} path cannot be served: {who} stages through host "
                             f"memory (its KV pages are not registered); it takes {' or '.join(allowed)}")
    if mode == "region" or (mode == "auto" and recv_staged):
        if not has_region:
            raise HandshakeError("path", None, None, f"the region path cannot be served: {who} stages and the "
                                 "receiver offers no receive region (KVReceiver(region_bytes=...))")
        return "region"
    if mode == "packed":
        return "packed"
    return "region" if has_region else "packed"


class ReceiveRegion:
    """A decode rank's registered receive region and its `PackArena` of windows.

    One buffer, allocated once (host memory for host caches, CuPy device memory for GPU caches)
    and registered with the receiver's engine beside its KV layers; each (request, sender, chunk,
    window) gets its own range (`acquire`), released after its rows were unpacked into the pages,
    quarantined while an engine may still write it (a request that ended before its window
    landed), never handed out twice.

    Args:
        nbytes: capacity (bytes), >= 0 (0: no region; nothing is allocated).
        mem_type: ``"DRAM"`` or ``"VRAM"``; device_id: the GPU for VRAM.
        staged: the receiver stages: the region lives in host memory whatever ``mem_type`` (pinned
            for GPU KV: `dcp_jax.transfer.staging.host_buffer`).

    Raises:
        TypeError, ValueError: bad ``nbytes`` (named).
    """

    def __init__(self, nbytes: int, mem_type: str, device_id: int = 0, *, staged: bool = False):
        self.arena = PackArena(nbytes, align=REGION_ALIGN)
        self.buffer = None
        if nbytes:
            from bridge.buffers import DeviceBuffer, HostBuffer

            from dcp_jax.transfer.staging import host_buffer

            # Not touched here: the engine's first write faults the pages in (no second pass).
            if staged:
                self.buffer = host_buffer(nbytes, mem_type)
            else:
                self.buffer = HostBuffer(nbytes) if mem_type == "DRAM" else DeviceBuffer(nbytes, device_id=device_id)

    @property
    def nbytes(self) -> int:
        return self.arena.capacity

    @property
    def addr(self) -> int:
        """Address of byte 0 (0 when there is no region)."""
        return 0 if self.buffer is None else self.buffer.addr

    @property
    def array(self) -> Any:
        """u8[nbytes] numpy or CuPy view of the region (what `unpack_rows` reads)."""
        return self.buffer.array

    def memory_region(self):
        """The `bridge.MemoryRegion` to register (None when there is no region)."""
        from bridge import MemoryRegion

        if self.buffer is None:
            return None
        return MemoryRegion(self.addr, self.nbytes, self.buffer.mem_type, self.buffer.device_id)

    def acquire(self, key: Any, nbytes: int) -> PackRegion | None:
        """A window of ``nbytes`` bytes, or None while the region is full (`PackArena.acquire`)."""
        return self.arena.acquire(key, nbytes)

    def free(self, region: PackRegion) -> None:
        """Gives a window back (from use or from quarantine)."""
        if region.state == "quarantined":
            self.arena.release_quarantined(region)
        elif region.state == "in_use":
            self.arena.release(region)

    def close(self) -> None:
        """Drops the buffer (after the engine deregistered it)."""
        self.buffer = None


def ipc_export(layers: Any) -> list[dict]:
    """CUDA IPC handle dicts of a `CacheLayers`' arrays (msgpack-safe), [] when not possible.

    Host layers, or no ``bridge.cuda_ipc`` (CPU builds), offer nothing: the peer then takes another
    path. Handles are exported once per receiver (the caller caches the list).
    """
    if layers.mem_type != "VRAM":
        return []
    try:
        from bridge.cuda_ipc import export_ipc_handles

        return [h.to_dict() for h in export_ipc_handles([v for v in layers.rows])]
    except ImportError:
        return []
    except Exception as exc:  # noqa: BLE001 - not exportable (e.g. VMM memory): peers take another path
        # One line (an expected case: JAX's allocator hands out VMM memory); the trace at debug.
        logger.warning("KV layers cannot be exported as CUDA IPC handles (%s); no fused path offered", exc)
        logger.debug("CUDA IPC export failed", exc_info=True)
        return []


def ipc_open(handles: list, item_lens) -> Any:
    """Opens a receiver's IPC handles once: a `bridge.cuda_ipc.IpcMapping` whose ``.arrays`` are
    u8[num_rows_l, item_len_l] CuPy views of the receiver's layers (``num_rows_l`` from each
    handle's size: the receiver's pool, not the sender's).

    Raises:
        ValueError: a handle dict fails `IpcHandle.from_dict`'s checks, the count is not one per
            layer entry, or a handle's size is not whole rows of its entry.
        ImportError: no ``bridge.cuda_ipc`` here.
    """
    from bridge.cuda_ipc import IpcHandle, IpcMapping

    item_lens = [int(x) for x in item_lens]
    if len(handles) != len(item_lens):
        raise ValueError(f"ipc: {len(handles)} handles for {len(item_lens)} layer entries")
    parsed = [IpcHandle.from_dict(h) for h in handles]
    shapes = []
    for l, (h, il) in enumerate(zip(parsed, item_lens)):
        if h.nbytes % il or h.nbytes == 0:
            raise ValueError(f"ipc[{l}]: {h.nbytes} bytes is not whole rows of item_lens[{l}]={il}")
        shapes.append((h.nbytes // il, il))
    return IpcMapping(parsed, shapes, ["uint8"] * len(parsed))
