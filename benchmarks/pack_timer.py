"""`Timer`: how `benchmarks/pack.py` times one variant, kernel time (CUPTI, through
torch.profiler) and wall clock per call over back-to-back calls.

Moved out of `benchmarks/pack.py`, which imports it from here.
"""

from __future__ import annotations

import time


class Timer:
    """Times one variant two ways, on one device (every stream synchronised).

    - kernel: the durations of the kernels (and device copies) one call launched, as CUPTI
      records them (torch.profiler sees every kernel of the process, JAX's and CuPy's too):
      the kernel's own speed, the same clock for every launcher. Samples of `calls` calls.
    - wall: host clock over back-to-back calls (each sample at least `min_sample_s`), divided
      by the calls: what a caller waits per call in steady state, launch costs included.
    """

    def __init__(self, device_sync, calls=10, min_sample_s=0.05):
        self.device_sync, self.calls, self.min_sample_s = device_sync, calls, min_sample_s

    def _done(self, sync):
        if sync is not None:
            sync()  # e.g. block_until_ready: JAX may enqueue from another thread
        self.device_sync()

    def kernel(self, step, sync=None, samples=5):
        """[ms per call] per sample, and kernels per call."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        step()
        self._done(sync)
        total = self.calls * samples
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(total):
                step()
            self._done(sync)
        evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        if not evs:
            raise RuntimeError("the profiler recorded no device activity")
        per_call = len(evs) / total
        chunk = len(evs) // samples
        ms = [sum(e.time_range.end - e.time_range.start
                  for e in evs[i * chunk:(i + 1) * chunk]) / 1e3 / (chunk / per_call)
              for i in range(samples)]
        return ms, per_call

    def wall(self, step, sync=None, samples=3):
        """[ms per call] per sample of back-to-back calls."""
        step()
        self._done(sync)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        self._done(sync)
        est = (time.perf_counter() - t0) / 3
        iters = int(min(1000, max(self.calls, self.min_sample_s / max(est, 1e-6))))
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            self._done(sync)
            out.append((time.perf_counter() - t0) / iters * 1e3)
        return out
