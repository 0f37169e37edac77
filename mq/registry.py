"""mq type string -> backend -> transport, and :func:`create`, which composes a node:
``MQ(transport)``. The backends are found, not listed: each package of :mod:`mq.backends` and each
``mq.backends`` entry point exports a :class:`~mq.backend.Backend` (:func:`backends`).

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
import importlib.metadata
import logging
import pkgutil
import threading
from typing import Any, Iterator, Mapping

import mq.backends
from mq.backend import Backend, LaunchProfile
from mq.node.core import MQ
from mq.errors import ConfigError
from mq.node.node_options import DEFAULT_TIMEOUT_S, NodeOptions

__all__ = ["CORE_OPTIONS", "ENTRY_POINT_GROUP", "MQ_TYPES", "backend_class", "backend_for", "backends",
           "check_mq_type", "create", "launchable_mq_types", "profile_for", "route_options",
           "transport_options"]

log = logging.getLogger("mq")

#: Installed packages add backends here (``[project.entry-points."mq.backends"]``,
#: ``name = "package:BACKEND"``); the built-in ones are the packages of :mod:`mq.backends`.
ENTRY_POINT_GROUP = "mq.backends"

#: Options MQ itself takes: the node's own (:class:`~mq.node.node_options.NodeOptions`) and its codec.
CORE_OPTIONS: frozenset[str] = NodeOptions.names() | {"codec"}

_lock = threading.Lock()
_found: dict[str, Backend] | None = None


def _discover() -> dict[str, Backend]:
    found: dict[str, Backend] = {}
    built_in = [getattr(importlib.import_module(info.name), "BACKEND", None)
                for info in pkgutil.iter_modules(mq.backends.__path__, "mq.backends.")]
    # launchable ones first (nng, torchrpc), then those of one process (inproc)
    for backend in sorted((b for b in built_in if isinstance(b, Backend)), key=lambda b: (b.launch is None, b.name)):
        found[backend.name] = backend
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            backend = ep.load()
        except Exception as exc:  # a broken plug-in must not take the built-in backends down
            log.warning("mq: backend entry point %r (%s) does not load: %s: %s", ep.name, ep.value,
                        type(exc).__name__, exc)
            continue
        if not isinstance(backend, Backend):
            log.warning("mq: backend entry point %r (%s) is not an mq.backend.Backend", ep.name, ep.value)
        elif backend.name in found:
            log.warning("mq: backend entry point %r names backend %r, which exists already: ignored",
                        ep.name, backend.name)
        else:
            found[backend.name] = backend
    return found


def backends() -> dict[str, Backend]:
    """Every backend, by name: the built-in ones, then those of the ``mq.backends`` entry points."""
    global _found
    with _lock:
        if _found is None:
            _found = _discover()
        return dict(_found)


def rediscover() -> None:
    """Forget what was found (a backend installed while this process runs, in tests)."""
    global _found
    with _lock:
        _found = None


class _MqTypes(Mapping[str, Backend]):
    """mq type -> its backend, found on first use (read-only)."""

    def _types(self) -> dict[str, Backend]:
        return {t: b for b in backends().values() for t in b.mq_types}

    def __getitem__(self, mq_type: str) -> Backend:
        return self._types()[mq_type]

    def __iter__(self) -> Iterator[str]:
        return iter(self._types())

    def __len__(self) -> int:
        return len(self._types())

    def __repr__(self) -> str:
        return f"MQ_TYPES({list(self)})"


#: Every mq type (``nng``, ``torchrpc:cpu``, ...) -> its :class:`~mq.backend.Backend`.
MQ_TYPES: Mapping[str, Backend] = _MqTypes()

#: The mq type the launcher, the CLI and the integrations use when none is named: the one place
#: outside a backend's folder that names it.
DEFAULT_MQ_TYPE = "nng"


def check_mq_type(mq_type: str) -> str:
    """Return the canonical mq type or raise ConfigError listing the known ones."""
    found = backends().values()
    for backend in found:
        if isinstance(mq_type, str) and mq_type in backend.aliases:
            return backend.aliases[mq_type]
    if not isinstance(mq_type, str) or mq_type not in MQ_TYPES:
        raise ConfigError(f"unknown mq type {mq_type!r}: choose one of {', '.join(MQ_TYPES)}")
    return mq_type


def backend_for(mq_type: str) -> Backend:
    """The backend of ``mq_type`` (ConfigError for an unknown type)."""
    return MQ_TYPES[check_mq_type(mq_type)]


def launchable_mq_types() -> list[str]:
    """The mq types whose nodes the launcher can start, one process each."""
    return [t for t, backend in MQ_TYPES.items() if backend.launch is not None]


def profile_for(mq_type: str) -> LaunchProfile:
    """The launch profile of ``mq_type``.

    Raises:
        ConfigError: an unknown mq type, or one whose nodes cannot run in separate processes.
    """
    profile = backend_for(mq_type).launch
    if profile is None:
        raise ConfigError(f"mq type {mq_type!r} cannot be launched (its nodes live in one process): "
                          f"choose one of {', '.join(launchable_mq_types())}")
    return profile



def backend_class(mq_type: str) -> tuple[Any, dict[str, Any]]:  # Any: a Transport subclass, found by name
    """The transport class of ``mq_type`` and the options the type fixes (``device``)."""
    mq_type = check_mq_type(mq_type)
    backend = MQ_TYPES[mq_type]
    return backend.transport_class(), dict(backend.mq_types[mq_type])


def transport_options(cls: Any) -> frozenset[str]:  # Any: a Transport subclass, with its Options
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
    ``torchrpc:cuda``, ``inproc``, or one a plug-in adds: :data:`MQ_TYPES`). Common options are
    :class:`mq.MQ`'s; the others are the fields of the transport's options type
    (``help(mq.backends.nng.options.NngOptions)``, ``mq.backends.torchrpc.options.TorchRpcOptions``,
    ``mq.backends.inproc.options.InprocOptions``).

    Raises:
        ConfigError: unknown mq type or a bad option (the message says which and how to fix it).
    """
    mq_type = check_mq_type(mq_type)
    cls, fixed = backend_class(mq_type)
    core, ours = route_options(mq_type, cls, fixed, options)
    if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
        raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
    timeout = core.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(ours.get("init_method"), str) and ours["init_method"].startswith("ray://"):
        _meet_through_ray(node_id, cls, core, ours, timeout)
    transport = cls(node_id, cls.Options(**fixed, **ours), timeout=timeout)
    return MQ(node_id, labels, transport=transport, mq_type=mq_type, **core)


def _meet_through_ray(node_id: int, cls: type, core: dict[str, Any], ours: dict[str, Any], timeout: Any) -> None:
    """``init_method="ray://GROUP"``: see :func:`mq.integrations.ray.node_options`."""
    from mq.integrations.ray import node_options
    from mq.options import check_seconds

    node_options(node_id, transport_options(cls), core, ours, check_seconds(timeout, "timeout"))
