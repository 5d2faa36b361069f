"""The peers of `bridge.nixl.NixlEngine`: publishing its metadata, loading, refreshing and removing peers.

A mixin: the state it works on (the agent, the worker, ``_jobs``, ``_removing``) is created in
``NixlEngine.__init__``. Peer loads and removals run on the engine's worker thread, in order with
the postings (`add_peer` waits for its load, `remove_peer` does not).

Stale metadata: NIXL keeps a peer's old registrations after the peer deregisters, and a WRITE
into them still succeeds. `add_peer` with a refreshed `PeerInfo` therefore drops and reloads the
peer's metadata, and `transfer_batch` validates against the regions of the latest `PeerInfo`.
"""
from __future__ import annotations

import logging

from bridge.base import PeerError, PeerInfo, TransferHandle
from bridge.nixl_agent import engine_msg
from bridge.workers import Job

__all__ = ["NixlPeers"]

_log = logging.getLogger("bridge")


class NixlPeers:
    """`NixlEngine`'s ``_engine_*`` peer hooks and the removal of a peer once its transfers ended."""

    def _engine_peer_info(self) -> PeerInfo:
        # Metadata lists the registrations made so far: register before publishing it.
        return PeerInfo(engine=self.kind, name=self.name, session="",
                        metadata=bytes(self._agent.get_agent_metadata()), regions=tuple(self._regions))

    def _engine_add_peer(self, info: PeerInfo, refresh: bool) -> None:
        if not info.metadata:
            raise PeerError(f"info: peer {info.name!r} carries no NIXL agent metadata")
        with self._removing_lock:  # removed, NIXL not told yet (transfers running): now a refresh
            if self._removing.pop(info.name, None) is not None:
                refresh = True
        try:  # after the postings queued so far (a queued removal of this name included)
            self._worker.call(lambda: self._load_peer(info, refresh))
        except RuntimeError as exc:  # worker stopped: the engine is closing
            raise PeerError(f"info: engine {self.name!r} is closing") from exc

    def _load_peer(self, info: PeerInfo, refresh: bool) -> None:
        if refresh:
            # Drop what NIXL cached for this peer first, so regions the peer deregistered do not
            # stay writable through stale metadata.
            try:
                self._agent.remove_remote_agent(info.name)
            except Exception:  # noqa: BLE001 - not loaded (an earlier add failed): nothing to drop
                pass
        try:
            loaded = self._agent.add_remote_agent(info.metadata)
        except Exception as exc:
            raise PeerError(f"info: NIXL refused metadata of peer {info.name!r}: {engine_msg(exc)}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != info.name:
            self._agent.remove_remote_agent(loaded)
            raise PeerError(f"info: metadata is for agent {loaded!r} but PeerInfo.name={info.name!r}")

    def _engine_remove_peer(self, info: PeerInfo) -> None:
        # Postings not started yet are dropped. NIXL forgets the peer only once its posted transfers
        # have ended: removing it earlier makes `check_xfer_state` answer NOT_FOUND at once while
        # UCX may still be moving the bytes (a stopped peer), and `check` would free memory in use.
        name = info.name
        running = set()
        for seq, job in list(self._jobs.items()):
            if job.tag == name:
                job.cancel(f"peer {name!r} removed")
                running.add(seq)
        with self._removing_lock:
            if running:
                self._removing[name] = running
                return
        self._queue_removal(name)

    def _queue_removal(self, name: str) -> None:
        def drop(job: Job) -> None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - nobody waits for this job: log it
                _log.warning("NIXL could not remove peer %r: %s", name, engine_msg(exc))

        try:
            self._worker.submit(Job(drop))
        except RuntimeError:  # worker stopped: the closing engine drops every peer anyway
            pass

    def _forget(self, handle: TransferHandle) -> Job | None:
        """Drops the handle's job; the last transfer of a removed peer lets NIXL forget the peer."""
        job = self._jobs.pop(handle.seq, None)
        with self._removing_lock:
            waiting = self._removing.get(handle.peer)
            if waiting is None or handle.seq not in waiting:
                return job
            waiting.discard(handle.seq)
            if waiting:
                return job
            del self._removing[handle.peer]
        self._queue_removal(handle.peer)
        return job
