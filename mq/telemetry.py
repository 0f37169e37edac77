"""Reading a running job's metrics from outside: what ``mq top`` uses.

Pull, not push: a node that calls :func:`serve` answers calls on the reserved topic
``_mq.metrics`` with its ``q.metrics()``, so a job nobody watches pays nothing, and the watcher's
refresh interval is the window of the per-second rates. Asked with ``relay=True`` a node also
asks each of its peers, so a watcher attached to one node (the learner of a star job, any node of
a mesh) sees every node::

    mq.telemetry.serve(q)                                   # in every node
    w = mq.create("nng", 1 << 30, attach_to=["tcp://learner:50515"])   # the watcher
    with w:
        snapshots = mq.telemetry.collect(w)                 # {node id: metrics}

Answers are plain JSON-able data (string keys), the same for every mq type.
"""

from __future__ import annotations

import json
from typing import Any

from mq.errors import MQError

TOPIC = "_mq.metrics"
CALL_TIMEOUT_S = 2.0
#: The label of a watcher's node (``mq top``): the nodes it asks leave it out of what they show.
WATCHER = "watcher"


def serve(q: Any) -> None:
    """Answer metrics calls on this node (``mq top`` and :func:`collect`)."""
    q.on(TOPIC, lambda request: _answer(q, request))


def _answer(q: Any, request: Any) -> dict[str, Any]:
    watchers = set(q.peers(WATCHER))  # mq top's own nodes: not part of the job, not in its tables
    mine = _plain(q.metrics())
    if watchers:
        hidden = {str(w) for w in watchers}
        mine = {k: {p: x for p, x in v.items() if p not in hidden} if isinstance(v, dict) else v
                for k, v in mine.items()}
    nodes = {str(q.node_id): mine}
    if isinstance(request, dict) and request.get("relay"):
        asker = request.get("asker")
        for peer in q.peers():
            if peer != asker and peer not in watchers:
                nodes.update(_ask(q, peer, relay=False))
    return nodes


def _ask(q: Any, peer: int, *, relay: bool) -> dict[str, Any]:
    try:
        return dict(q.call(peer, TOPIC, {"relay": relay, "asker": q.node_id}, timeout=CALL_TIMEOUT_S))
    except MQError as exc:  # a node without serve(), or dying: say so in its row
        return {str(peer): {"node": peer, "error": str(exc)}}


def collect(q: Any) -> dict[int, dict[str, Any]]:
    """Metrics of every node reachable through this node's peers, by node id."""
    nodes: dict[str, Any] = {}
    for peer in q.peers():
        if str(peer) not in nodes or "error" in nodes[str(peer)]:
            nodes.update({k: v for k, v in _ask(q, peer, relay=True).items()
                          if k not in nodes or "error" in nodes[k]})
    return {int(k): v for k, v in sorted(nodes.items(), key=lambda kv: int(kv[0]))}


def _plain(snapshot: dict[str, Any]) -> Any:
    # msgpack maps with int keys (peers) are not portable across decoders: string keys.
    return json.loads(json.dumps(snapshot, default=str))
