"""Option checking shared by every options type, and the vocabularies options draw from.

Each transport has one frozen options dataclass (``mq.backends.<name>.options``), validated
once in ``__post_init__`` with the checks here, so every bad option is a
:class:`~mq.errors.ConfigError` whose message names the option, what it got and the fix
("send_buffer must be an int >= 1, got 0"). Each vocabulary below is the one definition of its
words; the route kinds live with the route function (:data:`mq.routing.ROUTE_KINDS`) and the mq
types with the registry (:data:`mq.registry.MQ_TYPES`), a backend's own words with it
(``mq.backends.nng.PROTOCOLS``).
"""

from __future__ import annotations

import math
from typing import Any, Collection

from mq.errors import ConfigError

__all__ = ["TOPOLOGIES", "check_bool", "check_choice", "check_int", "check_seconds"]

#: Which peers a node dials when it finds them through a rendezvous (:func:`mq.rendezvous.attach_targets`).
TOPOLOGIES: tuple[str, ...] = ("mesh", "star", "alone")


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is exactly True or False."""
    if type(value) is not bool:
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(value: Any, name: str, minimum: int = 1, unit: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; ``unit`` names what it
    counts in the message (``"bytes"``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = f" ({unit})" if unit else ""
        raise ConfigError(f"{name} must be an int >= {minimum}{what}, got {value!r}")
    return value


def check_seconds(value: Any, name: str) -> float:
    """``value`` as float seconds if it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_choice(value: Any, name: str, choices: Collection[str], hint: str = "") -> str:
    """``value`` if it is one of ``choices``; the message lists them (and ``hint``, the fix)."""
    if not isinstance(value, str) or value not in choices:
        *first, last = [str(c) for c in choices]
        listed = f"{', '.join(first)} or {last}" if first else last
        raise ConfigError(f"{name} must be {listed}{hint}, got {value!r}")
    return value
