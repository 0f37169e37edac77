"""Worker mains for jobs that span hosts (tests/test_slurm.py, tests/test_launch.py).

Unlike ``roles.ok`` they wait for the whole job (``ctx.world_size``), not only this host's
workers, and print one JSON line per node that the tests parse.
"""

from __future__ import annotations

import json
import os
import time

import mq
from tests.jobs import record_pid as _record_pid
from tests.jobs import say


def learn(ctx: mq.Context) -> None:
    """The learner serves ``square`` to every collector; each collector checks its answer.

    The learner tells the collectors ``go`` once its handler is registered (a collector may
    join before the learner's main runs) and ``done`` only after serving all of them, so no
    node leaves (and says goodbye) while another still needs it.
    """
    q = ctx.mq
    served: list[int] = []
    if "learner" in ctx.labels:
        q.on("square", lambda x: (served.append(x), x * x)[1])
    q.subscribe("done")
    q.wait_for_peers(ctx.world_size - 1, timeout=60)
    met = _met(ctx)  # before anyone leaves
    learners = q.peers(label="learner")
    result = None
    if "learner" in ctx.labels:
        collectors = q.peers(label="collector")
        for peer in collectors:
            q.send(peer, "go", None, timeout=10)
        deadline = time.monotonic() + 60
        while len(served) < len(collectors) and time.monotonic() < deadline:
            time.sleep(0.02)
        for peer in collectors:
            q.send(peer, "done", "bye", timeout=10)
        result = sorted(served)
    else:
        assert q.recv(timeout=60).topic == "go"
        result = q.call(learners[0], "square", ctx.node_id, timeout=30)
        assert result == ctx.node_id ** 2, result
        assert q.recv(timeout=60).topic == "done"
    _say(ctx, met, result=result, learners=learners)


def crash_last(ctx: mq.Context) -> None:
    """The last node raises once every node has joined and said so; the others would sleep a
    minute. (Joins finish pair by pair: the last node seeing everyone is not everyone seeing
    everyone, so the others report in before it raises.)"""
    q = ctx.mq
    last = ctx.world_size - 1
    _record_pid(ctx)
    if ctx.node_id == last:
        q.subscribe("ready")
    q.wait_for_peers(ctx.world_size - 1, timeout=60)
    _say(ctx, _met(ctx))
    if ctx.node_id == last:
        ready = {q.recv(timeout=60).sender for _ in range(last)}
        assert len(ready) == last, ready
        raise RuntimeError(f"node {ctx.node_id} exploded on purpose")
    q.wait_for_subscribers("ready", 1, timeout=60)
    q.send(last, "ready", ctx.node_id, timeout=30)
    time.sleep(60)


def stuck_handler(ctx: mq.Context) -> None:
    """Node 0 serves a call that never returns, then raises: its process must still exit."""
    q = ctx.mq
    q.on("hang", lambda x: time.sleep(120))
    _record_pid(ctx)
    q.wait_for_peers(ctx.world_size - 1, timeout=60)
    if ctx.node_id == 1:
        try:
            q.call(0, "hang", None, timeout=60)
        except mq.MQError:
            pass
        time.sleep(60)
    else:
        time.sleep(1.0)  # node 1's call is now stuck in our handler thread
        raise RuntimeError("failed while a handler is stuck")


def wait_forever(ctx: mq.Context) -> None:
    """Join the whole job, say so, and sleep until stopped (SIGTERM / scancel tests)."""
    _record_pid(ctx)
    ctx.mq.wait_for_peers(ctx.world_size - 1, timeout=60)
    _say(ctx, _met(ctx))
    time.sleep(600)


def _met(ctx: mq.Context) -> dict[str, object]:
    q = ctx.mq
    return {"peers": q.peers(), "routes": sorted({r.kind for r in q.routes().values()})}


def _say(ctx: mq.Context, met: dict[str, object], **extra: object) -> None:
    line = json.dumps({
        "node": ctx.node_id, "labels": sorted(ctx.labels), "world": ctx.world_size,
        "host": os.environ.get("SLURMD_NODENAME", ""), "pid": os.getpid(), "launcher": os.getppid(), **met, **extra,
    })
    say(line)


