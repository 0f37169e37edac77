"""A fleet on one machine: N nodes in P processes, a full mesh met through a rendezvous, then
left idle (issue 49). What it measures, per run:

- ``join_s``: from the first process's start until every node saw all N-1 others;
- ``idle_cpu``: the CPU the whole job burns while nobody sends, in cores (the sum over its
  processes of user + system time, read from ``/proc``, over ``--idle`` seconds, ``--settle``
  seconds after the join);
- ``stop_s``: the slowest node's ``stop()`` (``stop_unreported``: processes that did not say
  within 60 s).

::

    python -m mq.tools.bench.fleet --nodes 64 --procs 8 [--idle 10] [--json FILE]
    mq bench --mode fleet --nodes 16,64 --procs 8        # the same, as a table

A process holds ``N / P`` nodes (its threads join them side by side, as a process with several
collectors would).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from mq.platforms.plan import free_port


def _worker(first: int, count: int, world: int, port: int, timeout: float) -> None:
    """A child process: nodes ``first .. first+count-1`` join, idle until told, then stop.
    ``kill -USR1`` prints where each of its threads is (a join or stop that hangs)."""
    import faulthandler
    import signal

    import mq

    faulthandler.register(signal.SIGUSR1, all_threads=True)

    began = time.monotonic()
    nodes = [mq.create("nng", i, init_method=f"tcp://127.0.0.1:{port}", world_size=world,
                       listen_to="tcp://127.0.0.1:0", timeout=timeout) for i in range(first, first + count)]
    errors: list[str] = []

    def join(q: Any) -> None:
        try:
            q.listen()
            q.wait_for_peers(world - 1, timeout=timeout)
        except Exception as exc:  # any: reported to the harness
            errors.append(f"node {q.node_id}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=join, args=(q,)) for q in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"joined_s": round(time.monotonic() - began, 3), "errors": errors}), flush=True)
    sys.stdin.readline()  # the harness measured the idle job: leave
    stops = []
    for q in nodes:
        t0 = time.monotonic()
        q.stop()
        stops.append(time.monotonic() - t0)
    print(json.dumps({"stop_s": round(max(stops), 3)}), flush=True)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system seconds of every thread of these processes so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def run(nodes: int, procs: int, idle: float, timeout: float, settle: float = 15.0) -> dict[str, Any]:
    if nodes % procs:
        raise SystemExit(f"--nodes {nodes} must be a multiple of --procs {procs}")
    each, port = nodes // procs, free_port()
    began = time.monotonic()
    children = [subprocess.Popen([sys.executable, "-m", "mq.tools.bench.fleet", "--worker",
                                  str(p * each), str(each), str(nodes), str(port), str(timeout)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for p in range(procs)]
    out: dict[str, Any] = {"nodes": nodes, "procs": procs, "errors": []}
    try:
        # One deadline for all: a process that never reports costs its wait once, not once each.
        until = began + 2 * timeout + 30
        joined = [_line(c, max(0.0, until - time.monotonic())) for c in children]
        out["join_s"] = round(time.monotonic() - began, 2)
        out["errors"] = [e for j in joined for e in j.get("errors", ["a process said nothing"])]
        for error in out["errors"][:3]:  # (the whole list is in the result)
            print(f"fleet: {error}", file=sys.stderr, flush=True)
        pids = [c.pid for c in children]
        time.sleep(settle)  # the joins' own traffic settles (and pairs go idle: mq.node.liveness)
        cpu0, t0 = _cpu_seconds(pids), time.monotonic()
        time.sleep(idle)
        out["idle_cpu"] = round((_cpu_seconds(pids) - cpu0) / (time.monotonic() - t0), 4)
        for c in children:
            assert c.stdin is not None  # PIPE
            c.stdin.write("stop\n")
            c.stdin.flush()
        until = time.monotonic() + 60
        stops = [_line(c, max(0.0, until - time.monotonic())).get("stop_s") for c in children]
        out["stop_s"] = max(s for s in stops if s is not None) if any(s is not None for s in stops) else None
        out["stop_unreported"] = sum(s is None for s in stops)  # processes whose stop() took > 60 s
    finally:
        until = time.monotonic() + 30  # for all of them: a process that hangs is killed
        for c in children:
            try:
                c.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a text table (idle CPU in per cent of one core)."""
    lines = [f"{'nodes':>6} {'procs':>6} {'join s':>8} {'idle % of a core':>17} {'slowest stop s':>15}  errors"]
    for r in rows:
        lines.append(f"{r['nodes']:>6} {r['procs']:>6} {r.get('join_s', float('nan')):>8.2f} "
                     f"{100 * r.get('idle_cpu', float('nan')):>17.1f} {r.get('stop_s') or float('nan'):>15.2f}  "
                     f"{len(r['errors']) or '-'}")
    return "\n".join(lines)


def _line(child: subprocess.Popen, timeout: float) -> dict[str, Any]:
    assert child.stdout is not None  # PIPE
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    line = child.stdout.readline().strip() if ready else ""
    return json.loads(line) if line else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the idle job is measured")
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds between the join and the measurement (a pair quiet for 3 peer "
                         "timeouts, 12 s by default, is no longer probed)")
    ap.add_argument("--timeout", type=float, default=120.0, help="each node's join timeout")
    ap.add_argument("--json", help="append the result here (one JSON line)")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        first, count, world, port, timeout = args.worker
        _worker(int(first), int(count), int(world), int(port), float(timeout))
        return 0
    result = run(args.nodes, args.procs, args.idle, args.timeout, args.settle)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
