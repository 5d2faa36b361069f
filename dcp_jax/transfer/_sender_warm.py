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

    def warm_up(self, max_rows: int | None = None, round_rows: int | None = None) -> dict[str, list[int]]:
        """Compiles, before serving, the device kernels this sender's rounds launch, for every
        index bucket a round can reach, writing nothing (no KV page, no live region): the
        one-launch pack (`pallas_kernels.warm_pack_windows`) and, with fused decode ranks, the
        fan-out copy into all of them (`pallas_kernels.warm_copy_fanout`) and the bump of the
        fused path's flag page (`bridge.host_flag`). By default the buckets reach the bucket of
        one window of ``max_rows`` rows and a row block (a 32k chunk to 8 ranks: windows of
        4,096 rows, the 8,192-row bucket, two windows a launch, four launches); ``round_rows``
        sets another launch size. From then on each launch of a round stays within the largest
        bucket compiled (the round's other windows go on in the next launch), so no round
        compiles. Without it, a round that first reaches a bucket compiles it then (~0.5 s on
        an H200; ~6.6 s a bucket at 131,072 tokens on an H100, where JAX's persistent
        compilation cache, ``JAX_COMPILATION_CACHE_DIR``, took the job's twelve from 79.7 s to
        9.2 s), stalling the sender's rounds meanwhile. Why launches of one window's bucket and
        not one launch a chunk (2026-12-06, H100, 6 requests each, one machine): the region
        path's first writes go out after a quarter of the pack, 254.6 GB/s whole against 235.3
        with one launch; the fused path reads the same (942.0 against 949.3).

        Call it once the decode ranks have connected (the fused launch is compiled for the
        ranks connected now) and again after more connect. The compiles run on the caller's
        thread, not under the sender's lock: rounds, heartbeats and handshakes go on. Host
        (numpy) KV compiles nothing, so no bucket caps its launches (a round packs all its
        windows in one thread-pool run; ``round_rows`` still bounds it), but for a named
        ``pack_backend`` what its `PackBackend.warm` compiles (``"xla"``: its gather's buckets).

        Args:
            max_rows: the most token rows one window carries (an int >= 1; e.g. the serving
                loop's largest prefill chunk). None, or more than fits: as many as the pack
                buffer holds (pack) and as the KV cache holds (fused). A window larger than
                ``max_rows`` still goes out, in a round of its own, compiling its bucket once.
            round_rows: the most index rows one launch of a round holds (an int >= 1; each
                window counts its rows rounded up to a row block, 64 by default), at least one
                window of ``max_rows``. None: the bucket of one window of ``max_rows`` and a
                row block. Smaller rounds let the first writes go out after a smaller pack,
                each round paying its own launch (host time: ~0.6 ms a pack launch on an H100);
                a window of ``max_rows`` to every rank makes a chunk one launch.

        Returns:
            ``{"pack": buckets, "fused": buckets}``: the index buckets (rows) now compiled.

        Raises:
            RuntimeError: the sender is closed.
            TypeError: ``max_rows`` or ``round_rows`` not an int (``1.0`` too); ValueError:
                either < 1.
        """
        from pallas_kernels import bucket_rows, warm_copy_fanout

        self._check_open()
        for name, v in (("max_rows", max_rows), ("round_rows", round_rows)):
            if v is not None and check_int_type(name, v) < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1 or None")
        br = self._index_block
        with self._lock:  # a snapshot: the compiles below run without the lock
            copiers = [c.copier for c in self._conns.values() if c.copier is not None]
            self._packer.prepare()  # (a staged pack's device scratch: made where rounds make it)
            ranks = max(1, len(self._conns))  # a round: one window to each rank

        def launch_rows(window_rows: int, held_rows: int, windows: int) -> int:
            # Index rows as a round counts them (`_index_rows`: each window block-rounded); the
            # round's windows share what holds them, so their rows sum to at most that.
            one = self._index_rows(max(1, window_rows))
            rows = min(windows * one, held_rows + windows * br)
            if round_rows is None:  # the bucket of one window and a row block (see above)
                return min(rows, one + br)
            return max(one, min(rows, int(round_rows)))

        def cap(kind: str, rows: int, buckets: list[int]) -> float:
            # Within the largest bucket compiled, and an explicit round_rows (which also bounds
            # a launch that compiles nothing: the host gather's one thread-pool run).
            if not buckets:
                return self._index_cap[kind] if round_rows is None else rows
            return buckets[-1] if round_rows is None else min(buckets[-1], rows)

        rows = self._max_region_rows if max_rows is None else min(int(max_rows), self._max_region_rows)
        prows = launch_rows(rows, self._max_region_rows, ranks)
        pack = self._packer.warm_up(bucket_rows(prows, br), window_rows=rows)
        fused = []
        if copiers:
            rows = self._layers.min_rows if max_rows is None else min(int(max_rows), self._layers.min_rows)
            frows = launch_rows(rows, len(copiers) * self._layers.min_rows, len(copiers))
            try:  # (warm_copy_fanout clamps the bucket to what the copiers' destinations hold)
                fused = warm_copy_fanout(copiers, bucket_rows(frows, br))
            except RuntimeError as exc:  # a link dropped meanwhile closed its copier: next call
                logger.warning("warm_up: the fused copy was not compiled: %s", exc)
            if not fused:
                logger.warning("warm_up: the fused copiers cannot share one launch (%d links); "
                               "each copies on its own and compiles its buckets on first use", len(copiers))
            else:
                self._index_cap["fused"] = cap("fused", frows, fused)
                # The flag's bump, compiled as rounds call it (after one launch); it runs after
                # every copy enqueued so far, so it credits no rank early.
                self._bump_flag(copiers[:1])
        self._index_cap["pack"] = cap("pack", prows, pack)
        return {"pack": pack, "fused": fused}
