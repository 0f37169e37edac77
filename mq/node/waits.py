"""Waiting: the one way mq's threads block.

Every blocking operation of a node (a send held back by flow control, by a data path's full
pool, by a full link or outbox; ``flush``; ``call``; ``stop``'s drain; a stream's credit or its
next message; ``recv``) waits through :meth:`Waits.until`, which ends the wait when

- its condition holds (``ready()`` returns something true, which is returned),
- a peer it depends on is lost (:class:`~mq.errors.PeerLost`, naming the peer and why),
- the node stops (:class:`~mq.errors.ClosedError`),
- or its deadline passes (:class:`~mq.errors.Timeout`, saying what did not happen).

Why one primitive: a wait built on its own condition variable hears only of the changes that
notify that variable. A peer the heartbeat thread declared dead notified nobody waiting on a
pool's slots or a stream's credit, so those waits sat out their whole timeout (issue 45). Here:

- whoever changes what a wait looks at calls :meth:`Waits.wake` with that object (the one the
  wait names in ``on``); losing a peer, a stalled reader and stopping wake every wait
  (:meth:`Waits.wake_all`);
- a waiter registers before it looks, as with a condition variable, so a wake-up that comes
  between its look and its sleep is never lost;
- and whatever happens, a wait looks again at least every :data:`RECHECK_S`: at the peers it
  depends on, at the node's state, at its deadline and at its condition. A wake-up somebody
  forgot costs at most that long; it can never cost a hang.

The same module holds the few other ways to block that mq needs, each bounded: a thread's next
item (:class:`Mailbox`), a pause in a background loop (:meth:`Waits.pause`), a socket with room
(:meth:`Waits.for_fd`), a thread or process ending (:func:`join`), a future's result
(:func:`result`), a flag (:class:`Flag`) and a plain :func:`sleep`. ``tests/test_house.py``
fails when code in ``mq/`` blocks on a lock, condition, event or queue anywhere else.
"""

from __future__ import annotations

import collections
import contextlib
import select
import threading
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

from mq.errors import ClosedError, PeerLost, Timeout

T = TypeVar("T")

#: The longest a wait goes without looking again at its peers, its node and its condition.
RECHECK_S = 0.1
#: ... and a background loop's pause (:meth:`Waits.pause`): its items wake it, and so does
#: every change of the node's state (:class:`mq.node.lifecycle.Lifecycle` wakes every wait).
#: Each look of an idle loop costs a thread wake-up: five loops a node looking every second
#: made a 256-node job burn a fifth of a core doing nothing (issue 49).
PAUSE_RECHECK_S = 30.0
#: Node states in which a wait goes on (by default): a stopping node's waits end, but the
#: answers and the drain of ``stop()`` pass ``LIVE_OR_STOPPING``.
LISTENING = frozenset({"listening"})
LIVE_OR_STOPPING = frozenset({"listening", "stopping"})
RUNNING = frozenset({"new", "listening", "stopping"})
_FOREVER = 365 * 86400.0


class _Sleeper:
    """One waiting thread: a lock held while it is armed; a wake-up releases it."""

    __slots__ = ("_lock", "woken")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.woken = False

    def wake(self) -> None:  # (the hub's lock held)
        if not self.woken:
            self.woken = True
            self._lock.release()

    def sleep(self, seconds: float) -> None:
        self._lock.acquire(timeout=max(seconds, 0.0))  # True: woken; False: time to look again

    def rearm(self) -> None:  # (the hub's lock held; before the next look)
        if self.woken:
            self.woken = False
            self._lock.acquire(False)  # released by the wake-up: take it back without waiting


class Waits:
    """The waits of one node (or of anything with a state and peers that can be lost).

    Args:
        state: ``state()`` -> the node's lifecycle state (``listening``, ``stopping``, ...);
            a wait goes on only in the states it names. None: always running.

    ``lookup`` (set by the peer table) finds a peer by node id: a wait's ``peers`` are looked
    up at every look, and one whose ``lost`` says why ends it with PeerLost.
    """

    def __init__(self, state: Callable[[], str] | None = None):
        self._state = state or (lambda: "listening")
        # Re-entrant: a wake-up may come from a garbage collection callback (a released view)
        # run by a thread that holds it already.
        self._lock = threading.RLock()
        #: id of an object somebody waits on -> its waiters (a hot path may look here itself
        #: before calling :meth:`wake`: a dict lookup, no call)
        self.watched: dict[int, list[_Sleeper]] = {}
        self._all: set[_Sleeper] = set()
        #: node id -> how many waits depend on it now: liveness probes those peers (mq.node.liveness)
        self.depended: dict[int, int] = {}
        #: called (the hub's lock held: it must not block) when a wait starts depending on a
        #: peer nobody depended on: liveness probes it at once rather than at its next tick
        self.depending: Callable[[int], None] = lambda _node_id: None
        self.lookup: Callable[[int], Any] = lambda _peer: None
        #: called when a wait that depends on peers is about to sleep: their frames (receipts,
        #: replies, releases) must be read, so the transport's reader should look now
        self.reader_wanted: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ waking
    def wake(self, obj: Any) -> None:
        """``obj`` changed: the waits watching it look again now. Cheap when nobody watches
        (one dict lookup): waiters register before they look, so no lock is needed to skip."""
        if id(obj) in self.watched:
            with self._lock:
                for sleeper in tuple(self.watched.get(id(obj), ())):
                    sleeper.wake()

    def wake_all(self) -> None:
        """Something every wait may depend on changed (a peer lost, the node stopping, our
        reader stalled): every wait looks again now."""
        with self._lock:
            for sleeper in tuple(self._all):
                sleeper.wake()

    # ------------------------------------------------------------------ waiting
    def until(self, ready: Callable[[], T], deadline: float | None = None, *, on: Iterable[Any] = (),
              peers: Iterable[Any] = (), what: str | Callable[[], str] = "the wait timed out",
              states: frozenset[str] = LISTENING, every: float = RECHECK_S) -> T:
        """Block until ``ready()`` returns something true, and return it.

        Args:
            deadline: ``time.monotonic()`` by which it must be ready; None: no deadline (the
                wait still ends when its peers are lost or the node leaves ``states``).
            on: the objects whose :meth:`wake` makes it look again (besides :meth:`wake_all`).
            peers: the peers it depends on (node ids, or the table's peer objects: a peer
                replaced by a new process of its id is still the one waited on).
            what: the Timeout's message (a callable is called only then).
            states: node states in which it goes on.
            every: look again at least this often (a condition nobody wakes: poll it).

        Raises:
            PeerLost: a peer of ``peers`` was lost (the message names it and says why).
            ClosedError: the node left ``states``.
            Timeout: ``deadline`` passed; the message is ``what``.
        """
        got = ready()
        if got:
            return got
        sleeper = _Sleeper()
        keys = [id(obj) for obj in on]
        peers = tuple(peers)
        self._enter(sleeper, keys, peers)
        if peers:
            self.reader_wanted()
        try:
            while True:
                got = ready()
                if got:
                    return got
                self._check(peers, states)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise Timeout(what() if callable(what) else what)
                sleeper.sleep(min(every, deadline - now) if deadline is not None else every)
                with self._lock:
                    sleeper.rearm()
        finally:
            self._leave(sleeper, keys, peers)

    @contextlib.contextmanager
    def depend(self, peers: Iterable[Any]) -> Iterator[None]:
        """Count ``peers`` (node ids or peer objects) as depended on for the ``with`` block: a
        wait that ends on its own condition (an answer, a receipt) but needs the peers' loss
        noticed meanwhile. :meth:`until` does this for its ``peers``."""
        ids = _ids(peers)
        with self._lock:
            self._count(ids, 1)
        try:
            yield
        finally:
            with self._lock:
                self._count(ids, -1)

    def depends_on(self, node_id: int) -> bool:
        """Whether a wait depends on peer ``node_id`` now."""
        return node_id in self.depended

    def _count(self, ids: tuple[int, ...], step: int) -> None:  # (the lock held)
        for node_id in ids:
            n = self.depended.get(node_id, 0) + step
            if n > 0:
                self.depended[node_id] = n
                if n == 1 and step > 0:
                    self.depending(node_id)
            else:
                self.depended.pop(node_id, None)

    def pause(self, ready: Callable[[], Any], seconds: float, *, on: Iterable[Any] = ()) -> bool:
        """A background loop's wait: until ``ready()`` or ``seconds`` passed (no peers, no
        state: the loop looks at those itself). True when ready."""
        try:
            return bool(self.until(ready, time.monotonic() + seconds, on=on, states=_ANY, every=PAUSE_RECHECK_S))
        except Timeout:
            return False

    def for_fd(self, fd: int, events: int, deadline: float, *, peers: Iterable[Any] = (),
               what: str | Callable[[], str] = "the socket stayed full",
               states: frozenset[str] = LISTENING) -> None:
        """Block until ``fd`` is ready for ``events`` (``select.POLLOUT``: a socket with room),
        or hangs up. Looks at its peers and the node every :data:`RECHECK_S`: a peer lost by the
        heartbeat ends it even while the socket stays open."""
        poller = select.poll()
        poller.register(fd, events)
        peers = tuple(peers)
        with self.depend(peers):
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(what() if callable(what) else what)
                if poller.poll(max(1, int(min(left, RECHECK_S) * 1000))):
                    return
                self._check(peers, states)

    def _check(self, peers: tuple[Any, ...], states: frozenset[str]) -> None:
        for peer in peers:
            p = peer if type(peer) is not int else self.lookup(peer)
            if p is not None and p.lost:
                raise PeerLost(f"node {p.node_id} {p.lost}")
        state = self._state()
        if state not in states:
            raise ClosedError(f"the queue was stopped while waiting (it is {state})")

    def _enter(self, sleeper: _Sleeper, keys: list[int], peers: tuple[Any, ...]) -> None:
        with self._lock:
            self._all.add(sleeper)
            for key in keys:
                self.watched.setdefault(key, []).append(sleeper)
            if peers:
                self._count(_ids(peers), 1)

    def _leave(self, sleeper: _Sleeper, keys: list[int], peers: tuple[Any, ...]) -> None:
        with self._lock:
            self._all.discard(sleeper)
            if peers:
                self._count(_ids(peers), -1)
            for key in keys:
                waiting = self.watched.get(key)
                if waiting is not None:
                    waiting.remove(sleeper)
                    if not waiting:
                        del self.watched[key]

    def waiting(self) -> int:
        """Threads waiting now (tests, metrics)."""
        return len(self._all)


def _ids(peers: Iterable[Any]) -> tuple[int, ...]:
    return tuple(p if type(p) is int else p.node_id for p in peers)


class _AnyState(frozenset):
    def __contains__(self, _state: object) -> bool:
        return True


#: Waits that go on whatever the node's state (a background loop looks at it itself).
ANY_STATE: frozenset[str] = _AnyState()
_ANY = ANY_STATE
#: Waits of code that belongs to no node (the launcher, platforms): a state that never stops.
ALWAYS = Waits()


class Mailbox:
    """Items handed to one or more consumer threads (a handler queue, a relay's jobs): FIFO,
    unbounded (its producers bound it), ``get`` waits through the node's :class:`Waits`."""

    def __init__(self, waits: Waits):
        self._items: collections.deque[Any] = collections.deque()
        self._waits = waits

    def put(self, item: Any) -> None:
        self._items.append(item)
        self._waits.wake(self)

    def get(self, timeout: float) -> Any:
        """The next item; raises :class:`TimeoutError` (the builtin) when none came in time."""
        items = self._items
        deadline = time.monotonic() + timeout
        while True:
            try:
                return items.popleft()
            except IndexError:  # (another consumer may take the item this one was woken for)
                pass
            left = deadline - time.monotonic()
            if left <= 0 or not self._waits.pause(lambda: items, left, on=(self,)):
                raise TimeoutError

    def get_nowait(self) -> Any:
        """The next item; raises :class:`IndexError` when there is none."""
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)


class Flag:
    """A flag one thread sets and others wait for (an Event whose wait is always bounded)."""

    def __init__(self, waits: Waits = ALWAYS):
        self._set = False
        self._waits = waits

    def set(self) -> None:
        self._set = True
        self._waits.wake(self)

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """True once set; False when ``timeout`` seconds passed first."""
        return self._set or self._waits.pause(lambda: self._set, timeout, on=(self,))


def of(events: Any) -> Waits:
    """The waits of a transport's node (``Events.waits``); events without any (a test's
    stand-in) get their own, kept on them, so a transport's waits and wake-ups meet."""
    found = getattr(events, "waits", None)
    if found is None:
        found = Waits()
        try:
            events.waits = found
        except AttributeError:  # (slots): unshared, but still bounded by the re-check
            pass
    return found


def sleep(seconds: float) -> None:
    """Pause this thread (pacing: a launcher's startup interval, a retry's back-off)."""
    time.sleep(max(0.0, seconds))


def join(worker: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` for a thread or process to end; True when it did."""
    worker.join(max(0.0, timeout))
    return not worker.is_alive()


def result(future: Any, timeout: float) -> Any:
    """A concurrent future's result within ``timeout`` seconds (its exception raised; the
    builtin TimeoutError when it is not done in time)."""
    return future.result(timeout=max(0.0, timeout))


def forever() -> float:
    """A deadline far away, for waits that end only on their condition, a peer or a stop."""
    return time.monotonic() + _FOREVER
