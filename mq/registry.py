"""mq type string -> backend class. Backends are imported lazily (torch RPC is heavy)."""

from __future__ import annotations

import importlib
from typing import Any

from mq.errors import ConfigError

# mq type -> (module, class, fixed keyword arguments)
MQ_TYPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "nng": ("mq.backends.nng", "NngMQ", {}),
    "torchrpc:cpu": ("mq.backends.torchrpc", "TorchRpcMQ", {"device": "cpu"}),
    "torchrpc:cuda": ("mq.backends.torchrpc", "TorchRpcMQ", {"device": "cuda"}),
}


def check_mq_type(mq_type: str) -> str:
    """Return the canonical mq type or raise ConfigError listing the known ones."""
    if mq_type == "torchrpc":
        return "torchrpc:cpu"
    if mq_type not in MQ_TYPES:
        raise ConfigError(f"unknown mq type {mq_type!r}: choose one of {', '.join(MQ_TYPES)}")
    return mq_type


def backend_class(mq_type: str) -> tuple[type, dict[str, Any]]:
    module, name, fixed = MQ_TYPES[check_mq_type(mq_type)]
    return getattr(importlib.import_module(module), name), dict(fixed)


def create(mq_type: str, node_id: int, labels: Any = None, **options: Any) -> Any:
    """Create a node's message queue of the given mq type (``nng``, ``torchrpc:cpu``,
    ``torchrpc:cuda``). Options are the backend's; see ``help(mq.backends.nng.NngMQ)``.

    Raises:
        ConfigError: unknown mq type or a bad option (the message says which and how to fix it).
    """
    cls, fixed = backend_class(mq_type)
    try:
        return cls(node_id, labels, **fixed, **options)
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        # an option this backend does not take: say which, and where the options are listed
        raise ConfigError(f"mq type {mq_type!r}: {exc}; see help({cls.__module__}.{cls.__name__})") from None
