"""The nng backend's part of ``mq doctor``: pynng's version (read without loading its native
library) and how its waits behave."""

from __future__ import annotations

import importlib.metadata
from typing import Any, Mapping

from mq.locality import Locality

__all__ = ["section"]


def section(me: Locality, peers: Mapping[str, Locality]) -> dict[str, Any]:
    try:
        version = importlib.metadata.version("pynng")
    except importlib.metadata.PackageNotFoundError:
        return {"pynng": {"available": False, "version": None}, "rows": [["pynng", "[red]missing[/red]"]]}
    return {"pynng": {"available": True, "version": version},
            "rows": [["pynng", version],
                     ["  waits", "recv()/call() poll up to 0.5 ms before sleeping while answers come "
                                 "that fast (busy_poll=False, mq run --no-busy-poll: sleep at once)"]]}
