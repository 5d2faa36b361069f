"""Two or three "hosts" on one machine: Linux network namespaces joined by veth links.

Host 0 (the prefill host) has one point-to-point veth link to every other host (decode hosts,
or a hostile peer); every host reaches all of host 0's addresses, and only those. Link ``i`` (host 0 <-> host ``i``) is the subnet ``198.19.{200+i}.0/24`` of
the benchmark range (RFC 2544, 198.18.0.0/15, never routed on the Internet): host 0 is ``.1``,
host ``i`` is ``.2``. The addresses exist only inside the namespaces this object created, so
they cannot collide with anything of the machine; no traffic leaves it. The engines of a host's
processes move their bytes over its veth: NIXL through UCX's TCP transport (`ENGINE_ENV`: the
namespaces share one kernel, over which UCX would pick CMA and skip the link), Mooncake over TCP
to the peer's address.

Ownership: a `Hosts` owns its namespaces (and with them the veth devices inside) and the
processes it started; `close` (also at interpreter exit, ``atexit``) kills those processes
by pid and deletes the namespaces. Names carry the creating pid (``dcpn-<pid>-<hex>-h<i>``), so a
later `Hosts` deletes namespaces left by a run whose process is gone (a crash, SIGKILL).

Needs root (``ip netns``). `needs_root_reason` says why it cannot run here, or None.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from bridge.engine_env import QUIET_ENV

__all__ = ["Hosts", "needs_root_reason", "remove_stale", "enter_netns", "run_in", "link_running", "PREFIX", "ENGINE_ENV"]

PREFIX = "dcpn"
#: Engine settings every process of a host gets (UCX_NET_DEVICES is set per host): quiet logs
#: (`bridge.engine_env`) and UCX on TCP only. The namespaces share one kernel, so UCX counts the
#: hosts as one node and puts by default over CMA (process_vm_writev): the bytes would skip the
#: veth, a link fault would not stop them and a SIGSTOPped receiver would still be written.
#: ("self" is not needed: NIXL's own endpoint joins two of its workers, which UCX's self transport
#: does not serve; it uses TCP either way.)
ENGINE_ENV = {**QUIET_ENV, "UCX_TLS": "tcp"}
_NETNS_DIR = "/run/netns"
_IP_TIMEOUT_S = 10.0
#: How long `Hosts.link_up` waits for both ends to report carrier (the kernel's linkwatch may
#: take up to about 1 s to mark a fresh veth running).
LINK_UP_TIMEOUT_S = 10.0


def needs_root_reason() -> str | None:
    """None when namespaces can be made here, else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "needs root (ip netns / veth); CI runs as root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if not hasattr(os, "setns"):
        return "os.setns needs Python >= 3.12"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def link_running(ns: str, dev: str) -> bool:
    """Whether device ``dev`` in namespace ``ns`` is up with carrier (operstate UP)."""
    out = _ip("-n", ns, "-j", "link", "show", "dev", dev).stdout
    return bool(out) and json.loads(out)[0].get("operstate") == "UP"


def _list_netns() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Deletes namespaces named ``<prefix>-<pid>-...`` whose creating process is gone; returns
    their names. Namespaces of live runs (another test session) are left alone."""
    gone = []
    for name in _list_netns():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _ip("netns", "delete", name, check=False)
            gone.append(name)
    return gone


_libc = None


def _mount_fresh_sys() -> None:
    """Gives this process its own mount namespace with a /sys of its network namespace, as
    ``ip netns exec`` does (UCX reads interface facts from /sys/class/net)."""
    global _libc
    _libc = _libc or ctypes.CDLL(None, use_errno=True)
    ms_rec, ms_slave, mnt_detach = 0x4000, 0x80000, 2
    os.unshare(os.CLONE_NEWNS)
    if _libc.mount(b"none", b"/", None, ms_rec | ms_slave, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rslave /")
    _libc.umount2(b"/sys", mnt_detach)
    if _libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mount sysfs /sys")


def enter_netns(name: str) -> None:
    """Moves the calling process (call it before any thread starts) into namespace ``name``."""
    fd = os.open(os.path.join(_NETNS_DIR, name), os.O_RDONLY)
    try:
        os.setns(fd, os.CLONE_NEWNET)
    finally:
        os.close(fd)
    _mount_fresh_sys()


def _child_main(ns: str, env: dict[str, str], target: Callable, args: tuple) -> None:
    enter_netns(ns)
    os.environ.update(env)
    target(*args)


def _exit_on_sigterm() -> None:
    """SIGTERM runs ``atexit`` (and ``with`` exits) instead of killing the process outright, so
    a terminated run still removes its namespaces; left alone if someone installed a handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))


class Hosts:
    """``n`` network namespaces (2 or 3): host 0 linked to each other host by its own veth.

    Args:
        n: hosts, 2 or 3.
        prefix: namespace name prefix (stale ones of dead runs with it are removed first).

    Raises:
        RuntimeError: not root, or an ``ip`` command failed (what was made is removed again).
        ValueError: ``n`` not 2 or 3.
    """

    def __init__(self, n: int = 2, *, prefix: str = PREFIX):
        if n not in (2, 3):
            raise ValueError(f"n={n!r} must be 2 or 3 hosts")
        why = needs_root_reason()
        if why:
            raise RuntimeError(why)
        self.n, self.prefix = n, prefix
        self.stale_removed = remove_stale(prefix)
        tag = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        self._procs: list[mp.Process] = []
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)
        _exit_on_sigterm()
        try:
            for name in self.names:
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
            for i in range(1, n):
                _ip("link", "add", self.device(0, i), "netns", self.names[0], "type", "veth",
                    "peer", "name", self.device(i), "netns", self.names[i])
                _ip("-n", self.names[0], "addr", "add", f"{self.addr(0, i)}/24", "dev", self.device(0, i))
                _ip("-n", self.names[i], "addr", "add", f"{self.addr(i)}/24", "dev", self.device(i))
            for i in range(1, n):
                self.link_up(i)
                # Host i reaches every address of host 0 (not the other hosts: no forwarding).
                _ip("-n", self.names[i], "route", "add", "198.19.0.0/16", "via", self.addr(0, i))
        except BaseException:
            self.close()
            raise

    # ---- where things are ------------------------------------------------------------------
    @staticmethod
    def device(host: int, link: int | None = None) -> str:
        """The veth device of ``host`` on link ``link`` (host 0 has one per other host; the
        others have one, toward host 0)."""
        return f"veth{link}" if host == 0 else "veth0"

    @staticmethod
    def addr(host: int, link: int | None = None) -> str:
        """``host``'s IPv4 address on link ``link`` (default: its only link; host 0 needs it)."""
        if host == 0:
            if link is None:
                raise ValueError("host 0 has one address per link: give link=")
            return f"198.19.{200 + link}.1"
        return f"198.19.{200 + host}.2"

    def env(self, host: int) -> dict[str, str]:
        """Environment for a process on ``host``: UCX over TCP on its veth devices only, quiet
        logs (`ENGINE_ENV`)."""
        devs = [self.device(0, i) for i in range(1, self.n)] if host == 0 else [self.device(host)]
        return {**ENGINE_ENV, "UCX_NET_DEVICES": ",".join(devs)}

    def exec_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    # ---- faults ------------------------------------------------------------------------------
    def link_down(self, link: int) -> None:
        """Takes link ``link`` (host 0 <-> host ``link``) down on both ends."""
        _ip("-n", self.names[0], "link", "set", self.device(0, link), "down")
        _ip("-n", self.names[link], "link", "set", self.device(link), "down")

    def link_up(self, link: int, timeout_s: float = LINK_UP_TIMEOUT_S) -> None:
        """Brings link ``link`` up on both ends and waits until both are running (operstate UP).

        UCX skips interfaces that are up but not yet running (no carrier), so an engine
        started right after ``ip link set up`` would find no transport ("Destination is
        unreachable"); hence the wait.

        Raises:
            TimeoutError: an end is not running within ``timeout_s`` seconds.
        """
        ends = [(self.names[link], self.device(link)), (self.names[0], self.device(0, link))]
        for ns, dev in ends:
            _ip("-n", ns, "link", "set", dev, "up")
        deadline = time.monotonic() + timeout_s
        for ns, dev in ends:
            while not link_running(ns, dev):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"link {dev} in {ns} not running within {timeout_s:g} s")
                time.sleep(0.02)

    # ---- processes ---------------------------------------------------------------------------
    def spawn(self, host: int, target: Callable, args: tuple = (), *, name: str | None = None,
              env: dict[str, str] | None = None) -> mp.Process:
        """Starts ``target(*args)`` in a fresh (spawned) process inside ``host``'s namespace.

        ``target`` must be importable (module level). Pipes from ``multiprocessing`` work across
        namespaces (they are file descriptors, not network). The process is killed at `close`.
        """
        self._check_open()
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_child_main, args=(self.names[host], {**self.env(host), **(env or {})}, target, args),
                        name=name or f"netns-h{host}", daemon=True)
        p.start()
        with self._lock:
            self._procs = [q for q in self._procs if q.is_alive()] + [p]
        return p

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("these Hosts are closed")

    def close(self) -> None:
        """Kills the processes it started (by pid), deletes its namespaces. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for name in self.names:
            if name in _list_netns():
                _ip("netns", "delete", name, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hosts({self.names}, closed={self._closed})"


def run_in(hosts: Hosts, host: int, argv: Sequence[str], timeout_s: float = 30.0, **kw: Any) -> subprocess.CompletedProcess:
    """Runs a command inside a host's namespace (``ip netns exec``) and waits for it."""
    return subprocess.run(hosts.exec_argv(host, argv), capture_output=True, text=True, timeout=timeout_s, **kw)
