"""The ``nng`` backend (pynng), one module per concern:

- :mod:`~mq.backends.nng.options`: :class:`NngOptions` and the NNG address grammar.
- :mod:`~mq.backends.nng.transport`: :class:`NngTransport`: listening, joining (bootstrap NNG
  sockets, the rendezvous), choosing a link per peer, reading every link in one ``poll()``.
- :mod:`~mq.backends.nng.outbox`: one peer's outgoing NNG pipe and the frames queued behind it.
- :mod:`~mq.backends.nng.wire`: frames in NNG messages (one, or a batch) and back.
- :mod:`~mq.backends.nng.busypoll`: how a thread waiting in ``recv()``/``call()`` waits.

The data links of mq's own (unix, tcp) it uses by default are :mod:`mq.backends.links`.
"""
