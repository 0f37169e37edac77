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

- :mod:`~mq.backends.torchrpc.launch`: how ``mq run`` starts its workers.
- :mod:`~mq.backends.torchrpc.doctor`: its part of ``mq doctor`` and what it leaves open.

Joining uses mq's rendezvous (:mod:`mq.rendezvous`); liveness is core's heartbeat. Everything mq
needs to know about it is :data:`BACKEND`.
"""

from functools import partial

from mq.backends.torchrpc import device_map
from mq.backend import Backend, ConformanceCase, Flag
from mq.backends.torchrpc.launch import TorchRpcLaunch
from mq.options import check_bool
from mq.routing import ALL_ROUTES

BACKEND = Backend(
    name="torchrpc",
    mq_types={"torchrpc:cpu": {"device": "cpu"}, "torchrpc:cuda": {"device": "cuda"}},
    transport="mq.backends.torchrpc.transport:TorchRpcTransport",
    options="mq.backends.torchrpc.options:TorchRpcOptions",
    routes=ALL_ROUTES,
    summary="torch.distributed.rpc on TensorPipe: cpu stages GPU tensors through host memory, "
            "cuda moves them device to device through device maps",
    aliases={"torchrpc": "torchrpc:cpu"},
    launch=TorchRpcLaunch(),
    one_per_process=True,
    flags=(Flag("local_cuda_devices", metavar="0,1", parse=device_map.parse_devices),
           Flag("cuda_device_map", metavar="PEER_LOCAL_PEERGPU,..."),
           Flag("busy_poll", check=partial(check_bool, name="busy_poll"))),
    trust="mq.backends.torchrpc.doctor:TRUST",
    doctor="mq.backends.torchrpc.doctor:section",
    conformance=(ConformanceCase("torchrpc-cpu", "torchrpc:cpu", "shm"),),
)
