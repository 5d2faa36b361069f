"""bridge.host_flag on the host: the page's life cycle, a reader in another process, the names a peer
may send, and the serial-number order against a brute-force reference."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bridge.host_flag import FLAG_BYTES, FlagError, OpenedFlag, SharedFlag, check_flag_name, seq_done

READER = """
import sys
sys.path.insert(0, sys.argv[3])
from bridge.host_flag import OpenedFlag
with OpenedFlag(sys.argv[1]) as f:
    print(f.value(), f.done(int(sys.argv[2])), f.done(int(sys.argv[2]) + 1))
"""


def _root():
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_reader_in_another_process_sees_each_bump():
    with SharedFlag.create() as flag:
        assert flag.route == "host" and flag.value() == 0 and flag.seq == 0
        st_ = os.stat(flag.path)
        assert st_.st_size == FLAG_BYTES and st_.st_mode & 0o777 == 0o600
        for want in (1, 2, 3):
            assert flag.bump_after(np.zeros(3)) == want  # host: the argument is not needed
            out = subprocess.run([sys.executable, "-c", READER, flag.name, str(want), _root()],
                                 capture_output=True, text=True, timeout=60)
            assert out.stdout.split() == [str(want), "True", "False"], out.stderr
    assert not os.path.exists(flag.path)


def test_close_is_idempotent_and_closed_objects_refuse():
    flag = SharedFlag.create()
    reader = OpenedFlag(flag.name)
    flag.bump_after()
    flag.close()
    flag.close()
    assert flag.closed and not os.path.exists(flag.path)
    assert reader.value() == 1  # a reader keeps the page's file open until it closes
    reader.close()
    reader.close()
    assert reader.closed
    for call in (lambda: flag.bump_after(), flag.value, reader.value, lambda: reader.done(1)):
        with pytest.raises(RuntimeError, match="closed"):
            call()


@pytest.mark.parametrize("bad", [
    None, 7, b"dcp_jax_flag_1_0123456789abcdef", "", "dcp_jax_flag_1_0123456789abcde",
    "dcp_jax_flag_1_0123456789ABCDEF", "dcp_jax_flag_x_0123456789abcdef", "../dcp_jax_flag_1_0123456789abcdef",
    "dcp_jax_flag_1_0123456789abcdef/..", "dcp_jax_flag_1_0123456789abcdef\n", "dcp_jax_flag_12345678901_0123456789abcdef",
])
def test_peer_names_of_another_form_are_refused_before_any_open(bad):
    with pytest.raises(ValueError, match="dcp_jax_flag_<pid>"):
        check_flag_name(bad)
    with pytest.raises(ValueError, match="dcp_jax_flag_<pid>"):
        OpenedFlag(bad)


def test_a_page_its_owner_shrinks_answers_an_error_not_sigbus():
    with SharedFlag.create() as flag:
        flag.bump_after()
        reader = OpenedFlag(flag.name)
        assert reader.value() == 1
        os.truncate(flag.path, 0)  # a mapped read would now kill this process with SIGBUS
        with pytest.raises(FlagError, match="shrank to 0 bytes"):
            reader.value()
        with pytest.raises(FlagError, match="shrank"):
            reader.done(1)
        reader.close()


def test_a_fifo_or_directory_under_a_flag_name_is_refused_without_blocking():
    import time

    for make in (os.mkfifo, os.mkdir):
        path = "/dev/shm/dcp_jax_flag_1_" + "a" * 16
        make(path)
        try:
            t0 = time.monotonic()
            with pytest.raises(FlagError, match="not a regular file|cannot open"):
                OpenedFlag(os.path.basename(path))
            assert time.monotonic() - t0 < 1.0  # a FIFO opened for reading would block forever
        finally:
            (os.rmdir if make is os.mkdir else os.unlink)(path)


def test_missing_pages_and_pages_of_another_size_are_refused():
    with pytest.raises(FlagError, match="cannot open"):
        OpenedFlag("dcp_jax_flag_1_" + "f" * 16)
    path = "/dev/shm/dcp_jax_flag_1_" + "e" * 16
    with open(path, "wb") as f:
        f.write(b"\0" * 8)
    try:
        with pytest.raises(FlagError, match="8 bytes, not 4096"):
            OpenedFlag(os.path.basename(path))
    finally:
        os.unlink(path)


def test_a_device_flag_without_cupy_says_so():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(FlagError, match="CuPy"):
            SharedFlag.create(device=True)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dcp_jax_flag_{os.getpid()}_")]
    else:
        pytest.skip("CuPy imports here: tests/gpu/test_host_flag_gpu.py covers the device flag")


def _brute_done(value, seq):
    """RFC 1982 by enumeration: seq is reached when value is seq or one of the 2**31 - 1 numbers after it."""
    d = (value - seq) % 2**32
    return d == 0 or 0 < d < 2**31


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(-2**31 + 1, 2**31 - 1))
def test_seq_done_is_serial_number_order_across_the_wrap(seq, ahead):
    value = (seq + ahead) % 2**32
    assert seq_done(value, seq) == (ahead >= 0) == _brute_done(value, seq)


def test_seq_done_hand_cases():
    assert seq_done(5, 5) and seq_done(6, 5) and not seq_done(4, 5)
    assert seq_done(0, 2**32 - 1) and not seq_done(2**32 - 1, 0)  # the counter wrapped
    assert seq_done(2**31 - 1, 0) and not seq_done(2**31, 0)
