"""`KVSender.warm_up`: the device kernels a sender's rounds launch, compiled before serving.

A mixin of `KVSender` (`dcp_jax.transfer.sender`), like `_sender_units` and `_sender_region`: it
uses the sender's packer, connections and index caps (``_index_cap``, ``_index_block``).
"""
from __future__ import annotations

import logging

from dcp_jax._validate import check_int_type

__all__ = ["SenderWarmUp"]

logger = logging.getLogger("dcp_jax.transfer.sender")


class SenderWarmUp:
    """`warm_up`."""

    def warm_up(self, max_rows: int | None = None) -> dict[str, list[int]]:
        """Compiles, before serving, the device kernels this sender's rounds launch, for every
        index bucket a round can reach, writing nothing (no KV page, no live region): the
        one-launch pack (`pallas_kernels.warm_pack_windows`) and, with fused decode ranks, the
        fan-out copy into all of them (`pallas_kernels.warm_copy_fanout`) and the bump of the
        fused path's flag page (`bridge.host_flag`). The buckets reach one round's launch: a
        window of ``max_rows`` rows to every connected decode rank (each window rounded up to a
        row block), as a chunk sent to all of them takes. From then on each launch of a round
        stays within the largest bucket compiled (a round with more windows, e.g. several
        requests queued, goes on in the next round), so no round compiles. Without it, a round
        that first reaches a bucket compiles it then (~0.5 s on an H200), stalling the sender's
        rounds meanwhile. (Buckets of one window only split a 32k chunk to 8 ranks into four
        launches, each with its own ~0.6 ms of host time, and spread its posts over 3.6 ms.)

        Call it once the decode ranks have connected (the fused launch is compiled for the
        ranks connected now) and again after more connect. The compiles run on the caller's
        thread, not under the sender's lock: rounds, heartbeats and handshakes go on. Host
        (numpy) KV compiles nothing.

        Args:
            max_rows: the most token rows one window carries (an int >= 1; e.g. the serving
                loop's largest prefill chunk). None, or more than fits: as many as the pack
                buffer holds (pack) and as the KV cache holds (fused). A window larger than
                ``max_rows`` still goes out, in a round of its own, compiling its bucket once.

        Returns:
            ``{"pack": buckets, "fused": buckets}``: the index buckets (rows) now compiled.

        Raises:
            RuntimeError: the sender is closed.
            TypeError: ``max_rows`` not an int (``1.0`` too); ValueError: ``max_rows`` < 1.
        """
        from pallas_kernels import bucket_rows, warm_copy_fanout

        self._check_open()
        if max_rows is not None and check_int_type("max_rows", max_rows) < 1:
            raise ValueError(f"max_rows={max_rows!r} must be an int >= 1 or None")
        br = self._index_block
        with self._lock:  # a snapshot: the compiles below run without the lock
            copiers = [c.copier for c in self._conns.values() if c.copier is not None]
            self._packer.prepare()  # (a staged pack's device scratch: made where rounds make it)
            ranks = max(1, len(self._conns))  # a round: one window to each rank
        rows = self._max_region_rows if max_rows is None else min(int(max_rows), self._max_region_rows)
        # Index rows as a round counts them (`_index_rows`: each window block-rounded); the
        # round's windows share the pack buffer, so their rows sum to at most what it holds.
        round_rows = min(ranks * self._index_rows(max(1, rows)), self._max_region_rows + ranks * br)
        pack = self._packer.warm_up(bucket_rows(max(1, round_rows), br))
        fused = []
        if copiers:
            rows = self._layers.min_rows if max_rows is None else min(int(max_rows), self._layers.min_rows)
            # warm_copy_fanout clamps it to what the copiers' destinations hold
            fcap = bucket_rows(len(copiers) * self._index_rows(max(1, rows)), br)
            try:
                fused = warm_copy_fanout(copiers, fcap)
            except RuntimeError as exc:  # a link dropped meanwhile closed its copier: next call
                logger.warning("warm_up: the fused copy was not compiled: %s", exc)
            if not fused:
                logger.warning("warm_up: the fused copiers cannot share one launch (%d links); "
                               "each copies on its own and compiles its buckets on first use", len(copiers))
            else:
                self._index_cap["fused"] = fused[-1]
                # The flag's bump, compiled as rounds call it (after one launch); it runs after
                # every copy enqueued so far, so it credits no rank early.
                self._bump_flag(copiers[:1])
        if pack:
            self._index_cap["pack"] = pack[-1]
        return {"pack": pack, "fused": fused}
