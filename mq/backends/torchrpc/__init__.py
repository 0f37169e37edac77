"""The ``torchrpc`` backend (``torch.distributed.rpc`` on TensorPipe; mq types ``torchrpc:cpu``
and ``torchrpc:cuda``), one module per concern:

- :mod:`~mq.backends.torchrpc.options`: :class:`TorchRpcOptions`, validated once.
- :mod:`~mq.backends.torchrpc.transport`: :class:`TorchRpcTransport`: the RPC group's
  lifecycle, sending with credit, requests, receiving in order.
- :mod:`~mq.backends.torchrpc.wire`: the wire format (frames as TorchScript RPCs of the
  ``mq::deliver``/``mq::request`` ops, no pickle) and the per-process agent.
- :mod:`~mq.backends.torchrpc.streams`: the sending and receiving end of one peer's stream.
- :mod:`~mq.backends.torchrpc.tensorpipe`: TensorPipe's transports and channels for this
  node's peers, and where its agent listens.

Joining uses mq's rendezvous (:mod:`mq.rendezvous`); liveness is core's heartbeat.
"""
