"""What NNG itself drops on a node's inbox, counted (issue 45: no drop is silent).

NNG enforces the inbox's receive bound (``max_frame_bytes``) and its own protocol on the port
it listens on: a frame over the bound, or a connection that does not speak NNG's protocol, is
closed by NNG before mq sees a byte. NNG says so only in its listener statistics, by class:
``proto`` (another protocol) and ``other``, which it also counts for every connection that
closes, orderly or not. :class:`NngDrops` reads those statistics and takes away the orderly
closes it saw itself: connections that delivered a frame and then closed. What remains is what
NNG closed without a whole frame: an oversized frame, one broken off, or a connection opened
and closed empty (NNG does not tell these apart).
"""

from __future__ import annotations

from typing import Any

from pynng import ffi, lib


class NngDrops:
    """The drop counters of one inbox socket and its listeners."""

    def __init__(self) -> None:
        self._listeners: list[Any] = []
        self.delivered: set[int] = set()  # pipe ids that delivered a frame (the transport adds)
        self._orderly = 0  # such pipes closed since

    def watch(self, sock: Any, listeners: list[Any]) -> None:
        self._listeners = list(listeners)
        sock.add_post_pipe_remove_cb(self._removed)

    def _removed(self, pipe: Any) -> None:
        if pipe.id in self.delivered:
            self.delivered.discard(pipe.id)
            self._orderly += 1

    def counts(self) -> dict[str, int]:
        """Cumulative drops by cause: ``nng_protocol`` (a connection speaking another protocol)
        and ``nng_closed`` (NNG closed it without a whole frame: see the module docstring)."""
        totals = {"proto": 0, "other": 0}
        if not self._listeners:
            return {}
        root = ffi.new("nng_stat **")
        if lib.nng_stats_get(root) != 0:
            return {}
        try:
            for listener in self._listeners:
                node = lib.nng_stat_find_listener(root[0], listener.listener)
                child = lib.nng_stat_child(node) if node != ffi.NULL else ffi.NULL
                while child != ffi.NULL:
                    name = ffi.string(lib.nng_stat_name(child)).decode()
                    if name in totals:
                        totals[name] += lib.nng_stat_value(child)
                    child = lib.nng_stat_next(child)
        finally:
            lib.nng_stats_free(root[0])
        return {"nng_protocol": totals["proto"], "nng_closed": max(0, totals["other"] - self._orderly)}
