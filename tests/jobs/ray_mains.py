"""Mains for ``mq run --platform ray`` tests (tests/test_ray.py); ``ctx.args["argv"][0]`` is a
directory each node writes to."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import ray


def report(ctx) -> None:
    """Every node: greet every peer, then write what it saw (labels, routes, Ray node)."""
    q = ctx.mq
    q.on("hi", lambda _: ctx.node_id)
    q.wait_for_peers(ctx.world_size - 1, timeout=60)
    answers = sorted(q.call(p, "hi", timeout=60) for p in q.peers())
    if ctx.node_id == 0:
        for p in q.peers():
            q.send(p, "weights", np.full(1 << 18, 1.5, np.float32))  # 1 MiB
    else:
        got = q.recv(timeout=60)
        assert got.topic == "weights" and float(np.asarray(got.payload).sum()) == 1.5 * (1 << 18)
    out = {"node": ctx.node_id, "labels": sorted(ctx.labels), "answers": answers,
           "routes": {str(p): r.kind for p, r in q.routes().items()},
           "ray_node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
           "ip": ray.util.get_node_ip_address()}
    _write(ctx, out)
    q.wait_for_peers(0, timeout=1)
    time.sleep(1)  # every node has had its weights before any says goodbye


def fails(ctx) -> None:
    """Node 1 raises; the others wait for the job to end them."""
    if ctx.node_id == 1:
        raise RuntimeError("collector 1 broke on purpose")
    _park(ctx)


def dies(ctx) -> None:
    """Node 2's process is SIGKILLed (its actor dies); the others wait."""
    if ctx.node_id == 2:
        _write(ctx, {"node": 2, "pid": os.getpid()})
        os.kill(os.getpid(), signal.SIGKILL)
    _park(ctx)


def parks(ctx) -> None:
    """Every node says where it runs, then waits to be stopped (Ctrl-C, SIGTERM, --timeout)."""
    _park(ctx)


def _park(ctx) -> None:
    _write(ctx, {"node": ctx.node_id, "pid": os.getpid()})
    time.sleep(600)


def _write(ctx, out: dict) -> None:
    path = os.path.join(ctx.args["argv"][0], f"node{ctx.node_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
