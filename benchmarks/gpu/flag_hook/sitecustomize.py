"""Diagnostic: when the fused path's flag page really changes, on the job's clock.

    PYTHONPATH=benchmarks/gpu/flag_hook:$PYTHONPATH DCP_FLAG_LAG=1 \\
    python -m dcp_jax.cli transfer --device gpu --path fused ...

Wraps the sender's `_bump_flag`: after each bump is enqueued, a thread spins on the flag page
(host memory, the page the decode ranks read) and prints ``FLAGLAG <ms>`` to stderr: when the
page reached the bump's number, in ms after the round's first byte (the timeline's origin for a
job of one prefill rank), so it lines up with ``decode:part``. Does nothing without DCP_FLAG_LAG.

With DCP_KERNEL_PROF=N as well, the prefill process records its device work (torch.profiler,
CUPTI) over the N fused rounds after its first (the warm-up) and prints a ``KERNELS`` line per
kernel or device copy: its name, duration and the gap to the next one, in us (a round: the index
slot's copy, the fan-out kernel, the flag bump).

With DCP_PRE_FLAG=1 as well, a second device flag page is bumped on the same stream right before
each fan-out launch (its dispatch adds host time before the launch) and a thread prints
``PREFLAG <ms>``: when the device reached the fan-out, on the same clock. ``FLAGLAG - PREFLAG``
is then the fan-out kernel plus the bump; ``PREFLAG`` minus the ``launched`` mark, the queue.

With DCP_DIRECT_EVENTS=1 as well (launches without JAX, `pallas_kernels.triton_launch`), each
direct launch's stream gets CUDA events around the index copy and the kernel, and a device flag
page bumped right before the kernel: ``DIRECTEV`` prints, per launch, the index copy's and the
kernel's device time (us, events) and when the stream reached the kernel (``at``, ms after the
round's first byte, from the page), so a gap is placed: before the kernel (queue, copy) or in it.
DCP_DIRECT_REPLAY=1 then launches the same copy twice more once the request's kernel ended (same
rows, same bytes) and prints their kernel times (``replays``): the kernel with nothing else
running, on the request's own memory. DCP_DIRECT_LOCAL=1 then copies the round's rows from the
job's source into local (this process's) copies of the ranks' caches, and from a local copy of
the source too, 3 times each (``("local", [[job source], [local source]])``): what the job's
memory, not its rows, costs.
"""
import os
import sys
import threading
import time

if os.environ.get("DCP_FLAG_LAG"):
    try:
        from bridge.host_flag import seq_done
        from dcp_jax.transfer import _sender_region as sr

        _orig, _orig_launch = sr.SenderRegion._bump_flag, sr.SenderRegion._launch_fused
        _orig_finish = sr.SenderRegion._finish_fused

        _prof = {"n": int(os.environ.get("DCP_KERNEL_PROF", "0") or 0), "rounds": 0, "p": None}

        _round_first = [None]
        _round_jobs = [None]  # the round's (link, src rows, dst rows), for DCP_DIRECT_LOCAL

        def _launch_fused(self, packed):
            # The bump is enqueued inside `_launch_fused` (behind the launch): note the round first.
            self._flag_lag_round = [(u,) for u, _, _, _ in packed]
            firsts = [u.req.first_byte_at for u, _, _, _ in packed if u.req.first_byte_at is not None]
            _round_first[0] = min(firsts) if firsts else None
            jobs = [(u.target.conn, u.rc.src_rows[lo:hi], u.rc.dst_rows[lo:hi])
                    for u, lo, hi, _ in packed if u.rc.strategy == "fused" and hi > lo]
            _round_jobs[0] = jobs or _round_jobs[0]  # a round without fused rows launches nothing
            return _orig_launch(self, packed)

        def _spin_until(flag, seq, label, first, t_enq):
            def spin():
                end = time.monotonic() + 1.0
                while time.monotonic() < end:
                    if seq_done(flag.value(), seq):
                        now = time.monotonic()
                        print(f"{label} {(now - first) * 1e3:.3f} enqueued {(t_enq - first) * 1e3:.3f}",
                              file=sys.stderr, flush=True)
                        return
                    time.sleep(0)
            threading.Thread(target=spin, daemon=True).start()

        if os.environ.get("DCP_PRE_FLAG"):
            import pallas_kernels
            from bridge.host_flag import SharedFlag

            _pre, _orig_cf = [None], pallas_kernels.copy_fanout

            def _copy_fanout(jobs, **kw):
                first = _round_first[0]
                if first is not None and jobs:
                    if _pre[0] is None:
                        _pre[0] = SharedFlag.create(device=True)
                    seq = _pre[0].bump_after(jobs[0][0].destinations().handles[0])
                    _spin_until(_pre[0], seq, "PREFLAG", first, time.monotonic())
                return _orig_cf(jobs, **kw)

            pallas_kernels.copy_fanout = _copy_fanout

        def _finish_fused(self):
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
                gap = (b.time_range.start - a.time_range.end) if b is not None else -1
                print(f"KERNELS {a.name[:40]} {dur:.1f} us, next {b.name[:30] if b else '-'} after {gap:.1f} us",
                      file=sys.stderr, flush=True)

        def _bump_flag(self, copiers):
            seq = _orig(self, copiers)
            firsts = [u.req.first_byte_at for u, *_ in getattr(self, "_flag_lag_round", [])
                      if u.req.first_byte_at is not None]
            if seq is not None and firsts:
                _spin_until(self._flag, seq, "FLAGLAG", min(firsts), time.monotonic())
            return seq

        if os.environ.get("DCP_DIRECT_EVENTS"):
            import cupy as cp
            from bridge.host_flag import SharedFlag
            from pallas_kernels import triton_launch as tl

            _orig_enqueue, _dpre = tl.enqueue, [None]

            def _enqueue(device_id, size, fill, launches, on_phase=None):
                first, stream, round_jobs = _round_first[0], tl.stream_for(device_id), _round_jobs[0]
                ev = [cp.cuda.Event() for _ in range(3)]
                box = {}

                def fill_ev(host):
                    fill(host)
                    ev[0].record(stream)  # before the index copy

                def before(base, sp):
                    ev[1].record(stream)
                    if first is not None:
                        if _dpre[0] is None:
                            _dpre[0] = SharedFlag.create(device=True, device_id=device_id)
                        box["seq"] = _dpre[0].bump_on_stream(stream)

                def after(base, sp):
                    ev[2].record(stream)

                out = _orig_enqueue(device_id, size, fill_ev, [before, *launches, after], on_phase)
                t_enq = time.monotonic()

                def report():
                    at = None
                    end = time.monotonic() + 1.0
                    while "seq" in box and time.monotonic() < end:
                        if seq_done(_dpre[0].value(), box["seq"]):
                            at = (time.monotonic() - first) * 1e3
                            break
                        time.sleep(0)
                    ev[2].synchronize()
                    copy_us = cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3
                    kern_us = cp.cuda.get_elapsed_time(ev[1], ev[2]) * 1e3
                    enq = (t_enq - first) * 1e3 if first is not None else float("nan")
                    replays = []
                    if os.environ.get("DCP_DIRECT_REPLAY"):
                        # The same launch again (same rows, same bytes: idempotent) once the
                        # request's kernel ended: its time in this process with nothing else
                        # running tells a slow kernel in the request from a slow memory pattern.
                        for _ in range(2):
                            r = [cp.cuda.Event() for _ in range(2)]
                            _orig_enqueue(device_id, size, fill,
                                          [lambda b, sp, r=r: r[0].record(stream), *launches,
                                           lambda b, sp, r=r: r[1].record(stream)])
                            r[1].synchronize()
                            replays.append(round(cp.cuda.get_elapsed_time(r[0], r[1]) * 1e3, 1))
                    if os.environ.get("DCP_DIRECT_LOCAL") and round_jobs:
                        replays.append(("local", _local_times(round_jobs, stream, device_id)))
                    print(f"DIRECTEV copy {copy_us:.1f} us kernel {kern_us:.1f} us at "
                          f"{at if at is None else round(at, 3)} enqueued {enq:.3f} replays {replays}",
                          file=sys.stderr, flush=True)
                threading.Thread(target=report, daemon=True).start()
                return out

            _local = {}
            _bypass = threading.local()

            def _one_buffer(arrays):  # one allocation holding views shaped like `arrays`
                total = sum(int(a.nbytes) for a in arrays)
                buf, views, off = cp.empty(total, cp.uint8), [], 0
                for a in arrays:
                    views.append(buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape))
                    off += int(a.nbytes)
                return buf, views

            def _local_times(jobs, stream, device_id):
                """The round's rows again: from the job's source into local copies of the ranks'
                caches, then from a local copy of the source too (kernel us, events)."""
                from pallas_kernels import PackSource, RowCopier, copy_fanout

                links = [j[0] for j in jobs]
                if "copiers" not in _local:
                    src = links[0].copier.source
                    dsts = [_one_buffer(list(c.mapping.arrays)) for c in links]
                    sbuf = _one_buffer(list(src.layers))
                    for a, b in zip(sbuf[1], src.layers):
                        a[...] = b
                    lsrc = PackSource(sbuf[1])
                    _local.update(keep=(dsts, sbuf, lsrc), copiers=(
                        [RowCopier(src, d[1]) for d in dsts], [RowCopier(lsrc, d[1]) for d in dsts]))
                out = []
                for copiers in _local["copiers"]:
                    times = []
                    for _ in range(3):
                        r = [cp.cuda.Event(), cp.cuda.Event()]
                        _bypass.events = r
                        try:
                            copy_fanout([(c, s, d) for c, (_, s, d) in zip(copiers, jobs)], checked=True)
                        finally:
                            _bypass.events = None
                        r[1].synchronize()
                        times.append(round(cp.cuda.get_elapsed_time(r[0], r[1]) * 1e3, 1))
                    out.append(times)
                return out

            def _enqueue_any(device_id, size, fill, launches, on_phase=None):
                r = getattr(_bypass, "events", None)
                if r is None:
                    return _enqueue(device_id, size, fill, launches, on_phase)
                stream = tl.stream_for(device_id)
                return _orig_enqueue(device_id, size, fill, [lambda b, sp: r[0].record(stream), *launches,
                                                             lambda b, sp: r[1].record(stream)], on_phase)

            tl.enqueue = _enqueue_any

        sr.SenderRegion._bump_flag = _bump_flag
        sr.SenderRegion._finish_fused = _finish_fused
        sr.SenderRegion._launch_fused = _launch_fused
    except Exception as exc:  # noqa: BLE001 - a diagnostic never breaks the job
        print(f"flag_hook: not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
