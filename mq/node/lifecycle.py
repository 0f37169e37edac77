"""A node's lifecycle: ``new -> listening -> stopping -> stopped``.

:class:`Lifecycle` owns the state; :class:`mq.node.core.MQ` moves it (:meth:`Lifecycle.move`, which
wakes every wait), and every collaborator that must stop working (threads, sends, waits) reads it.
Nothing else writes it.
"""

from __future__ import annotations

from typing import Callable

from mq.errors import ClosedError

STOPPED = "this queue was stopped; create a new one with mq.create(...)"


class Lifecycle:
    """Where a node is in its life. ``state`` is a plain attribute: the hot path reads it."""

    def __init__(self) -> None:
        self.state = "new"
        #: called after every move (the node's ``Waits.wake_all``): no wait, and no background
        #: loop, can miss that its node left a state (they need not look again to find out)
        self.moved: Callable[[], None] = lambda: None

    def move(self, state: str) -> None:
        """Go to ``state`` and wake whatever waits on the node."""
        self.state = state
        self.moved()

    @property
    def listening(self) -> bool:
        return self.state == "listening"

    @property
    def running(self) -> bool:
        """Threads keep working while new or listening (a stopping node drains)."""
        return self.state in ("new", "listening")

    def not_listening(self, what: str) -> str:
        """Why ``what`` cannot be done now, and what to do instead."""
        if self.state == "new":
            return f"{what} on a queue that is not listening yet: use `with q:` or q.listen() first"
        return f"{what} after stop(): {STOPPED}"

    def check(self, what: str) -> None:
        """Raise ClosedError unless listening."""
        if self.state != "listening":
            raise ClosedError(self.not_listening(what))
