"""The ``inproc`` backend: nodes of one process, the reference implementation of
:mod:`mq.transport` that tests, docs and the conformance suite use.

- :mod:`~mq.backends.inproc.options`: :class:`InprocOptions` and the ``inproc://name`` grammar.
- :mod:`~mq.backends.inproc.transport`: :class:`InprocTransport` (its wire format: a frame
  travels as the codec's contiguous layout, bytes, through a bounded in-process inbox).
"""

from mq.backend import Backend, ConformanceCase

BACKEND = Backend(
    name="inproc",
    mq_types={"inproc": {}},
    transport="mq.backends.inproc.transport:InprocTransport",
    options="mq.backends.inproc.options:InprocOptions",
    routes=frozenset({"inproc"}),
    summary="nodes of one process (the reference transport for tests and docs); not launchable",
    data_paths=frozenset(),
    conformance=(ConformanceCase("inproc", "inproc", "inproc"),),
    nodes="mq.testing:inproc_nodes",
)
