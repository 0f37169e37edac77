"""mq: point-to-point messaging for distributed reinforcement learning.

One message-queue interface (:class:`MQ`) over two backends, NNG (``nng``) and torch RPC
(``torchrpc:cpu``, ``torchrpc:cuda``), choosing the fastest route to every peer by itself.

    >>> import mq
    >>> q = mq.create("nng", node_id=0, labels={"learner"}, listen_to="tcp://127.0.0.1:50515")
"""

from mq.channels import LatestWins, Version
from mq.node.core import MQ
from mq.node.message import Message
from mq.node.peers import Peer
from mq.node.stats import Stats
from mq.errors import (
    ClosedError,
    ConfigError,
    EncodeError,
    MQError,
    PeerLost,
    ProtocolError,
    RemoteError,
    StreamError,
    Timeout,
    Undelivered,
)
from mq.launch import Context, LaunchError, launch
from mq.registry import MQ_TYPES, create
from mq.routing import Route
from mq.stream import Stream

__version__ = "0.1.0"

__all__ = [
    "ClosedError",
    "ConfigError",
    "Context",
    "EncodeError",
    "LatestWins",
    "LaunchError",
    "MQ",
    "MQError",
    "MQ_TYPES",
    "Message",
    "Peer",
    "PeerLost",
    "ProtocolError",
    "RemoteError",
    "Route",
    "Stats",
    "Stream",
    "StreamError",
    "Timeout",
    "Undelivered",
    "Version",
    "create",
    "launch",
]
