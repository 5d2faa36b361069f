"""The sender's control socket is used by one thread at a time.

zmq sockets are not thread-safe, and the sender's worker polls and reads its ROUTER socket
outside the sender's lock. So every frame (including those an `abort` or a `release` on the
serving loop's threads makes) must leave from the worker's thread while it runs, and from the
closing thread only once it has stopped. Checked on real engines under aborts and releases
from several threads while windows are in flight; the queued frames must still arrive (the
ranks see the aborts).
"""
import threading

from conftest import Cluster, TransferStatus


def _record_sends(sender):
    """Wraps the sender's control socket's ``send``: [(thread, worker thread alive)] per frame."""
    seen, real = [], sender._ctl.send
    worker = sender._worker._thread

    def send(ident, frame):
        seen.append((threading.current_thread(), worker.is_alive()))
        return real(ident, frame)

    sender._ctl.send = send
    return seen, worker


def test_caller_threads_never_send_on_the_control_socket(engine):
    c = Cluster(engine, dcp_size=2, pages=256, page_size=4, item_lens=(64, 32), seed=None)
    try:
        seen, worker = _record_sends(c.sender)
        n, tokens = 24, 40
        tables = {}
        aborted = {f"r{k}" for k in range(n) if k % 4 in (1, 3)}
        for k in range(n):
            rid = f"r{k}"
            tables[rid] = c.tables(tokens)
            # The requests to abort get half their tokens and rank 1 never announces them: they
            # stay live until the abort, with windows to rank 0 in flight or landed.
            for r, recv in enumerate(c.receivers[:1] if rid in aborted else c.receivers):
                recv.expect(rid, tables[rid][1][r], tokens)
            c.sender.send(rid, tables[rid][0], 0, tokens // 2 if rid in aborted else tokens)

        def abort_some(ks):
            for k in ks:
                c.sender.abort(f"r{k}", reason=f"test abort {k}")

        # Aborts from two caller threads at once, while earlier windows may still be in flight.
        threads = [threading.Thread(target=abort_some, args=(range(j, n, 4),)) for j in (1, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rid in tables:
            if rid in aborted:  # the "abort" frames made on the caller threads reached rank 0
                st = c.wait(rid, sides=[c.sender, c.receivers[0]])
                assert st == [TransferStatus.ABORTED] * 2, (rid, st, c.sender.failure_reason(rid), c.receivers[0].failure_reason(rid))
                assert "test abort" in c.receivers[0].failure_reason(rid)
            else:
                assert c.wait(rid) == [TransferStatus.SUCCESS] * 3, (rid, c.reasons(rid))
                assert c.check_bytes(tables[rid][0], tables[rid][1], tokens) == tokens
        for rid in tables:
            c.sender.release(rid)
            c.receivers[0].release(rid)
            if rid not in aborted:
                c.receivers[1].release(rid)
        assert seen, "no control frame was recorded"
        off_worker = [t.name for t, alive in seen if t is not worker and alive]
        assert off_worker == [], f"{len(off_worker)} of {len(seen)} frames sent from {set(off_worker)}"
    finally:
        c.close()
    # After close: the bye frames went out from the closing thread, with the worker stopped.
    assert all(t is worker or not alive for t, alive in seen)
