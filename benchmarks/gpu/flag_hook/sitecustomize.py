"""Diagnostic: when the fused path's flag page really changes, on the job's clock.

    PYTHONPATH=benchmarks/gpu/flag_hook:$PYTHONPATH DCP_FLAG_LAG=1 \\
    python -m dcp_jax.cli transfer --device gpu --path fused ...

Wraps the sender's `_bump_flag`: after each bump is enqueued, a thread spins on the flag page
(host memory, the page the decode ranks read) and prints ``FLAGLAG <ms>`` to stderr: when the
page reached the bump's number, in ms after the round's first byte (the timeline's origin for a
job of one prefill rank), so it lines up with ``decode:part``. Does nothing without DCP_FLAG_LAG.

With DCP_KERNEL_PROF=N as well, the prefill process records its device kernels (torch.profiler,
CUPTI) over its first N fused rounds and prints ``KERNELS`` lines: each kernel over 50 us, its
duration and the gap to the kernel after it (the flag bump), in us.
"""
import os
import sys
import threading
import time

if os.environ.get("DCP_FLAG_LAG"):
    try:
        from bridge.host_flag import seq_done
        from dcp_jax.transfer import _sender_region as sr

        _orig, _orig_finish = sr.SenderRegion._bump_flag, sr.SenderRegion._finish_fused

        _prof = {"n": int(os.environ.get("DCP_KERNEL_PROF", "0") or 0), "rounds": 0, "p": None}

        def _finish_fused(self):
            self._flag_lag_round = list(self._fused)  # `_finish_fused` empties it before the bump
            try:
                return _orig_finish(self)
            finally:
                if _prof["n"] and _prof["rounds"] <= _prof["n"]:
                    _prof["rounds"] += 1
                    if _prof["p"] is None:  # the first round (warm-up) starts the recording
                        from torch.profiler import ProfilerActivity, profile
                        _prof["p"] = profile(activities=[ProfilerActivity.CUDA])
                        _prof["p"].__enter__()
                    elif _prof["rounds"] > _prof["n"]:
                        _report(_prof["p"])

        def _report(p):
            from torch.autograd import DeviceType
            p.__exit__(None, None, None)
            evs = sorted((e for e in p.events() if e.device_type == DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
            for a, b in zip(evs, evs[1:] + [None]):
                dur = a.time_range.end - a.time_range.start
                if dur > 50:
                    gap = (b.time_range.start - a.time_range.end) if b is not None else -1
                    print(f"KERNELS {a.name[:40]} {dur:.1f} us, next {b.name[:30] if b else '-'} after {gap:.1f} us",
                          file=sys.stderr, flush=True)

        def _bump_flag(self, copiers):
            seq = _orig(self, copiers)
            firsts = [u.req.first_byte_at for u, *_ in getattr(self, "_flag_lag_round", [])
                      if u.req.first_byte_at is not None]
            if seq is not None and firsts:
                first = min(firsts)
                flag, t_bump = self._flag, time.monotonic()

                def spin():
                    end = time.monotonic() + 1.0
                    while time.monotonic() < end:
                        if seq_done(flag.value(), seq):
                            now = time.monotonic()
                            print(f"FLAGLAG {(now - first) * 1e3:.3f} bump_enqueued {(t_bump - first) * 1e3:.3f}",
                                  file=sys.stderr, flush=True)
                            return
                        time.sleep(0)  # yields the GIL: the sender's own calls go on
                threading.Thread(target=spin, daemon=True).start()
            return seq

        sr.SenderRegion._bump_flag = _bump_flag
        sr.SenderRegion._finish_fused = _finish_fused
    except Exception as exc:  # noqa: BLE001 - a diagnostic never breaks the job
        print(f"flag_hook: not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
