"""A ticket for the kernels enqueued so far into one device buffer, and nothing else on its device.

`synchronize` waits for the whole device: in a sender's process that includes an engine's copies
out of the pack buffer (UCX's ``cuda_ipc`` puts run on its own streams there), so a round's wait
for its pack also waited for the previous round's transfers. `written(pack)` waits for (or polls)
only what `pack_rows` / `pack_windows` / `copy_fanout` last enqueued into that buffer: the JAX
outputs the module keeps as the buffer's handles (`device.Destinations`) and an event recorded on
the stream of its last direct launch (`triton_launch`). The JAX outputs are followed by a
one-word slice of them, which the next call's donation of the outputs leaves alone.
"""
from __future__ import annotations

import time

from pallas_kernels import device
from pallas_kernels.unpack import _kind

__all__ = ["Written", "written"]


class Written:
    """What was enqueued into a buffer when `written` was called: `ready()` polls, `wait()` blocks.

    Host (numpy) buffers are written by the time a pack call returns: their ticket is ready.
    """

    __slots__ = ("_arrays", "_events")

    def __init__(self, arrays=(), events=()):
        self._arrays, self._events = tuple(arrays), tuple(events)

    def ready(self) -> bool:
        """True once every kernel the ticket covers has finished (no host wait)."""
        return all(a.is_ready() for a in self._arrays) and all(e.done for e in self._events)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits until every kernel the ticket covers has finished; True then. With
        ``timeout_s`` (seconds >= 0) it polls `ready` and gives up after that long: False.

        Raises:
            Whatever JAX or CuPy raise for a failed kernel (an XLA runtime error, a CUDA error).
            TypeError, ValueError: ``timeout_s`` not None or a number >= 0.
        """
        if timeout_s is None:
            for a in self._arrays:
                a.block_until_ready()
            for e in self._events:
                e.synchronize()
            return True
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds or None, got {type(timeout_s).__name__}")
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be >= 0")
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)
        return self.wait()


_MARK = []


def _marker(handle):
    """A one-word JAX array computed from `handle` (so, on JAX's stream, after the kernel that
    made it): it stays queryable after a later call donated `handle` itself."""
    if not _MARK:
        import jax

        _MARK.append(jax.jit(lambda a: a.reshape(-1)[:1]))
    return _MARK[0](handle)


def written(buffer) -> Written:
    """A ticket for the kernels this package has enqueued so far into `buffer`.

    Args:
        buffer: the numpy or CuPy array a pack, unpack or fused copy wrote (e.g. a sender's pack
            buffer after `pack_windows(..., sync=False)`).

    Returns:
        `Written`: ready at once for numpy and for a CuPy buffer no kernel of this package wrote;
        otherwise covering its last JAX outputs (through a one-word slice enqueued behind them:
        ~20 us of host time) and an event recorded now on the stream of its last direct launch.
        Later launches are not covered (take a new ticket).

    Raises:
        TypeError: `buffer` is neither numpy nor CuPy.
    """
    kind = _kind(buffer)
    if kind == "numpy":
        return Written()
    if kind != "cupy":
        raise TypeError(f"buffer must be a numpy or CuPy array, got {type(buffer).__name__}")
    arrays, streams = [], []
    for d in device.destinations_of(buffer):
        if d.jax_last and d.handles:
            # Not the handles themselves: the next call into the buffer donates (deletes) them.
            arrays.extend(_marker(h) for h in d.handles if h.size)
        if d.direct is not None and all(s is not d.direct for s in streams):
            streams.append(d.direct)
    events = []
    for s in streams:
        import cupy as cp

        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(s)
        events.append(ev)
    return Written(arrays, events)
