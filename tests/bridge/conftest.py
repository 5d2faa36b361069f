"""Bridge test setup: engine environment, spawn helpers, engines reused per module.

Engines are real (NIXL over UCX, Mooncake over TCP), host memory, loopback. MC_TCP_* stay at
their defaults on purpose: the Mooncake adapter's windowing is what keeps large batches working.
"""
import os
import sys

# The engines' loopback and log settings come from tests/conftest.py, loaded before this file.

# Spawned children import the helper module by name: put its folder on the path they inherit.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_ROOT = os.path.dirname(os.path.dirname(_HERE))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402

import _peer_worker  # noqa: E402
from bridge.mooncake import mooncake_available  # noqa: E402
from bridge.nixl import nixl_available  # noqa: E402

ENGINES = _peer_worker.available_kinds()


@pytest.fixture(scope="module", params=ENGINES)
def two_connected_engines(request):
    """One connected (initiator, target) pair per engine kind, shared by a module's tests."""
    pair = _peer_worker.Pair(request.param)
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def nixl_pair():
    """Two connected NIXL engines in this process (initiator -> target), reused by a module."""
    if not nixl_available():
        pytest.skip("NIXL does not import here")
    pair = _peer_worker.Pair("nixl")
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def mooncake_pair():
    """Two connected Mooncake engines in this process, reused by a module (teardown ~1 s each)."""
    if not mooncake_available():
        pytest.skip("Mooncake does not import here (needs libibverbs1)")
    pair = _peer_worker.Pair("mooncake")
    yield pair
    pair.close()
