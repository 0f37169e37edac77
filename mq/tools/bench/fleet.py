"""A fleet on one machine: N nodes in P processes, a full mesh met through a rendezvous, then
left idle (issue 49). What it measures, per run:

- ``join_s``: from the first process's start until every node saw all N-1 others;
- ``idle_cpu``: the CPU the whole job burns while nobody sends, in cores (the sum over its
  processes of user + system time, read from ``/proc``, over ``--idle`` seconds, ``--settle``
  seconds after the join);
- ``rss_mb_per_node``: the job's resident memory once idle, divided by N (a process's
  interpreter and libraries included: compare two sizes for what a peer costs);
- ``publish_small_s`` / ``publish_large_s``: node 0 publishes 1.25 KB / 10 MB to all N-1 others
  (every node subscribes): from the publish until the last subscriber's ``recv()`` returned,
  one list entry per round (``--rounds``), after the idle measurement;
- ``gather_s``: all N-1 others send node 0 1.25 KB at the same moment: from that moment until
  node 0 had them all, per round;
- ``stop_s``: the slowest node's ``stop()`` (``stop_unreported``: processes that did not say
  within 60 s).

Times across processes are read from the machine's monotonic clock, which they share.

::

    python -m mq.tools.bench.fleet --nodes 64 --procs 8 [--idle 10] [--rounds 5] [--json FILE]
    mq bench --mode fleet --nodes 16,64 --procs 8        # the same, as a table

A process holds ``N / P`` nodes (its threads join them side by side, as a process with several
collectors would).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from mq.platforms.plan import free_port

SMALL, LARGE = 1250, 10_000_000  # bytes: an RL control message / observation batch, and weights
TOPIC = "fleet"
_ROUND_S = 120.0  # each node's waits in a traffic round


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

    for q in nodes:
        q.subscribe(TOPIC)  # (before the join: the handshake carries it)
    _each(nodes, join)
    print(json.dumps({"joined_s": round(time.monotonic() - began, 3), "errors": errors}), flush=True)
    for line in sys.stdin:  # the harness's commands, one round each, until "stop"
        cmd, *args = line.split()
        if cmd == "publish":
            print(json.dumps(_publish_round(nodes, int(args[0]))), flush=True)
        elif cmd == "gather":
            print(json.dumps(_gather_round(nodes, int(args[0]), float(args[1]), world)), flush=True)
        else:
            break
    stops = []
    for q in nodes:
        t0 = time.monotonic()
        q.stop()
        stops.append(time.monotonic() - t0)
    print(json.dumps({"stop_s": round(max(stops), 3)}), flush=True)


def _each(nodes: list[Any], fn: Any) -> None:
    """``fn(q)`` for every node at once, one thread each (as a process's collectors would)."""
    threads = [threading.Thread(target=fn, args=(q,)) for q in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _publish_round(nodes: list[Any], size: int) -> dict[str, Any]:
    """Node 0 (if here) publishes ``size`` bytes; every other node here receives it."""
    got: list[float] = []
    errors: list[str] = []
    payload = bytes(size)
    sent_at: list[float] = []

    def act(q: Any) -> None:
        try:
            if q.node_id == 0:
                sent_at.append(time.monotonic())
                q.publish(TOPIC, payload, timeout=_ROUND_S)
            else:
                q.recv(timeout=_ROUND_S)
                got.append(time.monotonic())
        except Exception as exc:  # any: reported to the harness
            errors.append(f"node {q.node_id}: {type(exc).__name__}: {exc}")

    _each(nodes, act)
    return {"sent_at": sent_at[0] if sent_at else None, "last": max(got, default=None), "errors": errors}


def _gather_round(nodes: list[Any], size: int, go_at: float, world: int) -> dict[str, Any]:
    """At ``go_at`` every node here but node 0 sends it ``size`` bytes; node 0 (if here) takes
    one from each other node of the job."""
    errors: list[str] = []
    last: list[float] = []
    payload = bytes(size)

    def act(q: Any) -> None:
        try:
            if q.node_id == 0:
                for _ in range(world - 1):
                    q.recv(timeout=_ROUND_S)
                last.append(time.monotonic())
            else:
                time.sleep(max(0.0, go_at - time.monotonic()))
                q.send(0, TOPIC, payload, timeout=_ROUND_S)
        except Exception as exc:  # any: reported to the harness
            errors.append(f"node {q.node_id}: {type(exc).__name__}: {exc}")

    _each(nodes, act)
    return {"last": last[0] if last else None, "errors": errors}


def _cpu_seconds(pids: list[int]) -> float:
    """User + system seconds of every thread of these processes so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def _rss_mb(pid: int) -> float:
    """The resident memory of a process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run(nodes: int, procs: int, idle: float, timeout: float, settle: float = 15.0,
        rounds: int = 5) -> dict[str, Any]:
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
        out["rss_mb_per_node"] = round(sum(map(_rss_mb, pids)) / nodes, 1)
        if rounds > 0 and not out["errors"]:  # (a job that did not form would only time out)
            out.update(_traffic(children, rounds, out["errors"]))
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


def _traffic(children: list[subprocess.Popen], rounds: int, errors: list[str]) -> dict[str, list[float]]:
    """The publish and gather rounds (seconds each; a round with an error is left out and the
    error added to ``errors``)."""
    out: dict[str, list[float]] = {"publish_small_s": [], "publish_large_s": [], "gather_s": []}
    for key, size in (("publish_small_s", SMALL), ("publish_large_s", LARGE)):
        for _ in range(rounds):
            replies = _round(children, f"publish {size}", errors)
            sent = [r["sent_at"] for r in replies if r.get("sent_at") is not None]
            lasts = [r["last"] for r in replies if r.get("last") is not None]
            if sent and lasts and len(replies) == len(children):
                out[key].append(round(max(lasts) - sent[0], 5))
    for _ in range(rounds):
        go_at = time.monotonic() + 0.5  # every process has its command by then
        replies = _round(children, f"gather {SMALL} {go_at}", errors)
        last = [r["last"] for r in replies if r.get("last") is not None]
        if last and len(replies) == len(children):
            out["gather_s"].append(round(last[0] - go_at, 5))
    return out


def _round(children: list[subprocess.Popen], command: str, errors: list[str]) -> list[dict[str, Any]]:
    """Send every process ``command`` (node 0's last: the others are listening by then), and
    read each one's answer; the errors they report go to ``errors``."""
    for c in [*children[1:], children[0]]:
        assert c.stdin is not None  # PIPE
        c.stdin.write(command + "\n")
        c.stdin.flush()
    until = time.monotonic() + _ROUND_S + 30
    replies = [_line(c, max(0.0, until - time.monotonic())) for c in children]
    found = [e for r in replies for e in r.get("errors", [])]
    errors.extend(found + [f"{command}: a process said nothing"] * sum(not r for r in replies))
    return [r for r in replies if r]


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a text table (idle CPU in per cent of one core; traffic in medians, ms)."""
    lines = [f"{'nodes':>6} {'procs':>6} {'join s':>8} {'idle % of a core':>17} {'publish 1.25KB ms':>18} "
             f"{'publish 10MB ms':>16} {'gather ms':>10} {'slowest stop s':>15}  errors"]
    for r in rows:
        lines.append(f"{r['nodes']:>6} {r['procs']:>6} {r.get('join_s', float('nan')):>8.2f} "
                     f"{100 * r.get('idle_cpu', float('nan')):>17.1f} {_median_ms(r, 'publish_small_s'):>18.1f} "
                     f"{_median_ms(r, 'publish_large_s'):>16.1f} {_median_ms(r, 'gather_s'):>10.1f} "
                     f"{r.get('stop_s') or float('nan'):>15.2f}  {len(r['errors']) or '-'}")
    return "\n".join(lines)


def _median_ms(row: dict[str, Any], key: str) -> float:
    values = row.get(key) or []
    return 1000 * statistics.median(values) if values else float("nan")


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
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each publish and gather")
    ap.add_argument("--json", help="append the result here (one JSON line)")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 0:
        ap.error(f"--rounds must be 0 or more (0: no traffic rounds), got {args.rounds}")
    if args.worker:
        first, count, world, port, timeout = args.worker
        _worker(int(first), int(count), int(world), int(port), float(timeout))
        return 0
    result = run(args.nodes, args.procs, args.idle, args.timeout, args.settle, args.rounds)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
