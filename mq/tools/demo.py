"""The demo job of the README: one learner and collectors trade the traffic of an RL job.

    mq run --main mq.tools.demo:main -n 3 --labels learner --labels collector --labels collector

The learner publishes a 10 MB weight tensor; each collector answers with a dict of transition
arrays and calls the learner for its stats; every node prints the route it took to each peer.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import mq

WEIGHTS_BYTES = 10 * 1000 * 1000


def main(ctx: mq.Context) -> None:
    q = ctx.mq
    role = "learner" if "learner" in ctx.labels else "collector"
    others = len(ctx.node_ids) - 1
    q.wait_for_peers(others, timeout=30)
    routes = ", ".join(f"node {p} ({'/'.join(sorted(q.labels_of(p) or ())) or '-'}): {r.kind}"
                       for p, r in sorted(q.routes().items()))
    print(f"{role}: routes: {routes}", flush=True)
    if role == "learner":
        _learner(ctx, q)
    else:
        _collector(ctx, q)


def _learner(ctx: mq.Context, q: mq.MQ) -> None:
    collectors = q.peers(label="collector")
    received: dict[int, int] = {}
    q.on("stats", lambda _: {"transitions_processed": sum(received.values()), "weights_version": 1})
    q.subscribe("transitions")
    q.subscribe("done")
    q.wait_for_subscribers("weights", len(collectors), timeout=30)
    weights = torch.randn(WEIGHTS_BYTES // 4)
    t0 = time.perf_counter()
    sent_to = q.publish("weights", {"version": 1, "w": weights})
    print(f"learner: published {weights.nbytes / 1e6:.1f} MB weights to {sent_to} "
          f"in {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    done: set[int] = set()
    while len(done) < len(collectors):
        msg = q.recv(timeout=30)
        if msg.topic == "done":
            done.add(msg.sender)
            continue
        batch = msg.payload
        received[msg.sender] = len(batch["reward"])
        print(f"learner: got {len(batch['reward'])} transitions from node {msg.sender}: "
              + ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in batch.items()), flush=True)
    print(f"learner: done: {sum(received.values())} transitions from "
          f"{len(collectors)} collectors", flush=True)


def _collector(ctx: mq.Context, q: mq.MQ) -> None:
    q.subscribe("weights")
    learner = q.wait_for_peers(label="learner", count=1, timeout=30)[0]
    msg = q.recv(timeout=30)
    w = msg.payload["w"]
    print(f"collector: got weights v{msg.payload['version']} "
          f"({w.nbytes / 1e6:.1f} MB, checksum {float(w.sum()):.3f}) from node {msg.sender}", flush=True)
    n = 256
    batch = {"obs": np.random.randint(0, 255, (n, 4, 84, 84), dtype=np.uint8),
             "action": np.random.randint(0, 6, n), "reward": np.random.rand(n).astype(np.float32),
             "done": np.zeros(n, dtype=bool)}
    q.wait_for_subscribers("transitions", 1, timeout=30)
    q.send(learner, "transitions", batch)
    t0 = time.perf_counter()
    stats = q.call(learner, "stats", None, timeout=10)
    print(f"collector: call stats -> {stats} "
          f"({1e3 * (time.perf_counter() - t0):.2f} ms round trip)", flush=True)
    q.send(learner, "done", ctx.node_id)
