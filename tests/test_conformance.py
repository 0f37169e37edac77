"""The conformance suite (mq/conformance.py) on every built-in backend, and on a transport mq has
never heard of.

Parametrized over the cases every registered backend declares (``Backend.conformance``): nng on
tcp, on unix sockets (ipc) and on its default (shm), torch RPC (CPU), each node a process
started by the launcher, and inproc, each node a thread of this process. Each test is a thin
wrapper of one check; a new backend declares its cases and is in the suite.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

import pytest

import mq
from mq import conformance, testing
from mq.registry import backend_class
from mq.transport import Transport

pytestmark = pytest.mark.timeout(120)


def _built(transport: str) -> bool:
    return importlib.util.find_spec(transport.partition(":")[0]) is not None


# From the registry: each backend (built-in or plug-in) declares its cases (mq.backend.ConformanceCase).
BACKENDS = [pytest.param(case, id=case.id, marks=pytest.mark.skipif(not _built(case.transport),
                                                                   reason=f"{case.transport} not built"))
            for case in testing.conformance_cases()]


def test_every_backend_and_route_is_in_the_suite():
    """The cases come from the registry: the built-in backends' routes are all there."""
    assert {(c.id, c.route) for c in testing.conformance_cases()} >= {
        ("nng-tcp", "tcp"), ("nng-ipc", "ipc"), ("nng-shm", "shm"), ("inproc", "inproc"), ("torchrpc-cpu", "shm")}


@pytest.fixture(params=BACKENDS)
def backend(request) -> testing.Case:
    return request.param


def test_send_recv_carries_every_payload_kind(backend):
    conformance.check_send_recv(backend.group)


def test_empty_tensors_and_arrays_arrive_every_time(backend):
    conformance.check_empty_buffers(backend.group)


def test_publish_reaches_only_subscribers(backend):
    conformance.check_publish_filtering(backend.group)


def test_recv_times_out(backend):
    conformance.check_recv_timeout(backend.group)


def test_call_result_remote_error_and_timeout(backend):
    conformance.check_call(backend.group)


def test_peers_by_label_and_routes(backend):
    conformance.check_peers_and_routes(backend.group, backend.route)


def test_ordering_exactly_once(backend):
    conformance.check_ordering(backend.group)


def test_backpressure_waits_then_times_out_and_loses_nothing(backend):
    conformance.check_backpressure(backend.group)


def test_subscription_handler_runs_in_order_off_the_io_thread(backend):
    conformance.check_handler_order(backend.group)


def test_send_to_stopped_peer_raises_peer_lost(backend):
    conformance.check_peer_stopped(backend.group)


def test_a_call_whose_handler_runs_when_the_server_stops_gets_its_answer(backend):
    conformance.check_answer_before_goodbye(backend.group)


def test_stop_waits_until_a_slow_receiver_took_everything(backend):
    conformance.check_stop_waits_for_a_slow_receiver(backend.group)


def test_stop_names_what_a_receiver_slower_than_its_bound_never_confirmed(backend):
    conformance.check_stop_names_what_it_could_not_deliver(backend.group)


def test_calls_racing_stop_get_their_answers_whenever_their_handler_ran(backend):
    conformance.check_calls_racing_stop_get_answers(backend.group)


# ---------------------------------------------------------------------- out of tree
class OutOfTree(Transport):
    """A transport named in no registry, as a user's package would define it: it moves frames
    through an inproc transport it holds (only through the Transport interface) and counts them."""

    name = "out-of-tree"

    def __init__(self, node_id: int, listen_to: str, attach_to: list[str]):
        inproc, _fixed = backend_class("inproc")
        self.inner = inproc(node_id, inproc.Options(listen_to=listen_to, attach_to=attach_to))
        self.routes = self.inner.routes
        self.sent = 0

    @property
    def addresses(self) -> dict[str, str]:  # filled by start, before any frame arrives
        return self.inner.addresses

    def start(self, node: Any) -> list[Any]:
        return list(self.inner.start(node))

    def greet(self, target: Any, frame: Any, token: str) -> None:
        self.inner.greet(target, frame, token)

    def reply_target(self, info: dict[str, Any]) -> Any:
        return self.inner.reply_target(info)

    def connect(self, peer: int, info: dict[str, Any], route: Any) -> None:
        self.inner.connect(peer, info, route)

    def disconnect(self, peer: int) -> None:
        self.inner.disconnect(peer)

    def send(self, peer: int, frame: Any, timeout: float) -> Any:
        receipt = self.inner.send(peer, frame, timeout)
        self.sent += 1
        return receipt

    def close(self, timeout: float) -> None:
        self.inner.close(timeout)


@pytest.mark.timeout(180)
def test_a_transport_defined_outside_mq_passes_the_whole_suite():
    transports: list[OutOfTree] = []

    def make_nodes(n: int, labels: list[Any], **mq_options: Any) -> list[mq.MQ]:
        names = [f"inproc://out-of-tree-{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(n)]
        made = [OutOfTree(i, names[i], names[:i]) for i in range(n)]
        transports.extend(made)
        return [mq.MQ(i, labels[i], transport=t, **mq_options) for i, t in enumerate(made)]

    conformance.check_all(testing.InProcess(make_nodes), route="inproc")
    assert {t.sent > 0 for t in transports} == {True}, "a node sent nothing through its own transport"


@pytest.mark.timeout(30)
def test_a_barrier_sees_only_its_own_nodes_arrivals():
    """Regression: barriers were keyed by id(node), so a later group's node that reused a freed
    node's id found that node's "end" arrivals, left its barrier early and stopped while its
    peer still called it (PeerLost in the out-of-tree suite on a busy CI machine)."""
    import gc

    from mq.testing import _BarrierBox

    import weakref

    nodes = testing.inproc_nodes(2, [None, None])
    boxes = []
    try:
        for q in nodes:
            box = _BarrierBox.get(q)
            box.seen["end"] = {1 - q.node_id}
            boxes.append(weakref.ref(box))
    finally:
        for q in nodes:
            q.stop()
    del nodes, q, box
    gc.collect()
    # (counting every box was flaky: other tests' nodes may be freed meanwhile too)
    assert all(r() is None for r in boxes), "a stopped, freed node's barrier arrivals outlived it"
