"""``mq bench --mode fanout --hosts 2,4``: fan-out of one large message across namespace hosts.

One run measures, interleaved batch by batch so machine noise hits every row alike:

- ``1 remote``: publish to one subscriber on another host (the baseline of the remote rows);
- per ``--hosts K``: publish to ``--subscribers N`` subscribers spread round-robin over K
  namespace hosts (:class:`mq.tools.netns.Hosts`: own network, PID and IPC namespaces per host,
  one bridge), with relaying in each shape (``relay chain``, ``relay tree``, ``relay star``)
  and without relaying (``direct``: one transfer per subscriber, what publish did before);
- ``same host 1`` and ``same host N``: subscribers on the publisher's host (shm, one copy);
- ``raw tcp``: the same bytes over plain TCP sockets from this process to one receiver process
  on 1 host, and to one on each of K hosts at once (a thread per socket, every receiver reading
  into one warm buffer): what this machine's kernel and cores allow for one copy per host, the
  physical reference of the remote rows (on a 2-core VM every "host" shares the same cores).

The publisher is this process, on this host (a veth joins it to the bridge); every subscriber
is its own process, connected to the publisher and to every other subscriber (relays forward
to their neighbours and, in a chain or tree, to other hosts' relays). One sample is ``publish`` until
every subscriber's tiny ack arrived. Subscribers of a row stay up for the whole run.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mq.platforms.plan import free_port
from mq.launch.supervise import die_with_parent as _die_with_parent

__all__ = ["FanoutRow", "run", "table"]

_WORKER = [sys.executable, "-m", "mq.tools.bench.fanout"]


@dataclass
class FanoutRow:
    name: str
    hosts: int  # 0: the publisher's host
    subscribers: int
    shape: str | None  # chain / tree / star / None (relaying off)
    raw: bool = False  # plain TCP sockets, not mq
    samples_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def p50_ms(self) -> float | None:
        return statistics.median(self.samples_ms) if self.samples_ms else None


class _Group:
    """A publisher plus subscribers 1..n (their processes), for one (hosts, n)."""

    def __init__(self, hosts: Any, k: int, n: int, port: int):
        import mq

        self.procs: list[subprocess.Popen] = []
        addr = hosts.root_addr if k else "127.0.0.1"
        self.q = mq.create("nng", 0, "bench", listen_to=f"tcp://{addr}:{port}", timeout=60)
        self.q.listen()
        self.acks = 0
        self._acked = threading.Condition()  # the ack handler (mq's handler thread) -> sample()
        self.q.subscribe("ack", self._ack)
        addrs = [f"tcp://{addr}:{port}"]
        for i in range(1, n + 1):
            h = (i - 1) % k if k else None
            # (here a port of its own: port + i may be a connection's ephemeral port by now, CI)
            listen = f"tcp://{hosts.addrs[h]}:{port + i}" if h is not None else f"tcp://127.0.0.1:{free_port()}"
            argv = _WORKER + [str(i), listen, str(n), *addrs]
            cmd = hosts.command(h, argv) if h is not None else argv
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                               stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
            addrs.append(listen)
        for i, p in enumerate(self.procs, 1):
            line = p.stdout.readline().strip() if p.stdout else ""
            if line != "ready":
                raise RuntimeError(f"subscriber {i} did not start ({line!r})")
        self.q.wait_for_subscribers("bench", n, timeout=60)
        self.n = n

    def _ack(self, m: Any) -> None:
        with self._acked:
            self.acks += 1
            self._acked.notify_all()

    def sample(self, x: np.ndarray, shape: str | None, timeout: float = 120.0) -> float:
        if shape is None:
            self.q.set_relay(None)  # direct sends only
        else:
            self.q.set_relay(1 << 20, shape)
        with self._acked:
            self.acks = 0
        t0 = time.perf_counter()
        reached = self.q.publish("bench", x, timeout=timeout)
        if len(reached) != self.n:
            raise RuntimeError(f"publish reached {len(reached)} of {self.n} subscribers")
        with self._acked:
            if not self._acked.wait_for(lambda: self.acks >= self.n, timeout):
                raise TimeoutError(f"{self.acks} of {self.n} acks within {timeout:g}s")
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.q.stop(timeout=2)
        _kill(self.procs)


class _RawGroup:
    """Plain TCP: one receiver process on each of hosts 0..k-1, sent to at once (the bound)."""

    def __init__(self, hosts: Any, k: int, size: int, port: int):
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        try:
            for h in range(k):
                argv = _WORKER + ["raw", hosts.addrs[h], str(port), str(size)]
                self.procs.append(subprocess.Popen(hosts.command(h, argv), stdout=subprocess.PIPE, text=True,
                                                   stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
            for h, p in enumerate(self.procs):
                line = p.stdout.readline().strip() if p.stdout else ""
                if line != "ready":
                    raise RuntimeError(f"raw receiver on host {h} did not start ({line!r})")
                sock = socket.create_connection((hosts.addrs[h], port), timeout=60)
                self.socks.append(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait on the tail
        except BaseException:
            self.close()
            raise

    def sample(self, x: np.ndarray, shape: str | None, timeout: float = 120.0) -> float:
        del shape
        errors: list[BaseException] = []

        def send(sock: socket.socket) -> None:
            try:
                sock.sendall(memoryview(x).cast("B"))  # type: ignore[arg-type]  # an ndarray is a buffer
                if sock.recv(1) != b"k":
                    raise RuntimeError("raw receiver closed")
            except BaseException as exc:  # reported below, in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(s,)) for s in self.socks]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"a raw receiver did not answer within {timeout:g}s")
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        for s in self.socks:
            s.close()
        _kill(self.procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
            p.wait(5)


def run(size: int, host_counts: list[int], subscribers: int = 8, samples: int = 5, rounds: int = 2,
        same_host: bool = True, shapes: tuple[str | None, ...] = ("chain", "tree", "star", None),
        progress: Callable[[str], None] = lambda s: None,
        link_rate: str | None = None) -> tuple[list[FanoutRow], dict[str, Any]]:
    """Measure the rows of the module docstring; returns (rows, info). Needs root.
    ``link_rate``: every host's uplink capped at this tc rate (:class:`mq.tools.netns.Hosts`)."""
    from mq.tools.netns import Hosts

    kmax = max(host_counts)
    x = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    rows: list[tuple[FanoutRow, str]] = []  # (row, group key)
    plan: dict[str, tuple[int, int]] = {"remote1": (1, 1)}
    rows.append((FanoutRow("1 subscriber, other host", 1, 1, None), "remote1"))
    for k in host_counts:
        plan[f"h{k}"] = (k, subscribers)
        for shape in shapes:
            label = f"relay {shape}" if shape else "direct (no relay)"
            rows.append((FanoutRow(f"{subscribers} subscribers on {k} hosts, {label}", k, subscribers, shape),
                         f"h{k}"))
    plan["raw1"], plan[f"raw{kmax}"] = (1, 1), (kmax, kmax)
    rows.append((FanoutRow("raw tcp, 1 other host", 1, 1, None, raw=True), "raw1"))
    rows.append((FanoutRow(f"raw tcp, {kmax} hosts at once (bound)", kmax, kmax, None, raw=True), f"raw{kmax}"))
    if same_host:
        plan["same1"], plan["same"] = (0, 1), (0, subscribers)
        rows.append((FanoutRow("1 subscriber, same host", 0, 1, None), "same1"))
        rows.append((FanoutRow(f"{subscribers} subscribers, same host", 0, subscribers, None), "same"))
    info: dict[str, Any] = {"size": size, "cpus": os.cpu_count(), "loadavg": open("/proc/loadavg").read().split()[:3],
                            "link_rate": link_rate}
    groups: dict[str, _Group | _RawGroup] = {}
    with Hosts(kmax, root=True, rate=link_rate) as hosts:
        try:
            for n, (key, (k, subs)) in enumerate(plan.items()):
                progress(f"starting {key}: {subs} subscriber(s) on {k or 'the same'} host(s)")
                port = 47000 + 20 * n
                groups[key] = _RawGroup(hosts, k, size, port) if key.startswith("raw") else _Group(hosts, k, subs, port)
            for row, key in rows:  # warm-up: pools and sockets see the size once
                with contextlib.suppress(Exception):
                    groups[key].sample(x, row.shape)
            for r in range(rounds):
                order = rows if r % 2 == 0 else rows[::-1]
                for row, key in order:
                    if row.error:
                        continue
                    for _ in range(samples):
                        try:
                            row.samples_ms.append(groups[key].sample(x, row.shape))
                        except Exception as exc:
                            row.error = f"{type(exc).__name__}: {exc}"
                            break
                    progress(f"round {r + 1}: {row.name}: p50 {row.p50_ms}")
            info["relay_stats"] = {key: g.q.stats().relay for key, g in groups.items()
                                   if isinstance(g, _Group)}
        finally:
            for g in groups.values():
                g.close()
    return [row for row, _ in rows], info


def table(rows: list[FanoutRow], info: dict[str, Any]) -> str:
    base = {(r.hosts > 0, r.raw): r.p50_ms for r in rows if r.subscribers == 1}
    rate = f", every host's uplink capped at {info['link_rate']}" if info.get("link_rate") else ""
    lines = [f"fan-out of {info['size'] / 1e6:g} MB ({info['cpus']} CPUs, load {' '.join(info['loadavg'])}{rate}); "
             "ratio: p50 / p50 of the same size to one subscriber (remote rows: on another host; "
             "raw rows: raw tcp to 1 host)",
             f"{'row':58} {'n':>3} {'min ms':>9} {'p50 ms':>9} {'max ms':>9} {'ratio':>6}"]
    for r in rows:
        if not r.samples_ms:
            lines.append(f"{r.name:58} {'':>3} {'':>9} {'':>9} {'':>9} {'':>6}  {r.error or 'no samples'}")
            continue
        b = base.get((r.hosts > 0, r.raw))
        ratio = f"{r.p50_ms / b:.2f}" if b else "-"  # type: ignore[operator]  # samples: a p50
        lines.append(f"{r.name:58} {len(r.samples_ms):>3} {min(r.samples_ms):>9.1f} {r.p50_ms:>9.1f} "
                     f"{max(r.samples_ms):>9.1f} {ratio:>6}" + (f"  ({r.error})" if r.error else ""))
    return "\n".join(lines)


def _raw_receiver() -> None:
    """``python -m mq.tools.bench.fanout raw HOST PORT SIZE``: read SIZE bytes per message into
    one warm buffer, answer each with one byte."""
    _die_with_parent()
    host, port, size = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    srv = socket.create_server((host, port))
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = np.ones(size, np.uint8)  # warm: the bound pays no page faults
    view = memoryview(buf)  # type: ignore[arg-type]  # an ndarray is a buffer
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], size - got)
            if not n:
                return
            got += n
        conn.sendall(b"k")


def _subscriber() -> None:
    """A bench subscriber: ``python -m mq.tools.bench.fanout ID LISTEN N ATTACH...``; acks each
    message to node 0 once it is in its handler."""
    import mq

    _die_with_parent()  # the orchestrator (or the nsenter under it) went: go too
    node_id, listen, n, attach = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    q = mq.create("nng", node_id, "bench", listen_to=listen, attach_to=attach, timeout=60)

    def ack(m: Any) -> None:
        del m
        q.send(0, "ack", 0, timeout=60)

    with q:
        q.subscribe("bench", ack)
        q.wait_for_peers(n, timeout=60)  # everyone: the publisher and n - 1 subscribers
        print("ready", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    _raw_receiver() if sys.argv[1:2] == ["raw"] else _subscriber()
