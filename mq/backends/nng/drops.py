"""What NNG itself drops on a node's inbox, counted (issue 45: no drop is silent).

NNG enforces the inbox's receive bound (``max_frame_bytes``) and its own protocol on the port
it listens on: a frame over the bound, or a connection that does not speak NNG's protocol, is
closed by NNG before mq sees a byte. NNG says so only in its listener statistics, by class:
``proto`` (another protocol) and ``other``, which it also counts for every connection that
closes, orderly or not. :class:`NngDrops` reads those statistics and takes away, listener by
listener, the orderly closes it saw itself: connections that delivered a frame and then closed
(per listener, so that a close NNG did not count on one port cannot hide a drop on another).
What remains is what
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
        self._delivered: dict[int, int] = {}  # pipe id -> listener id, for pipes that delivered a frame
        self._orderly: dict[int, int] = {}  # listener id -> such pipes closed since

    def watch(self, sock: Any, listeners: list[Any]) -> None:
        self._listeners = list(listeners)
        sock.add_post_pipe_remove_cb(self._removed)

    def delivered(self, pipe: Any) -> None:
        """The transport saw a whole frame on ``pipe`` (an ``nng_pipe``): its close is orderly."""
        pipe_id = lib.nng_pipe_id(pipe)
        if pipe_id not in self._delivered:
            self._delivered[pipe_id] = lib.nng_listener_id(lib.nng_pipe_listener(pipe))

    def _removed(self, pipe: Any) -> None:
        listener = self._delivered.pop(pipe.id, None)
        if listener is not None:
            self._orderly[listener] = self._orderly.get(listener, 0) + 1

    def counts(self) -> dict[str, int]:
        """Cumulative drops by cause: ``nng_protocol`` (a connection speaking another protocol)
        and ``nng_closed`` (NNG closed it without a whole frame: see the module docstring)."""
        if not self._listeners:
            return {}
        root = ffi.new("nng_stat **")
        if lib.nng_stats_get(root) != 0:
            return {}
        protocol = closed = 0
        try:
            for listener in self._listeners:
                totals = {"proto": 0, "other": 0}
                node = lib.nng_stat_find_listener(root[0], listener.listener)
                child = lib.nng_stat_child(node) if node != ffi.NULL else ffi.NULL
                while child != ffi.NULL:
                    name = ffi.string(lib.nng_stat_name(child)).decode()
                    if name in totals:
                        totals[name] += lib.nng_stat_value(child)
                    child = lib.nng_stat_next(child)
                protocol += totals["proto"]
                orderly = self._orderly.get(lib.nng_listener_id(listener.listener), 0)
                closed += max(0, totals["other"] - orderly)
        finally:
            lib.nng_stats_free(root[0])
        return {"nng_protocol": protocol, "nng_closed": closed}
