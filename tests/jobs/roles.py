"""Worker mains used by the launcher and CLI tests (importable by spawned workers)."""

from __future__ import annotations

import sys
import time

import mq
from tests.jobs import record_pid as _record_pid
from tests.jobs import say


def ok(ctx: mq.Context) -> None:
    from mq.testing import BARRIER, _BarrierBox, barrier

    ctx.mq.subscribe(BARRIER, _BarrierBox.get(ctx.mq).arrive)
    ctx.mq.wait_for_peers(len(ctx.node_ids) - 1, timeout=20)
    say(f"node {ctx.node_id} labels {sorted(ctx.labels)} peers {ctx.mq.peers()} "
        f"routes {sorted({r.kind for r in ctx.mq.routes().values()})}")
    barrier(ctx, "start")  # nobody leaves before everyone has met everyone


def waits(ctx: mq.Context) -> None:
    """Says how this nng node waits: the longest spin of its busy polling (0.0: never)."""
    from mq.testing import BARRIER, _BarrierBox, barrier

    ctx.mq.subscribe(BARRIER, _BarrierBox.get(ctx.mq).arrive)
    ctx.mq.wait_for_peers(len(ctx.node_ids) - 1, timeout=20)
    say(f"node {ctx.node_id} spins up to {ctx.mq.transport.busy_poll.window}")
    barrier(ctx, "start")  # nobody leaves before everyone has met everyone


def crash_one(ctx: mq.Context) -> None:
    """Node 1 raises; the others would run for a minute if nobody stopped them."""
    _record_pid(ctx)
    if ctx.node_id == 1:
        time.sleep(0.5)
        raise RuntimeError("collector exploded on purpose")
    time.sleep(60)


def sleep_forever(ctx: mq.Context) -> None:
    _record_pid(ctx)
    time.sleep(600)




def chatty(ctx: mq.Context) -> None:
    """Prints lines in pieces (a partial line, then its end) and to stderr, as a worker's
    progress output does: mq run must keep each line whole and say whose it is."""
    for i in range(20):
        print(f"piece {i} of node {ctx.node_id}", end="")
        time.sleep(0.002)
        print(" end")
    print(f"stderr of node {ctx.node_id}", file=sys.stderr)
