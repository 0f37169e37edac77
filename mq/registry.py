"""mq type string -> transport, and :func:`create`, which composes a node: ``MQ(transport)``.

Transports are imported lazily (torch RPC is heavy).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from mq.core import MQ
from mq.errors import ConfigError

# mq type -> (module, transport class, fixed keyword arguments)
MQ_TYPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "nng": ("mq.backends.nng", "NngTransport", {}),
    "torchrpc:cpu": ("mq.backends.torchrpc", "TorchRpcTransport", {"device": "cpu"}),
    "torchrpc:cuda": ("mq.backends.torchrpc", "TorchRpcTransport", {"device": "cuda"}),
    "inproc": ("mq.backends.inproc", "InprocTransport", {}),
}

# Options MQ itself takes; every other option belongs to the transport.
_CORE_OPTIONS = frozenset(p.name for p in inspect.signature(MQ.__init__).parameters.values()
                          if p.kind is p.KEYWORD_ONLY) - {"transport", "mq_type"}


def check_mq_type(mq_type: str) -> str:
    """Return the canonical mq type or raise ConfigError listing the known ones."""
    if mq_type == "torchrpc":
        return "torchrpc:cpu"
    if not isinstance(mq_type, str) or mq_type not in MQ_TYPES:
        raise ConfigError(f"unknown mq type {mq_type!r}: choose one of {', '.join(MQ_TYPES)}")
    return mq_type


def backend_class(mq_type: str) -> tuple[type, dict[str, Any]]:
    module, name, fixed = MQ_TYPES[check_mq_type(mq_type)]
    return getattr(importlib.import_module(module), name), dict(fixed)


def create(mq_type: str, node_id: int, labels: Any = None, **options: Any) -> MQ:
    """Create a node's message queue of the given mq type (``nng``, ``torchrpc:cpu``,
    ``torchrpc:cuda``, ``inproc``). Common options are :class:`mq.MQ`'s; the others are the
    transport's (``help(mq.backends.nng.NngTransport)``, ``...torchrpc.TorchRpcTransport``).

    Raises:
        ConfigError: unknown mq type or a bad option (the message says which and how to fix it).
    """
    mq_type = check_mq_type(mq_type)
    cls, fixed = backend_class(mq_type)
    core = {k: v for k, v in options.items() if k in _CORE_OPTIONS}
    rest = {k: v for k, v in options.items() if k not in _CORE_OPTIONS}
    if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
        raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
    try:
        transport = cls(node_id, timeout=core.get("timeout", 30.0), **fixed, **rest)
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        # an option nobody takes: say which, and where the options are listed
        known = sorted(_CORE_OPTIONS | _transport_options(cls))
        raise ConfigError(f"mq type {mq_type!r}: {exc}; options are {', '.join(known)}") from None
    return MQ(node_id, labels, transport=transport, mq_type=mq_type, **core)


def _transport_options(cls: type) -> set[str]:
    return {p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind is p.KEYWORD_ONLY} - {"device", "timeout"}
