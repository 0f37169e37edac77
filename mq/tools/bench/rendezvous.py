"""The rendezvous store alone, at job sizes a fleet on one machine cannot reach (issue 49).

Node 0's :class:`mq.store.StoreServer` runs in a process of its own; this process plays N nodes
with one socket each, driven by one selector loop (no mq nodes, no threads). Each does what a
node's rendezvous does (:class:`mq.store.StoreClient`): it sends its entry (200 bytes, the size of
an nng node's signed addresses) and at once a wait for every node's entry, then asks for the next
:data:`mq.store.WAIT_PAGE` keys each time a page is answered. Answers are counted, not decoded.

Per job size:

- ``rendezvous_s``: from the first entry sent until the last node had every entry;
- ``store_cpu_s``: the store process's user + system CPU over that time (``/proc``);
- ``answer_bytes``: what the store sent (about N * N * 205 bytes: every node reads every entry).

::

    python -m mq.tools.bench.rendezvous --nodes 1000,5000,10000 [--json FILE]

Every socket lives on this host's loopback: the store's CPU is the number that carries over to a
cluster; the bytes divided by node 0's link speed add the network's share.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
from typing import Any

import msgpack

from mq.platforms.plan import free_port
from mq.store import WAIT_PAGE

ENTRY_BYTES = 200
_LENGTH_BYTES = 4
_CONNECT_S = 60.0
_TICKS = os.sysconf("SC_CLK_TCK")
_SET_OK, _WAIT_OK = b"\x91\xa2ok", b"\x92\xa2ok"  # msgpack of ["ok"] and the start of ["ok", [...]]


def _frame(message: Any) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return len(body).to_bytes(_LENGTH_BYTES, "big") + body


class _Node:
    """One played node: its socket, what it still expects, and the answers' bytes so far."""

    def __init__(self, sock: socket.socket, node_id: int, keys: list[str]):
        self.sock = sock
        self.node_id = node_id
        self.pages = [keys[i:i + WAIT_PAGE] for i in range(0, len(keys), WAIT_PAGE)]
        self.answers_left = 1 + len(self.pages)  # the set's "ok", then a page each
        self.buf = bytearray()
        self.bytes_in = 0

    def first_requests(self, timeout: float) -> bytes:
        """Its entry and its first wait, in one write (a node waits as soon as it has set)."""
        return _frame(["set", f"mq/{self.node_id}", os.urandom(ENTRY_BYTES)]) + self._wait(0, timeout)

    def _wait(self, page: int, timeout: float) -> bytes:
        return _frame(["wait", self.pages[page], timeout])

    def take(self, chunk: bytes, timeout: float) -> None:
        """Count the whole answers in ``chunk``; ask for the next page after each page."""
        self.buf += chunk
        self.bytes_in += len(chunk)
        while len(self.buf) >= _LENGTH_BYTES:
            n = int.from_bytes(self.buf[:_LENGTH_BYTES], "big")
            if len(self.buf) < _LENGTH_BYTES + n:
                return
            head = bytes(self.buf[_LENGTH_BYTES:_LENGTH_BYTES + 4])
            want = _SET_OK if self.answers_left == 1 + len(self.pages) else _WAIT_OK
            if head != want:
                raise RuntimeError(f"node {self.node_id}: the store answered {head!r}..., not {want!r}...")
            del self.buf[:_LENGTH_BYTES + n]
            self.answers_left -= 1
            page = len(self.pages) - self.answers_left  # the next one to ask for
            if 0 < self.answers_left < len(self.pages):
                self.sock.sendall(self._wait(page, timeout))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _connect_all(port: int, n: int) -> list[socket.socket]:
    socks: list[socket.socket] = []
    deadline = time.monotonic() + _CONNECT_S
    while len(socks) < n:
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the store's accept queue is full: it drains it
    return socks


def measure(n: int, timeout: float = 600.0) -> dict[str, Any]:
    """One rendezvous of ``n`` played nodes against a store in a child process."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import sys, time; from mq.store import StoreServer; "
                               f"s = StoreServer({port}, {n}); print('up', flush=True); sys.stdin.read(); s.close()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        socks = _connect_all(port, n)
        keys = [f"mq/{i}" for i in range(n)]
        nodes = [_Node(s, i, keys) for i, s in enumerate(socks)]
        sel = selectors.DefaultSelector()
        for node in nodes:
            node.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sel.register(node.sock, selectors.EVENT_READ, node)
        cpu0, began = _cpu_s(server.pid), time.monotonic()
        for node in nodes:
            node.sock.sendall(node.first_requests(timeout))
        left = n
        while left:
            if time.monotonic() - began > timeout:
                raise TimeoutError(f"{left} of {n} nodes had not every entry after {timeout:g} s")
            for key, _ in sel.select(1.0):
                node = key.data
                chunk = node.sock.recv(1 << 20)
                if not chunk:
                    raise RuntimeError(f"the store closed node {node.node_id}'s connection")
                node.take(chunk, timeout)
                if node.answers_left == 0:
                    sel.unregister(node.sock)
                    left -= 1
        took = time.monotonic() - began
        row = {"nodes": n, "rendezvous_s": round(took, 3), "store_cpu_s": round(_cpu_s(server.pid) - cpu0, 2),
               "answer_bytes": sum(node.bytes_in for node in nodes), "wait_page": WAIT_PAGE}
        for node in nodes:
            node.sock.close()
        return row
    finally:
        if server.stdin:
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mq.tools.bench.rendezvous", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1000,5000,10000", help="job sizes, comma-separated")
    p.add_argument("--json", metavar="FILE", help="append one JSON line per size")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes takes whole numbers separated by commas, got {args.nodes!r}")
    if any(s < 1 for s in sizes):
        p.error("--nodes: every size must be at least 1")
    need = max(sizes) + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        p.error(f"{max(sizes)} nodes need {need} open files in this process and in the store's; "
                f"the limit is {hard} (raise it: ulimit -n)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))  # the store's process inherits it
    for n in sizes:
        row = measure(n)
        print(f"{n:>6} nodes: rendezvous {row['rendezvous_s']:.2f} s, store CPU {row['store_cpu_s']:.2f} s, "
              f"answers {row['answer_bytes'] / 1e9:.2f} GB", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
