"""A job for tests/test_trust.py: each worker prints where its job secret came from."""

from __future__ import annotations

import mq
from tests.jobs import say


def secret_source(ctx: mq.Context) -> None:
    q = ctx.mq
    q.subscribe("done")
    others = [n for n in ctx.node_ids if n != ctx.node_id]
    q.wait_for_subscribers("done", len(others), timeout=30)
    say(f"node {ctx.node_id} secret from {q.secret.source} peers {q.peers()}")
    for peer in others:  # a barrier: nobody leaves before everyone has seen everyone
        q.send(peer, "done", ctx.node_id)
    assert sorted(q.recv(timeout=30).payload for _ in others) == others
