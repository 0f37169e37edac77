"""A second "host" on this machine: a network namespace joined to this one by a veth pair.

``mq bench --two-hosts`` (and tests of cross-host behaviour) run the peer process in its own
network, PID and IPC namespaces, so every same-host shortcut is closed to it: no loopback, no
abstract unix sockets, no shared memory segments, no cross-process memory reads
(TensorPipe's ``cma`` channel). What it can reach is this host's end of the veth, a /24 of
10.77.X.0 chosen so that it clashes with no address this host already has.

    with TwoHosts() as hosts:                     # ip netns add, veth pair, addresses
        cmd = hosts.command(["python", "peer.py"])   # ip netns exec NS unshare --pid --ipc ...
        exe = hosts.wrapper()                     # the same, as an executable for spawn
    # namespace and links are gone here, also after an exception or Ctrl-C

Several processes per "host", several hosts (fan-out across hosts): :class:`Hosts` makes N
namespaces joined by a bridge in a namespace of its own (this host's network is not touched).
Each host keeps one holder process that owns its PID, IPC and mount namespaces, and every
process started there (``hosts.wrapper(i)``) enters all of them with ``nsenter``: processes of
one host share memory by descriptor like processes of one machine; processes of two hosts share
nothing but the bridge.

Names carry the owning process id (``mqbench-<pid>-<n>``, links ``mqb<pid>h<n>`` /
``mqb<pid>p<n>``), so :func:`cleanup_stale` removes what a crashed run left behind without
touching a namespace a concurrent run still uses.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` (iproute2) and ``unshare`` (util-linux);
:func:`unavailable` says which one is missing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Sequence

from mq.launch.supervise import die_with_parent
from mq.tools.errors import ToolError

__all__ = [
    "NS_PREFIX",
    "Hosts",
    "NetnsError",
    "TwoHosts",
    "cleanup_stale",
    "list_namespaces",
    "list_links",
    "unavailable",
]

NS_PREFIX = "mqbench-"
LINK_PREFIX = "mqb"
_NAME_RE = re.compile(rf"^{re.escape(NS_PREFIX)}(\d+)-(\d+)$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}(\d+)[hp](\d+)$")
_counter = itertools.count()
_IP_TIMEOUT_S = 20.0


class NetnsError(ToolError):
    """Namespaces cannot be made here, or an ``ip`` command failed (the message says why)."""


def unavailable() -> str | None:
    """Why a second host cannot be made here, or None when it can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN/CAP_SYS_ADMIN): run as root, e.g. with sudo"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install {package}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run an iproute2 command; NetnsError (saying which) when it fails or hangs."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{shlex.join(cmd)}` did not finish within {_IP_TIMEOUT_S:g}s") from None
    if check and done.returncode != 0:
        raise NetnsError(f"`{shlex.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def list_namespaces(prefix: str = NS_PREFIX) -> list[str]:
    """Named network namespaces starting with ``prefix``."""
    done = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def list_links(prefix: str = LINK_PREFIX) -> list[str]:
    """Links of this network namespace whose name matches mq's veth names."""
    done = _ip("-o", "link", "show", check=False)
    out = []
    for line in done.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix) and _LINK_RE.match(name):
                out.append(name)
    return sorted(out)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(*, all_owners: bool = False) -> list[str]:
    """Remove namespaces and veth links left by runs whose process is gone.

    Args:
        all_owners: also remove those of live processes (only when nothing else uses them).

    Returns:
        The names removed.
    """
    if unavailable():
        return []
    removed = []
    for name in list_namespaces():
        m = _NAME_RE.match(name)
        if m and (all_owners or not _pid_alive(int(m.group(1)))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for link in list_links():
        m = _LINK_RE.match(link)
        if m and (all_owners or not _pid_alive(int(m.group(1)))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def _used_subnets() -> set[int]:
    """Third octets X of 10.77.X.0/24 networks this namespace already has addresses in."""
    done = _ip("-o", "-4", "addr", "show", check=False)
    used = set()
    for m in re.finditer(r"inet (10\.77\.(\d+)\.\d+)/", done.stdout):
        used.add(int(m.group(2)))
    return used


class TwoHosts:
    """A network namespace plus a veth pair to it; a context manager that removes both.

    Attributes:
        name: the namespace (``ip netns exec NAME ...``).
        host_if, peer_if: the veth ends, in this namespace and in ``name``.
        host_addr, peer_addr: their IPv4 addresses (one /24).
    """

    def __init__(self, *, subnet: str | None = None, mtu: int | None = None):
        reason = unavailable()
        if reason:
            raise NetnsError(f"cannot make a second host: {reason}")
        pid, n = os.getpid(), next(_counter)
        self.name = f"{NS_PREFIX}{pid}-{n}"
        self.host_if = f"{LINK_PREFIX}{pid}h{n}"
        self.peer_if = f"{LINK_PREFIX}{pid}p{n}"
        if len(self.host_if) > 15:  # IFNAMSIZ - 1
            raise NetnsError(f"link name {self.host_if!r} is longer than 15 characters")
        self._subnet = subnet
        self.mtu = mtu
        self.host_addr = ""
        self.peer_addr = ""
        self.prefixlen = 24
        self._wrappers: list[str] = []
        self._up = False
        self._lock = threading.Lock()

    # -------------------------------------------------------------- lifecycle
    def create(self) -> "TwoHosts":
        cleanup_stale()
        if self._subnet:
            net = ipaddress.ip_network(self._subnet, strict=False)
        else:
            used = _used_subnets()
            start = os.getpid() % 254
            free = next((x for x in ((start + i) % 254 + 1 for i in range(254)) if x not in used), None)
            if free is None:
                raise NetnsError("no free 10.77.X.0/24 subnet left for the veth pair")
            net = ipaddress.ip_network(f"10.77.{free}.0/24")
        hosts = list(itertools.islice(net.hosts(), 2))
        self.host_addr, self.peer_addr, self.prefixlen = str(hosts[0]), str(hosts[1]), net.prefixlen
        self._up = True  # from here on, remove() cleans whatever part exists
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if, "netns", self.name)
            if self.mtu:
                _ip("link", "set", self.host_if, "mtu", str(self.mtu))
                _ip("-n", self.name, "link", "set", self.peer_if, "mtu", str(self.mtu))
            _ip("addr", "add", f"{self.host_addr}/{self.prefixlen}", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{self.peer_addr}/{self.prefixlen}", "dev", self.peer_if)
            _ip("-n", self.name, "link", "set", self.peer_if, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Delete the namespace, the links and the wrappers. Idempotent; never raises."""
        with self._lock:
            if not self._up:
                return
            self._up = False
        with contextlib.suppress(Exception):
            _ip("netns", "del", self.name, check=False)
        with contextlib.suppress(Exception):
            if self.host_if in list_links():
                _ip("link", "del", self.host_if, check=False)
        _unlink_all(self._wrappers)

    def __enter__(self) -> "TwoHosts":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def exists(self) -> bool:
        return self.name in list_namespaces()

    # -------------------------------------------------------------- running in it
    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run as the second host: own network, PID and IPC namespaces (and a mount
        namespace with its own /proc). The child dies with the ``unshare`` process."""
        return ["ip", "netns", "exec", self.name, "unshare", "--pid", "--ipc", "--fork",
                "--mount-proc", "--kill-child", *argv]

    def wrapper(self, python: str | None = None) -> str:
        """An executable that runs ``python "$@"`` as the second host; give it to
        :func:`multiprocessing.spawn.set_executable` to spawn workers there."""
        path = _python_wrapper(self.name, self.command([python or sys.executable]))
        self._wrappers.append(path)
        return path

    def link_bytes(self) -> int:
        """Bytes sent plus received on this host's end of the veth so far."""
        total = 0
        for what in ("tx_bytes", "rx_bytes"):
            try:
                with open(f"/sys/class/net/{self.host_if}/statistics/{what}") as f:
                    total += int(f.read())
            except (OSError, ValueError):
                return -1
        return total

    def __repr__(self) -> str:
        return (f"<TwoHosts {self.name} {self.host_if}={self.host_addr} <-> "
                f"{self.peer_if}={self.peer_addr}/{self.prefixlen}>")


def _tc_rate(netns: str | None, dev: str, rate: str) -> None:
    """Cap what ``dev`` (in ``netns``, or here) sends at ``rate``: a token bucket with a 256 KB
    burst (more than one GSO segment) and up to 50 ms of queue."""
    if not shutil.which("tc"):
        raise NetnsError("`tc` not found: install iproute2 for --link-rate")
    tc = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    _run(tc if netns is None else ["ip", "netns", "exec", netns, *tc])


def _python_wrapper(prefix: str, command: list[str]) -> str:
    """A private executable script that runs ``command "$@"`` (for spawn.set_executable)."""
    fd, path = tempfile.mkstemp(prefix=f"{prefix}-", suffix=".sh")
    with os.fdopen(fd, "w") as f:
        f.write("#!/bin/sh\nexec " + shlex.join(command) + ' "$@"\n')
    os.chmod(path, 0o700)
    return path


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    paths.clear()


def _find_child(pid: int, comm: str, timeout: float = 10.0) -> int:
    """The pid of a descendant of ``pid`` named ``comm`` (waits for it to appear)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parents: dict[int, int] = {}
        names: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            parents[int(entry)], names[int(entry)] = ppid, name
        for child, name in names.items():
            if name != comm:
                continue
            p = child
            while p > 1:
                p = parents.get(p, 0)
                if p == pid:
                    return child
        time.sleep(0.02)
    raise NetnsError(f"the namespace holder under pid {pid} did not start within {timeout:g}s")


class Hosts:
    """``n`` network-namespace hosts on one bridge; a context manager that removes them.

    Host ``i`` has address ``addrs[i]`` (one /24) and its own network, PID, IPC and mount
    namespaces, shared by every process started through :meth:`wrapper` ``(i)``. The bridge
    lives in a namespace of its own; with ``root=True`` this host joins it too, by a veth whose
    end here has address ``root_addr`` (the only thing added to this host's network).
    ``rate`` (a tc rate, e.g. ``2gbit``): every host's uplink, this host's veth too, sends at
    most that (a token bucket), as a NIC would: the network, not the cores, sets the pace.
    """

    def __init__(self, n: int, *, root: bool = False, subnet: str | None = None, rate: str | None = None):
        reason = unavailable() or (None if shutil.which("nsenter") else "`nsenter` not found: install util-linux")
        if reason:
            raise NetnsError(f"cannot make namespace hosts: {reason}")
        if not 1 <= n <= 200:
            raise NetnsError(f"hosts: 1 to 200, got {n}")
        self.n = n
        self._subnet = subnet
        self.rate = rate
        pid = os.getpid()
        self.switch = f"{NS_PREFIX}{pid}-{next(_counter)}"
        self.names: list[str] = []
        self.links: list[tuple[str, str]] = []  # (switch side, host side)
        for _ in range(n):
            k = next(_counter)
            self.names.append(f"{NS_PREFIX}{pid}-{k}")
            self.links.append((f"{LINK_PREFIX}{pid}h{k}", f"{LINK_PREFIX}{pid}p{k}"))
        if any(len(a) > 15 for a, _ in self.links):
            raise NetnsError(f"link name {self.links[-1][0]!r} is longer than 15 characters")
        self.root_link: tuple[str, str] | None = None  # (here, switch side)
        if root:
            k = next(_counter)
            self.root_link = (f"{LINK_PREFIX}{pid}h{k}", f"{LINK_PREFIX}{pid}p{k}")
        self.root_addr = ""
        self.addrs: list[str] = []
        self.prefixlen = 24
        self._holders: list[subprocess.Popen] = []
        self._holder_pids: list[int] = []
        self._wrappers: list[str] = []
        self._up = False
        self._lock = threading.Lock()

    def create(self) -> "Hosts":
        cleanup_stale()
        if self._subnet:
            net = ipaddress.ip_network(self._subnet, strict=False)
        else:
            used = _used_subnets()
            start = (os.getpid() + 97) % 254
            free = next((x for x in ((start + i) % 254 + 1 for i in range(254)) if x not in used), None)
            if free is None:
                raise NetnsError("no free 10.77.X.0/24 subnet left for the bridge")
            net = ipaddress.ip_network(f"10.77.{free}.0/24")
        every = list(itertools.islice(net.hosts(), self.n + 1))
        self.addrs, self.root_addr = [str(a) for a in every[:self.n]], str(every[self.n])
        self.prefixlen = net.prefixlen
        self._up = True
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name, (sw_if, host_if), addr in zip(self.names, self.links, self.addrs):
                _ip("netns", "add", name)
                _ip("link", "add", sw_if, "type", "veth", "peer", "name", host_if, "netns", name)
                _ip("link", "set", sw_if, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", sw_if, "master", "br0")
                _ip("-n", self.switch, "link", "set", sw_if, "up")
                _ip("-n", name, "addr", "add", f"{addr}/{self.prefixlen}", "dev", host_if)
                _ip("-n", name, "link", "set", host_if, "up")
                _ip("-n", name, "link", "set", "lo", "up")
            if self.root_link:
                here, sw_if = self.root_link
                _ip("link", "add", here, "type", "veth", "peer", "name", sw_if, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", sw_if, "master", "br0")
                _ip("-n", self.switch, "link", "set", sw_if, "up")
                _ip("addr", "add", f"{self.root_addr}/{self.prefixlen}", "dev", here)
                _ip("link", "set", here, "up")
            if self.rate:
                uplinks: list[tuple[str | None, str]] = [(name, host_if) for name, (_sw, host_if)
                                                         in zip(self.names, self.links)]
                uplinks += [(None, self.root_link[0])] if self.root_link else []
                for ns, dev in uplinks:  # (ns: None for the root namespace; `name` is a str below)
                    _tc_rate(ns, dev, self.rate)
            for name in self.names:
                holder = subprocess.Popen(
                    ["ip", "netns", "exec", name, "unshare", "--pid", "--ipc", "--fork", "--mount-proc",
                     "--kill-child", "sleep", "infinity"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent)
                self._holders.append(holder)
                self._holder_pids.append(_find_child(holder.pid, "sleep"))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Kill every process of the hosts, delete namespaces, links and wrappers. Idempotent."""
        with self._lock:
            if not self._up:
                return
            self._up = False
        for holder in self._holders:  # its PID namespace, and every process in it, goes too
            with contextlib.suppress(Exception):
                holder.kill()
                holder.wait(5)
        self._holders.clear()
        for name in [*self.names, self.switch]:
            with contextlib.suppress(Exception):
                _ip("netns", "del", name, check=False)
        with contextlib.suppress(Exception):
            if self.root_link and self.root_link[0] in list_links():
                _ip("link", "del", self.root_link[0], check=False)
        _unlink_all(self._wrappers)

    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``host`` (its network, PID, IPC and mount namespaces), in the
        current directory."""
        return ["nsenter", "-t", str(self._holder_pids[host]), "-n", "-p", "-i", "-m",
                f"--wd={os.getcwd()}", "--", *argv]

    def wrapper(self, host: int, python: str | None = None) -> str:
        """An executable that runs ``python "$@"`` on host ``host``; give it to
        :func:`multiprocessing.spawn.set_executable` to spawn workers there."""
        path = _python_wrapper(self.names[host], self.command(host, [python or sys.executable]))
        self._wrappers.append(path)
        return path

    def __repr__(self) -> str:
        return f"<Hosts {self.n} on {self.switch}: {', '.join(self.addrs)}/{self.prefixlen}>"
