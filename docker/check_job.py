"""The job scripts/docker runs in two containers: a learner (node 0) and a collector (node 1).

Copied into each mq:cpu container (docker cp into /opt/mq; the image does not ship it) and
started with one `mq run` per container:

    mq run --package /opt/mq --main check_job:main --world-size 2 --roles 'learner:1,collector:*' \
        --node-ids 0 --address mq-check-learner --ports 50515
    mq run ... --node-ids 1 --address mq-check-collector --ports 50516 \
        --attach-to tcp://mq-check-learner:50515

The learner publishes a 4 MiB float32 tensor (large enough that the shm route carries it
through the shared-memory pool rather than the socket); the collector hashes what
arrived and sends the digest back; the learner compares. Each side prints one line
``mq-check: node N ROLE: route to node P = KIND (...)`` once the tensor has crossed (by then
the peer has said whether it could open this node's pool: the route is settled), and the
learner a final
``mq-check: OK`` or raises, so the container's exit code says whether the data arrived intact.
"""

from __future__ import annotations

import hashlib
import time

import torch

import mq

NBYTES = 4 << 20
TIMEOUT = 60.0


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _say(ctx: mq.Context, role: str, text: str) -> None:
    print(f"mq-check: node {ctx.node_id} {role}: {text}", flush=True)


def main(ctx: mq.Context) -> None:
    role = "learner" if "learner" in ctx.labels else "collector"
    try:
        _check(ctx, role)
    except Exception:
        # What this node saw, for the log: peers, routes, who subscribes, losses and refusals.
        m = ctx.mq.metrics()
        _say(ctx, role, f"FAILED; peers {ctx.mq.peers()}, routes {m['routes']}, lost {m['peers_lost']}, "
             f"drops {m['drops']}, rejected {m['rejected']}")
        raise


def _check(ctx: mq.Context, role: str) -> None:
    q = ctx.mq
    peer = q.wait_for_peers(1, timeout=TIMEOUT)[0]
    if role == "learner":
        q.subscribe("digest")
        q.wait_for_subscribers("weights", 1, timeout=TIMEOUT)
        weights = torch.arange(NBYTES // 4, dtype=torch.float32) * 0.5
        q.publish("weights", {"w": weights}, timeout=TIMEOUT)
        q.flush(peer, timeout=TIMEOUT)  # the collector took it: the route is settled
        route = q.routes()[peer]
        _say(ctx, role, f"route to node {peer} = {route.kind} ({route.reason})")
        reply = q.recv(timeout=TIMEOUT).payload
        sent = {"nbytes": weights.nbytes, "sha256": _digest(weights)}
        if reply != sent:
            raise RuntimeError(f"node {peer} received {reply}, sent {sent}")
        _say(ctx, role, f"node {peer} received {reply['nbytes']} bytes intact (sha256 {reply['sha256'][:16]})")
        print("mq-check: OK", flush=True)
        # Leave last: the collector's flush of its digest must not race our goodbye.
        deadline = time.monotonic() + TIMEOUT
        while peer in q.peers() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        q.subscribe("weights")
        w = q.recv(timeout=TIMEOUT).payload["w"]
        got = {"nbytes": w.nbytes, "sha256": _digest(w)}
        route = q.routes()[peer]
        _say(ctx, role, f"route to node {peer} = {route.kind} ({route.reason})")
        _say(ctx, role, f"got a {w.nbytes}-byte {w.dtype} tensor from node {peer}")
        q.wait_for_subscribers("digest", 1, timeout=TIMEOUT)
        q.send(peer, "digest", got, timeout=TIMEOUT)
        q.flush(peer, timeout=TIMEOUT)  # the learner waits for us to leave first
