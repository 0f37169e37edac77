"""Per-node, per-topic metrics: what :meth:`mq.MQ.metrics` returns.

Counting is on the hot path, so it is plain integer adds per message under the GIL; rates and
percentiles are computed only when someone asks. Delivery latency is the time from the
sender's ``time.time()`` (in the frame header) to the moment the message reaches ``recv()`` or
its handler: exact between processes of one host; across hosts it includes the hosts' clock
offset (keep clocks in sync with NTP/chrony, or read it as an upper bound).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

LATENCY_SAMPLES = 1024  # latest deliveries kept per topic for p50/p99


class TopicCounters:
    __slots__ = ("sent", "sent_bytes", "received", "received_bytes", "latencies")

    def __init__(self) -> None:
        self.sent = self.sent_bytes = self.received = self.received_bytes = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)


class Metrics:
    """Counters of one node. ``snapshot()`` turns them into numbers and rates."""

    def __init__(self) -> None:
        self.topics: dict[str, TopicCounters] = collections.defaultdict(TopicCounters)
        self.gauges: dict[str, Any] = {}  # set by channels (policy lag, versions)
        self.started = time.monotonic()
        self._last: tuple[float, dict[str, tuple[int, int, int, int]]] = (self.started, {})
        self._lock = threading.Lock()

    def sent(self, topic: str, nbytes: int) -> None:
        c = self.topics[topic]
        c.sent += 1
        c.sent_bytes += nbytes

    def received(self, topic: str, nbytes: int) -> None:
        c = self.topics[topic]
        c.received += 1
        c.received_bytes += nbytes

    def delivered(self, topic: str, sent_at: float) -> None:
        """The user got a message of ``topic`` sent at ``sent_at`` (sender's clock)."""
        if sent_at:
            self.topics[topic].latencies.append(max(0.0, time.time() - sent_at))

    def snapshot(self) -> dict[str, Any]:
        """Per-topic totals, rates since the previous snapshot and latency percentiles."""
        with self._lock:
            now = time.monotonic()
            then, before = self._last
            dt = max(now - then, 1e-9)
            topics, current = {}, {}
            for name, c in list(self.topics.items()):
                totals = (c.sent, c.sent_bytes, c.received, c.received_bytes)
                prev = before.get(name, (0, 0, 0, 0))
                current[name] = totals
                lat = sorted(c.latencies)
                topics[name] = {
                    "sent": c.sent, "sent_bytes": c.sent_bytes,
                    "received": c.received, "received_bytes": c.received_bytes,
                    "sent_per_s": (totals[0] - prev[0]) / dt,
                    "sent_bytes_per_s": (totals[1] - prev[1]) / dt,
                    "received_per_s": (totals[2] - prev[2]) / dt,
                    "received_bytes_per_s": (totals[3] - prev[3]) / dt,
                    "latency_p50_ms": _pct(lat, 0.50),
                    "latency_p99_ms": _pct(lat, 0.99),
                }
            self._last = (now, current)
        return {"uptime_s": now - self.started, "window_s": dt, "topics": topics,
                **{k: v for k, v in self.gauges.items()}}


def _pct(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000.0


def prometheus_text(snapshots: dict[int, dict[str, Any]]) -> str:
    """Metrics of one or more nodes (by node id) in Prometheus' text format, made with
    prometheus_client so names and escaping follow its rules."""
    from prometheus_client import generate_latest

    return generate_latest(prometheus_registry(snapshots)).decode()


def prometheus_registry(snapshots: dict[int, dict[str, Any]]) -> Any:
    """A prometheus_client registry holding the metrics of these nodes (to serve or print)."""
    from prometheus_client import CollectorRegistry, Gauge

    reg = CollectorRegistry()
    per_topic = {
        "sent": ("mq_messages_sent", "messages sent"),
        "sent_bytes": ("mq_bytes_sent", "bytes sent"),
        "received": ("mq_messages_received", "messages received"),
        "received_bytes": ("mq_bytes_received", "bytes received"),
        "received_per_s": ("mq_messages_received_per_second", "messages received per second"),
        "latency_p50_ms": ("mq_delivery_latency_p50_ms", "delivery latency p50, ms"),
        "latency_p99_ms": ("mq_delivery_latency_p99_ms", "delivery latency p99, ms"),
    }
    gauges = {k: Gauge(name, doc, ["node", "topic"], registry=reg) for k, (name, doc) in per_topic.items()}
    queue = Gauge("mq_queue_depth", "messages waiting in a receive queue", ["node", "queue"], registry=reg)
    queue_b = Gauge("mq_queue_bytes", "large-message bytes waiting in a receive queue", ["node", "queue"],
                    registry=reg)
    drops = Gauge("mq_dropped_frames", "frames dropped, by cause", ["node", "cause"], registry=reg)
    lag = Gauge("mq_policy_lag", "learner version minus the version a subscriber acts with",
                ["node", "channel", "peer"], registry=reg)
    for node, snap in snapshots.items():
        for topic, t in snap.get("topics", {}).items():
            for key, g in gauges.items():
                if t.get(key) is not None:
                    g.labels(str(node), topic).set(t[key])
        for name, q in snap.get("queues", {}).items():
            queue.labels(str(node), name).set(q["messages"])
            queue_b.labels(str(node), name).set(q["bytes"])
        for cause, n in snap.get("drops", {}).items():
            drops.labels(str(node), cause).set(n)
        for channel, by_peer in snap.get("policy_lag", {}).items():
            for peer, value in by_peer.items():
                lag.labels(str(node), channel, str(peer)).set(value)
    return reg
