"""The sender's region and fused paths (a mixin of `dcp_jax.transfer.KVSender`, worker thread, lock held).

Region, push: a window is packed into the sender's pack region (as the packed path), then
``region_ask`` asks the decode rank for room in its receive region; its ``region_grant`` (offset,
size: checked against the region the rank declared at the handshake before any byte moves)
lets ONE descriptor write the whole window, with the usual ``done`` notification. Region, pull:
as the packed path's ``pull_ready``; the receiver READs the window with one descriptor.

Fused: one `pallas_kernels.copy_rows` kernel per window writes the rows from this sender's pages
into the decode rank's pages through the connection's `bridge.cuda_ipc.IpcMapping`; once the
kernel finished (``pallas_kernels.synchronize``), ``fused_done`` tells the rank.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from dcp_jax.transfer import protocol as proto

__all__ = ["SenderRegion", "sync_arrays"]


def sync_arrays(arrays) -> None:
    """Waits until every kernel queued on these device arrays finished (no-op for numpy)."""
    import pallas_kernels

    sync = getattr(pallas_kernels, "synchronize", None)
    if sync is not None:
        sync(arrays)
        return
    if arrays and not isinstance(arrays[0], np.ndarray):
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


class SenderRegion:
    """Region asks and grants, the fused copy, and their clean-up."""

    def _ask_key(self, u: Any) -> tuple:
        return (u.req.rid, u.target.inc, u.target.conn.spec.dcp_rank, u.rc.chunk, u.w)

    def _submit_region_push(self, u: Any, head: dict, nbytes: int) -> None:
        """Asks the rank for room; the write follows its grant (`_on_region_grant`)."""
        t = u.target
        self._asks[self._ask_key(u)] = u
        u.req.inflight += 1
        t.inflight += 1
        lo, _ = u.rc.windows[u.w]
        u.req.timeline.mark("ask", t.conn.spec.group_rank)
        self._ctl.send(t.conn.ident, proto.encode("region_ask", u.req.rid, t.inc, lo=lo, nbytes=nbytes, **head))

    def _on_region_grant(self, conn: Any, msg: dict) -> None:
        u = self._asks.pop((msg["rid"], msg["inc"], conn.spec.dcp_rank, msg["chunk"], msg["part"]), None)
        if u is None or u.target.conn is not conn:
            self._counts["dropped_messages"] += 1  # a grant for a window that ended meanwhile
            return
        req, t = u.req, u.target
        want = self._window_bytes(u)
        if msg["nbytes"] != want or msg["offset"] + want > conn.region_bytes:
            # Never write outside the region the rank declared: its grant is refused whole.
            return self._unit_finished(u, f"region_grant offset={msg['offset']} nbytes={msg['nbytes']} is not "
                                          f"{want} bytes inside the {conn.region_bytes}-byte receive region")
        lo, hi = u.rc.windows[u.w]
        head = dict(chunk=u.rc.chunk, part=u.w, nparts=len(u.rc.windows), start=u.rc.start, stop=u.rc.stop,
                    nrows=hi - lo)
        descs = np.array([[self._pack.addr + u.region.offset, conn.region_addr + msg["offset"], want]], np.int64)
        try:
            u.handle = self.engine.transfer_batch(conn.peer, descs, notif=proto.encode("done", req.rid, t.inc, **head),
                                                  dcp_rank=conn.spec.dcp_rank, chunk=u.rc.chunk)
        except Exception as exc:  # noqa: BLE001 - refused before a byte moved: the request fails
            return self._unit_finished(u, f"{type(exc).__name__}: {exc}")
        req.timeline.mark("post", conn.spec.group_rank)
        self._ctl.send(conn.ident, proto.encode("sent", req.rid, t.inc, chunk=u.rc.chunk, part=u.w))
        self._inflight.append(u)  # inflight counts were taken at the ask
        self._count(t, 1, want, self._batch_calls(1))

    def _submit_fused(self, u: Any, head: dict) -> None:
        """One copy kernel into the rank's mapped pages, waited for, then ``fused_done``."""
        from pallas_kernels import RowCopier

        t = u.target
        lo, hi = u.rc.windows[u.w]
        mapping = t.conn.mapping
        if hi > lo:
            dst = u.rc.dst_rows[lo:hi]
            rows = min(int(a.shape[0]) for a in mapping.arrays)
            if int(dst.max()) >= rows:  # no engine checks these addresses: this does
                raise ValueError(f"decode rank {t.conn.spec.dcp_rank}'s page table maps row {int(dst.max())}, "
                                 f"its mapped layers hold {rows} rows")
            if int(dst.min()) < 0:
                raise ValueError(f"decode rank {t.conn.spec.dcp_rank}'s page table maps a negative row")
            tk = time.perf_counter()
            # Bounds were checked just above on the host; the kernel's own checks would each
            # synchronise. The copy is only enqueued: `_finish_fused` waits once for the round.
            # The copier (layer checks, views, destination handles) is made once per link.
            if t.conn.copier is None:
                t.conn.copier = RowCopier(self._layers.rows, mapping.arrays)
            t.conn.copier.copy(u.rc.src_rows[lo:hi], dst, checked=True)
            u.req.copy_seconds += time.perf_counter() - tk
        u.req.inflight += 1
        t.inflight += 1
        self._fused.append((u, head, hi > lo))

    def _finish_fused(self) -> None:
        """The round's fused copies: one wait for all of them (the bytes are in the decode
        pages before any rank is told), then ``fused_done`` to each rank."""
        if not self._fused:
            return
        done, self._fused = self._fused, []
        tk = time.perf_counter()
        err = None
        try:
            sync_arrays([a for u, _, moved in done if moved for a in u.target.conn.mapping.arrays[:1]])
        except Exception as exc:  # noqa: BLE001 - no rank may be told its rows landed
            err = f"fused copy: {type(exc).__name__}: {exc}"
        waited = time.perf_counter() - tk
        for req in {id(u.req): u.req for u, _, moved in done if moved}.values():
            req.copy_seconds += waited
        for u, head, moved in done:
            t = u.target
            if err is None and not u.req.status.terminal:
                if moved:
                    u.req.timeline.mark("copied", t.conn.spec.group_rank)
                self._count(t, 0, self._window_bytes(u) if moved else 0, 0)
                self._ctl.send(t.conn.ident, proto.encode("fused_done", u.req.rid, t.inc, **head))
            self._unit_finished(u, err)

    def _drop_asks(self, pred) -> None:
        """Windows waiting for a grant that will never be used: their pack regions are free (no
        engine reads them) and they are no longer in flight."""
        for key, u in list(self._asks.items()):
            if pred(u):
                del self._asks[key]
                self._unit_finished(u, None)
