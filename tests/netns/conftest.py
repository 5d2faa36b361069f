"""Two-host tests: the connector across network namespaces joined by veth links (`dcp_jax.netns`).

Every test here starts real processes inside namespaces it made (`Hosts`), over real engines
(NIXL over UCX's TCP transport on the veth, Mooncake over TCP), and removes them at the end.
UCX is held to TCP (``UCX_TLS=tcp``, `dcp_jax.netns.ENGINE_ENV`): the namespaces share one kernel,
so by default UCX puts between them with CMA (process_vm_writev), and the bytes skip the veth.
They need root (CI runs as root) and skip with the reason otherwise.
"""
import os
import sys
import time

import numpy as np
import pytest

from bridge.mooncake import mooncake_available
from bridge.nixl import nixl_available
from dcp_jax.netns import Hosts, needs_root_reason

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

ENGINES = [e for e, ok in (("nixl", nixl_available()), ("mooncake", mooncake_available())) if ok]
ITEM_LENS = (48, 16)
PAGE = 4


def pytest_collection_modifyitems(config, items):
    why = needs_root_reason()
    if why:
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if "tests/netns" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


@pytest.fixture
def nixl_only():
    """NIXL for tests whose subject is the connector's logic, not the engine (CI time)."""
    from bridge.nixl import nixl_available

    if not nixl_available():
        pytest.skip("NIXL does not import here")
    return "nixl"


@pytest.fixture
def hosts2():
    with Hosts(2) as h:
        yield h


def pages_for(num_tokens, page=PAGE):
    return -(-num_tokens // page)


def roundtrip(sender, receiver, rid, num_tokens, *, src_table=None, dst_table=None, src_pages=64,
              seed=1, timeout_s=20.0):
    """One request from ``sender`` to a dcp_size=1 ``receiver`` agent: expect, send, both
    SUCCESS, every row byte-exact, every other receiver page (guard pages included) still the
    sentinel; then both release it and the receiver's pages are wiped back to the sentinel.
    Returns the receiver's check dict."""
    n = pages_for(num_tokens)
    src_table = np.arange(n) if src_table is None else np.asarray(src_table)
    dst_table = np.arange(n)[::-1].copy() if dst_table is None else np.asarray(dst_table)
    receiver.call("expect", rid, dst_table, num_tokens)
    sender.call("send", rid, src_table, 0, num_tokens)
    s = sender.call("wait", rid, timeout_s)
    r = receiver.call("wait", rid, timeout_s)
    assert (s[0], r[0]) == ("SUCCESS", "SUCCESS"), (s, r)
    got = receiver.call("check", dst_table, src_table, num_tokens, seed, src_pages)
    assert got == dict(rows=num_tokens, bad_rows=0), got
    assert receiver.call("sentinel_ok", dst_table.tolist())
    sender.call("release", rid)
    receiver.call("release", rid)
    receiver.call("clear", dst_table.tolist())
    return got


def wait_for(fn, timeout_s, every=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(every)
    return fn()
