"""Diagnostic: the polling intervals of the region path, set from the environment.

    PYTHONPATH=benchmarks/gpu/latency_hook:$PYTHONPATH DCP_NIXL_PROGRESS_US=50 \\
    python -m dcp_jax.cli transfer --device gpu --path region ...

Every process of the job (its children inherit PYTHONPATH) applies, where set:
``DCP_NIXL_PROGRESS_US`` NIXL's progress-thread pause (`bridge.nixl_agent.create_agent`),
``DCP_POLLER_MAX_US`` the engine poller's longest backoff (`bridge.workers.Poller`, 2 ms),
``DCP_WORKER_MAX_US`` the connector worker's longest backoff (`dcp_jax.transfer._worker`, 1 ms),
``DCP_NIXL_INLINE=1`` NIXL batches posted in the caller's thread (``NixlEngine(async_submit=False)``)
instead of handed to the engine's posting thread; ``DCP_NIXL_QUEUED=1`` every batch handed to that
thread (`bridge.nixl.INLINE_MAX_DESCRIPTORS` = 0: the behaviour before small batches went inline).
``DCP_UNPACK_DELAY_MS`` a decode rank waits this long before each region unpack (diagnostic only:
do the NIXL writes still land spread out when no rank's unpack runs among them?);
``DCP_SWITCH_US`` the interpreter's GIL switch interval (`sys.setswitchinterval`, default 5,000 us):
how long a thread back from a GIL-free engine call may wait for another thread to yield.
Tells which of the waits stacked between a write's end and its rank's notice cost the time.
"""
import os


def _us(name):
    v = os.environ.get(name)
    return None if v in (None, "") else int(v)


_prog, _poll, _work = _us("DCP_NIXL_PROGRESS_US"), _us("DCP_POLLER_MAX_US"), _us("DCP_WORKER_MAX_US")
_inline = os.environ.get("DCP_NIXL_INLINE") == "1"
if _us("DCP_UNPACK_DELAY_MS") is not None:
    try:
        import time as _time

        from dcp_jax.transfer import _receiver_region as _rr

        _orig_unpack, _delay = _rr.ReceiverRegion._unpack, _us("DCP_UNPACK_DELAY_MS") * 1e-3

        def _late_unpack(self, g):
            _time.sleep(_delay)
            return _orig_unpack(self, g)

        _rr.ReceiverRegion._unpack = _late_unpack
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the job
        import sys as _s

        print(f"latency_hook: DCP_UNPACK_DELAY_MS not applied: {exc!r}", file=_s.stderr)
if _us("DCP_SWITCH_US") is not None:
    import sys as _sys

    _sys.setswitchinterval(_us("DCP_SWITCH_US") * 1e-6)
_queued = os.environ.get("DCP_NIXL_QUEUED") == "1"
if _prog is not None or _poll is not None or _work is not None or _inline or _queued:
    try:
        if _queued:
            import bridge.nixl as _nxq

            _nxq.INLINE_MAX_DESCRIPTORS = 0
        if _inline:
            import bridge.nixl as _nxi

            _orig_nixl_init = _nxi.NixlEngine.__init__

            def _nixl_init(self, name, **kw):
                kw["async_submit"] = False
                _orig_nixl_init(self, name, **kw)

            _nxi.NixlEngine.__init__ = _nixl_init
        if _prog is not None:
            import bridge.nixl as _nx

            _orig_create = _nx.create_agent
            _nx.create_agent = lambda name, conf, delay: _orig_create(name, conf, _prog)
        if _poll is not None:
            from bridge import workers as _w

            _orig_init = _w.Poller.__init__

            def _init(self, name, poll, **kw):
                _orig_init(self, name, poll, **{**kw, "max_s": _poll * 1e-6})

            _w.Poller.__init__ = _init
        if _work is not None:
            from dcp_jax.transfer import _worker as _wk

            _wk.MAX_BACKOFF_S = _work * 1e-6
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the job
        import sys

        print(f"latency_hook: not applied: {exc!r}", file=sys.stderr)
