"""A node's internals: what :class:`mq.node.core.MQ` (the queue a user holds) is made of.

One module per part, each owning its state (the architecture page of the docs draws them):
the peer table, joining and route choice, dispatch of what the transport reports, delivery,
calls, liveness, sending, and :mod:`mq.node.waits`, the one way any of them blocks.
"""
