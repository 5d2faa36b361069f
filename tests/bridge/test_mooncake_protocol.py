"""Mooncake's transport choice on a host-only build: protocol="auto" starts the engine at the
first registration (tcp for host memory), VRAM and nvlink_intra are refused clearly without the
CUDA build. The nvlink_intra transfers themselves run in tests/gpu/test_mooncake_gpu.py."""
import numpy as np
import pytest

from bridge import BridgeError, MemoryRegion, RegistrationError
from bridge.mooncake import MOONCAKE_PROTOCOLS, MooncakeEngine, mooncake_available, mooncake_supports_cuda

pytestmark = pytest.mark.skipif(not mooncake_available(), reason="Mooncake does not import here (needs libibverbs1)")


def test_auto_starts_tcp_at_the_first_host_registration():
    buf = np.zeros(1 << 16, np.uint8)
    with MooncakeEngine("auto-host") as eng:
        assert eng.protocol is None  # nothing started yet
        eng.register([buf])
        assert eng.protocol == "tcp"
        host, _, port = eng.peer_info().session.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0


def test_session_before_any_registration_starts_tcp():
    with MooncakeEngine("auto-peer-first") as eng:
        assert eng.session.startswith("127.0.0.1:") and eng.protocol == "tcp"


@pytest.mark.skipif(mooncake_supports_cuda(), reason="checks the host-only build's refusals")
def test_host_only_build_refuses_vram_and_nvlink_clearly():
    with pytest.raises(BridgeError, match="nvlink_intra.*CUDA build"):
        MooncakeEngine("nv", protocol="nvlink_intra")
    with MooncakeEngine("auto-vram") as eng:
        with pytest.raises(RegistrationError, match="VRAM region .* needs a CUDA build of Mooncake"):
            eng.register([MemoryRegion(1 << 32, 4096, "VRAM", 0)])
        assert eng.regions == ()


@pytest.mark.parametrize("bad", ["udp", "", "TCP", None])
def test_unknown_protocol_is_refused(bad):
    with pytest.raises(ValueError, match="protocol=.* must be one of"):
        MooncakeEngine("bad", protocol=bad)
    assert "auto" in MOONCAKE_PROTOCOLS and "nvlink_intra" in MOONCAKE_PROTOCOLS
