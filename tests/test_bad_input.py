"""Every public entry point answers bad input with an mq error that names what was wrong and
the fix; nothing leaks a bare TypeError, OverflowError or pynng exception. Table-driven."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mq

pytestmark = pytest.mark.timeout(60)

CREATE = [
    (("nng", "0"), {}, "node_id must be a non-negative int"),
    (("nng", -1), {}, "node_id must be a non-negative int"),
    ((5, 0), {}, "unknown mq type"),
    (("zmq", 0), {}, "unknown mq type 'zmq': choose one of nng"),
    (("nng", 0, 5), {}, "labels must be a str or an iterable of str"),
    (("nng", 0), {"timeout": "5"}, "timeout must be a number of seconds"),
    (("nng", 0), {"timeout": math.inf}, "finite number of seconds"),
    (("nng", 0), {"timeout": math.nan}, "finite number of seconds"),
    (("nng", 0), {"timeout": 0}, "positive number of seconds"),
    (("nng", 0), {"queue_size": "4"}, "queue_size must be an int"),
    (("nng", 0), {"queue_bytes": 0}, "queue_bytes must be an int >= 1"),
    (("nng", 0), {"handler_threads": 0}, "handler_threads must be an int >= 1"),
    (("nng", 0), {"max_frame_bytes": 1.5}, "max_frame_bytes must be an int"),
    (("nng", 0), {"heartbeat": -1}, "heartbeat must be a number of seconds"),
    (("nng", 0), {"peer_timeout": "3"}, "peer_timeout must be a number of seconds"),
    (("nng", 0), {"listen_to": 5}, "listen_to 5 must start with one of tcp://"),
    (("nng", 0), {"listen_to": "tcp://host"}, "needs a host and a port"),
    (("nng", 0), {"attach_to": 5}, "attach_to must be a list of addresses"),
    (("nng", 0), {"attach_to": ["udp://x:1"]}, "attach_to address 'udp://x:1' must start with"),
    (("nng", 0), {"protocol": "shm"}, "protocol must be auto, tcp or ipc"),
    (("nng", 0), {"unix_links": "yes"}, "unix_links must be True or False"),
    (("nng", 0), {"tcp_links": 1}, "tcp_links must be True or False"),
    (("nng", 0), {"secret": "short"}, "at least 8 characters"),
    (("nng", 0), {"secret": 12345678}, "secret must be a str or bytes"),
    (("nng", 0), {"insecure": "yes"}, "insecure must be True or False"),
    (("nng", 0), {"shm_pool_bytes": -1}, "shm_pool_bytes must be an int >= 0"),
    (("nng", 0), {"frobnicate": 1}, "unexpected keyword argument 'frobnicate'; options are"),
    (("inproc", 0), {"listen_to": "nng://x"}, "must look like inproc://name"),
]


@pytest.mark.parametrize("args, kwargs, match", CREATE)
def test_create_rejects_bad_options(args, kwargs, match):
    with pytest.raises(mq.ConfigError, match=match):
        mq.create(*args, **kwargs)


@pytest.fixture(scope="module")
def pair():
    a = mq.create("inproc", 0, listen_to="inproc://bad-input-a", timeout=2)
    b = mq.create("inproc", 1, attach_to=["inproc://bad-input-a"], timeout=2)
    with a, b:
        a.wait_for_peers(1, timeout=5)
        yield a, b


CALLS = [
    (lambda q: q.send("1", "t", 1), mq.ConfigError, "peer must be a node id"),
    (lambda q: q.send(0, "t", 1), mq.ConfigError, "node 0 is this node"),
    (lambda q: q.send(1, 5, 1), mq.ConfigError, "topic must be a non-empty str"),
    (lambda q: q.send(1, "", 1), mq.ConfigError, "topic must be a non-empty str"),
    (lambda q: q.send(1, "t", 1, timeout="5"), mq.ConfigError, "timeout must be a number of seconds"),
    (lambda q: q.send(1, "t", 1, timeout=math.inf), mq.ConfigError, "finite number of seconds"),
    (lambda q: q.send(1, "t", 1, timeout=-1), mq.ConfigError, ">= 0 seconds"),
    (lambda q: q.send(1, "t", object()), mq.EncodeError, "cannot send a value of type builtins.object"),
    (lambda q: q.send(9, "t", 1, timeout=0.1), mq.Timeout, "node 9 has not joined"),
    (lambda q: q.publish(None, 1), mq.ConfigError, "topic must be a non-empty str"),
    (lambda q: q.call(1, "t", 1, timeout=math.nan), mq.ConfigError, "finite number of seconds"),
    (lambda q: q.recv(timeout="1"), mq.ConfigError, "timeout must be a number of seconds"),
    (lambda q: q.subscribe("t", 5), mq.ConfigError, "fn must be callable or None"),
    (lambda q: q.on("t", None), mq.ConfigError, "fn must be callable"),
    (lambda q: q.wait_for_peers("2", timeout=0.1), mq.ConfigError, "count must be an int"),
    (lambda q: q.wait_for_peers(ids=5, timeout=0.1), mq.ConfigError, "ids must be node ids"),
    (lambda q: q.wait_for_subscribers("t", "1"), mq.ConfigError, "count must be an int"),
    (lambda q: q.flush("1"), mq.ConfigError, "peer must be a node id"),
    (lambda q: q.alloc((2, "x"), "float32"), mq.ConfigError, "shape must be ints"),
    (lambda q: q.alloc(4, "no-such-dtype"), mq.ConfigError, "dtype must be a numpy or torch dtype"),
    (lambda q: q.wait_released(np.zeros(3)), mq.ConfigError, "not allocated with q.alloc"),
    (lambda q: q.set_metric(5, 1), mq.ConfigError, "metric name must be a non-empty str"),
    (lambda q: q.flush(1, timeout=math.inf), mq.ConfigError, "finite number of seconds"),
]


@pytest.mark.parametrize("call, error, match", CALLS)
def test_calls_reject_bad_arguments(pair, call, error, match):
    with pytest.raises(error, match=match):
        call(pair[0])


def test_use_after_stop_says_so_and_gives_a_fix_that_works():
    q = mq.create("inproc", 0, timeout=1)
    for call in (lambda: q.recv(timeout=0.1), lambda: q.wait_for_peers(1, timeout=0.1),
                 lambda: q.wait_for_subscribers("t", timeout=0.1)):
        with pytest.raises(mq.ClosedError, match="not listening yet: use `with q:` or q.listen"):
            call()
    with q:
        pass
    for call in (lambda: q.recv(timeout=0.1), lambda: q.send(1, "t", 1), lambda: q.listen()):
        with pytest.raises(mq.ClosedError, match=r"create a new one with mq.create\(...\)"):
            call()
    with pytest.raises(mq.ConfigError, match="timeout must be"):
        q.stop(timeout="1")


def test_an_attach_address_that_never_answers_is_named_with_the_stage_the_join_stopped_at():
    q = mq.create("nng", 0, attach_to=["tcp://127.0.0.1:9"], timeout=1)
    with q:
        with pytest.raises(mq.Timeout, match=r"tcp://127.0.0.1:9: stage connect \(no connection"):
            q.wait_for_peers(1, timeout=0.5)
    # Something takes the HELLO but never answers it: the stage is the handshake.
    import pynng

    sink = pynng.Pull0(listen="tcp://127.0.0.1:0")  # an NNG socket that is not an mq node
    try:
        address = f"tcp://127.0.0.1:{str(sink.listeners[0].local_address).rpartition(':')[2]}"
        q = mq.create("nng", 0, attach_to=[address], timeout=1)
        with q:
            with pytest.raises(mq.Timeout, match=rf"{address}: stage handshake \(our HELLO got no answer"):
                q.wait_for_peers(1, timeout=1.0)
    finally:
        sink.close()
    # A node of another job (another secret) answers, and fails authentication: stage auth.
    other = mq.create("nng", 5, listen_to="tcp://127.0.0.1:0", secret="another job's secret")
    with other:
        q = mq.create("nng", 0, attach_to=[other.addresses["tcp"]], timeout=2, secret="this job's secret")
        with q:
            with pytest.raises(mq.Timeout, match=r"stage auth \(its answer \(node 5\) failed authentication"):
                q.wait_for_peers(1, timeout=2.0)


def test_options_are_routed_by_field_and_none_is_both_cores_and_a_transports():
    """create() gives each option to MQ or to the transport's options type by name; a name both
    take would be shadowed (the transport would never see it), so it cannot be declared."""
    import dataclasses

    from mq.registry import CORE_OPTIONS, MQ_TYPES, backend_class, transport_options

    assert "heartbeat" in CORE_OPTIONS  # one heartbeat, core's, for every backend
    for mq_type in MQ_TYPES:
        try:
            cls, _fixed = backend_class(mq_type)
        except ImportError:  # torch or pynng missing here
            continue
        assert not transport_options(cls) & CORE_OPTIONS

    @dataclasses.dataclass(frozen=True)
    class Shadowing:
        heartbeat: float = 1.0

    class Transport:
        Options = Shadowing

    with pytest.raises(TypeError, match=r"\['heartbeat'\] are also MQ options"):
        transport_options(Transport)
