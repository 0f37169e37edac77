"""The ``nng`` backend (pynng), one module per concern:

- :mod:`~mq.backends.nng.options`: :class:`NngOptions` and the NNG address grammar.
- :mod:`~mq.backends.nng.transport`: :class:`NngTransport`: listening, joining (bootstrap NNG
  sockets, the rendezvous), choosing a link per peer, reading every link in one ``poll()``.
- :mod:`~mq.backends.nng.outbox`: one peer's outgoing NNG pipe and the frames queued behind it.
- :mod:`~mq.backends.nng.wire`: frames in NNG messages (one, or a batch) and back.
- :mod:`~mq.backends.nng.busypoll`: how a thread waiting in ``recv()``/``call()`` waits.

- :mod:`~mq.backends.nng.launch`: how ``mq run`` starts its workers.
- :mod:`~mq.backends.nng.links`: mq's own data links (unix, tcp), used by default.

Everything mq needs to know about it is :data:`BACKEND`.
"""

from functools import partial

from mq.backend import Backend, ConformanceCase, Flag
from mq.backends.nng.launch import NngLaunch
from mq.options import check_bool, check_choice

#: The nng transport's ``protocol`` option: best route per peer, or one socket kind for all.
PROTOCOLS: tuple[str, ...] = ("auto", "tcp", "ipc")
#: What its transport carries (the shm data path adds ``shm`` where it works).
ROUTES = frozenset({"inproc", "nvlink", "ipc", "tcp"})


BACKEND = Backend(
    name="nng",
    mq_types={"nng": {}},
    transport="mq.backends.nng.transport:NngTransport",
    options="mq.backends.nng.options:NngOptions",
    routes=ROUTES,
    summary="NNG (pynng) with mq's own unix/tcp links and shared memory; any number of hosts",
    launch=NngLaunch(),
    flags=(Flag("protocol", metavar="|".join(PROTOCOLS),
                check=partial(check_choice, name="protocol", choices=PROTOCOLS)),
           Flag("busy_poll", check=partial(check_bool, name="busy_poll"))),
    doctor="mq.backends.nng.doctor:section",
    conformance=(ConformanceCase("nng-tcp", "nng", "tcp", {"protocol": "tcp"}),
                 ConformanceCase("nng-ipc", "nng", "ipc", {"protocol": "ipc"}),
                 ConformanceCase("nng-shm", "nng", "shm")),
)
