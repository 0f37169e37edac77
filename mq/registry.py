"""mq type string -> transport, and :func:`create`, which composes a node: ``MQ(transport)``.

Options are routed by field: a name :class:`mq.MQ` takes (keyword-only in ``MQ.__init__``) is
core's, a field of the transport's options type (``Transport.Options``, a frozen dataclass
validated once) is the transport's, anything else is a :class:`~mq.errors.ConfigError` listing
both. No name may be both (checked when a type is created), so an option can never be taken by
one side and silently miss the other; the one core option a transport also reads, ``timeout``,
is handed to it explicitly. Transports are imported lazily (torch RPC is heavy).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

from mq.core import MQ
from mq.errors import ConfigError

__all__ = ["CORE_OPTIONS", "MQ_TYPES", "backend_class", "check_mq_type", "create", "route_options",
           "transport_options"]

# mq type -> (module, transport class, options fixed by the type)
MQ_TYPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "nng": ("mq.backends.nng.transport", "NngTransport", {}),
    "torchrpc:cpu": ("mq.backends.torchrpc.transport", "TorchRpcTransport", {"device": "cpu"}),
    "torchrpc:cuda": ("mq.backends.torchrpc.transport", "TorchRpcTransport", {"device": "cuda"}),
    "inproc": ("mq.backends.inproc.transport", "InprocTransport", {}),
}

#: Options MQ itself takes (its keyword-only parameters, less what create() fills in).
CORE_OPTIONS: frozenset[str] = frozenset(
    p.name for p in inspect.signature(MQ.__init__).parameters.values()
    if p.kind is p.KEYWORD_ONLY) - {"transport", "mq_type"}
_DEFAULT_TIMEOUT_S = 30.0


def check_mq_type(mq_type: str) -> str:
    """Return the canonical mq type or raise ConfigError listing the known ones."""
    if mq_type == "torchrpc":
        return "torchrpc:cpu"
    if not isinstance(mq_type, str) or mq_type not in MQ_TYPES:
        raise ConfigError(f"unknown mq type {mq_type!r}: choose one of {', '.join(MQ_TYPES)}")
    return mq_type


def backend_class(mq_type: str) -> tuple[type, dict[str, Any]]:
    """The transport class of ``mq_type`` and the options the type fixes (``device``)."""
    module, name, fixed = MQ_TYPES[check_mq_type(mq_type)]
    return getattr(importlib.import_module(module), name), dict(fixed)


def transport_options(cls: type) -> frozenset[str]:
    """The option names a transport class takes: the init fields of its ``Options`` type.

    Raises:
        TypeError: a field is also an MQ option (the transport would never see it).
    """
    names = frozenset(f.name for f in dataclasses.fields(cls.Options) if f.init)
    shadowed = names & CORE_OPTIONS
    if shadowed:
        raise TypeError(f"{cls.__name__}.Options field(s) {sorted(shadowed)} are also MQ options "
                        "and would never reach the transport: rename them")
    return names


def route_options(mq_type: str, cls: type, fixed: dict[str, Any],
                  options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``options`` into (core's, the transport's) by field name.

    Raises:
        ConfigError: an option neither takes, or one the mq type fixes; the message lists the
            options there are.
    """
    ours = transport_options(cls) - set(fixed)
    unknown = sorted(set(options) - CORE_OPTIONS - ours)
    if unknown:
        known = ", ".join(sorted(CORE_OPTIONS | ours))
        raise ConfigError(f"mq type {mq_type!r}: unexpected keyword argument {unknown[0]!r}; "
                          f"options are {known}")
    core = {k: v for k, v in options.items() if k in CORE_OPTIONS}
    return core, {k: v for k, v in options.items() if k in ours}


def create(mq_type: str, node_id: int, labels: Any = None, **options: Any) -> MQ:
    """Create a node's message queue of the given mq type (``nng``, ``torchrpc:cpu``,
    ``torchrpc:cuda``, ``inproc``). Common options are :class:`mq.MQ`'s; the others are the
    fields of the transport's options type (``help(mq.backends.nng.options.NngOptions)``,
    ``mq.backends.torchrpc.options.TorchRpcOptions``, ``mq.backends.inproc.options.InprocOptions``).

    Raises:
        ConfigError: unknown mq type or a bad option (the message says which and how to fix it).
    """
    mq_type = check_mq_type(mq_type)
    cls, fixed = backend_class(mq_type)
    core, ours = route_options(mq_type, cls, fixed, options)
    if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
        raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
    transport = cls(node_id, cls.Options(**fixed, **ours), timeout=core.get("timeout", _DEFAULT_TIMEOUT_S))
    return MQ(node_id, labels, transport=transport, mq_type=mq_type, **core)
