"""Joins under load: many 3-node jobs joined one after another, every core busy (issue 45).

Each run starts three fresh processes that form a job the two ways users write one:

- ``mesh``: node i listens on its own port and attaches to the nodes before it (addresses, as
  in the README);
- ``rendezvous``: every node is given ``init_method="tcp://..."`` and ``world_size=3``.

A run passes when every node sees both others within ``--timeout`` (each node's own
``wait_for_peers``); a failure keeps what the node raised (which names the peer and the stage
the join stopped at: connect, handshake, auth, rendezvous)::

    python -m mq.tools.joins --form mesh,rendezvous --runs 50 --load 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

from mq.platforms.plan import free_port
from mq.tools.load import BackgroundLoad

NODES = 3


def _node(form: str, node_id: int, ports: list[int], timeout: float) -> None:
    """One node of a run (a child process): join, say how long it took, leave."""
    import logging

    import mq

    if os.environ.get("MQ_JOINS_LOG"):  # e.g. DEBUG: each node's log goes with a failed run
        logging.basicConfig(level=os.environ["MQ_JOINS_LOG"], format=f"%(relativeCreated)8.0f n{node_id} %(message)s")
    began = time.monotonic()
    if form == "mesh":
        q = mq.create("nng", node_id, listen_to=f"tcp://127.0.0.1:{ports[node_id]}",
                      attach_to=[f"tcp://127.0.0.1:{p}" for p in ports[:node_id]], timeout=timeout)
    else:
        q = mq.create("nng", node_id, init_method=f"tcp://127.0.0.1:{ports[0]}", world_size=NODES,
                      listen_to="tcp://127.0.0.1:0", timeout=timeout)
    out: dict[str, Any] = {"node": node_id}
    try:
        with q:
            q.wait_for_peers(ids=[i for i in range(NODES) if i != node_id], timeout=timeout)
            out["joined_s"] = round(time.monotonic() - began, 3)
            print(json.dumps(out), flush=True)
            sys.stdin.readline()  # stay until every node of the run joined (the harness says so)
            return
    except Exception as exc:  # any: what a failed join says is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)


def one_run(form: str, timeout: float) -> dict[str, Any]:
    ports = [free_port() for _ in range(NODES)]
    began = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "mq.tools.joins", "--node", form, str(i),
                               ",".join(map(str, ports)), str(timeout)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(NODES)]
    nodes = []
    try:
        for p in procs:  # each says when it joined (or why it did not), then waits for the others
            assert p.stdout is not None  # PIPE
            ready, _, _ = select.select([p.stdout], [], [], timeout * 2 + 30)
            line = p.stdout.readline().strip() if ready else ""
            nodes.append(json.loads(line) if line else {"error": "the node process said nothing (hung, or died)"})
        for p in procs:  # every node joined, or gave up: they may leave now
            assert p.stdin is not None  # PIPE
            with contextlib.suppress(OSError, ValueError):
                p.stdin.write("go\n")
                p.stdin.flush()
        for p, node in zip(procs, nodes):
            try:
                _out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _out, err = p.communicate()
            node["log"] = err or ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    errors = [n["error"] for n in nodes if "error" in n]
    return {"form": form, "ok": not errors, "seconds": round(time.monotonic() - began, 2),
            "joined_s": max((n.get("joined_s", 0.0) for n in nodes), default=0.0), "errors": errors,
            "logs": [n["log"][-20000:] for n in nodes] if errors else []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", default="mesh,rendezvous", help="mesh, rendezvous or both (comma list)")
    ap.add_argument("--runs", type=int, default=50, help="runs per form")
    ap.add_argument("--load", type=int, default=4, help="CPU-bound processes beside the runs")
    ap.add_argument("--timeout", type=float, default=30.0, help="each node's join timeout (mq's default)")
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--node", nargs=4, help=argparse.SUPPRESS)  # a child: form, id, ports, timeout
    args = ap.parse_args(argv)
    if args.node:
        form, node_id, ports, timeout = args.node
        _node(form, int(node_id), [int(p) for p in ports.split(",")], float(timeout))
        return 0
    forms = [f for f in args.form.split(",") if f]
    runs: list[dict[str, Any]] = []
    with BackgroundLoad(args.load):
        for i in range(args.runs):
            for form in forms:
                run = one_run(form, args.timeout)
                runs.append(run)
                print(f"{form:10} run {i + 1:3}: {'ok' if run['ok'] else 'FAILED'} joined in "
                      f"{run['joined_s']:.2f}s" + ("".join(f"\n    {e}" for e in run["errors"])), flush=True)
    summary = {}
    for form in forms:
        mine = [r for r in runs if r["form"] == form]
        joined = sorted(r["joined_s"] for r in mine if r["ok"])
        summary[form] = {"runs": len(mine), "ok": sum(r["ok"] for r in mine),
                         "p50_join_s": joined[len(joined) // 2] if joined else None,
                         "max_join_s": joined[-1] if joined else None}
        print(f"{form}: {summary[form]['ok']}/{len(mine)} joined under load {args.load} "
              f"(join p50 {summary[form]['p50_join_s']}s, max {summary[form]['max_join_s']}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": args.load, "summary": summary, "runs": runs}, f, indent=1)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
