"""mq on Ray: nodes inside Ray actors meet through the cluster, with ``init_method="ray://GROUP"``.

    @ray.remote
    class Collector:
        def __init__(self, rank, world):
            self.q = mq.create("nng", rank, init_method="ray://my-job", world_size=world)
            self.q.listen()

Every node of a group asks Ray for one small named actor, the group's directory
(``mq-group:GROUP`` in the Ray namespace ``mq``; the first node to ask creates it, the others
find it). Node 0 publishes there the address of the rendezvous store it hosts (on its Ray node's
IP, the same store ``tcp://`` uses); every node then goes on exactly as with
that ``tcp://`` init method: entries signed with the job secret, routes chosen as always (shm
between actors on one Ray node, tcp or rdma across). Nothing of the data goes through Ray.

The job secret: ``secret=`` or ``MQ_SECRET`` when given; else the directory's own random
secret, which every node of the group reads (Ray's cluster token already decides who may talk
to the cluster, and whoever may can run code in it). The directory lives as long as the node
that created it: a group name must be unique among the jobs running on one Ray cluster.

``mq run --platform ray`` (:mod:`mq.platforms.ray`) starts every node of a job as such an actor.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any

from mq.node import waits
from mq.errors import ConfigError, Timeout
from mq.rendezvous import parse_init_method

#: The Ray namespace of mq's group directories.
NAMESPACE = "mq"
_POLL_S = (0.01, 0.2)  # a node waiting for node 0's store: first and longest poll interval


def connect(what: str, address: str | None = None, *, show_output: bool = False) -> Any:
    """The ``ray`` module, connected to a cluster: the one this process already belongs to (a
    Ray actor or driver), else ``address`` (``RAY_ADDRESS``, else a cluster started here).
    ``show_output``: the actors' stdout and stderr are printed here (``mq run``).

    Raises:
        ConfigError: Ray is not installed, or there is no cluster to join (says how to start one).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{what} needs Ray: pip install 'ray==2.60.*' (or mq's [ray] extra)") from None
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        _check_reachable(address)  # (Ray itself retries a dead address for a minute or more)
        ray.init(address=address, log_to_driver=show_output,
                 logging_level="ERROR")  # type: ignore[arg-type]  # Ray takes a level's name too
    except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"{what}: no Ray cluster to join at {address!r} ({first}); start one with "
                          "`ray start --head`, or set RAY_ADDRESS (or --ray-address) to its head") from None
    return ray


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Raises OSError when ``host:port`` takes no connection (``auto`` and ``ray://`` are Ray's)."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or "//" in host:
        return
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
        pass


def meet(init_method: str, node_id: int, world_size: Any, timeout: float) -> tuple[str, str, str]:
    """Resolve ``ray://GROUP`` for node ``node_id``: the ``tcp://`` init method of the group's
    rendezvous store (node 0 hosts it on its Ray node's IP), the group's secret, and this
    node's Ray node IP (where it listens unless told otherwise: its peers may be on other nodes).

    Raises:
        ConfigError: a bad group or world size, no Ray, or the group belongs to another job
            (another world size, or a second node 0).
        Timeout: node 0 did not publish its store within ``timeout`` (stage rendezvous).
    """
    group = parse_init_method(init_method).path  # (checked there: letters, digits, _.-)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"init_method {init_method!r} needs world_size= (the number of nodes, >= 1), "
                          f"got {world_size!r}")
    if not 0 <= node_id < world_size:
        raise ConfigError(f"node_id {node_id} must be in [0, world_size={world_size}) with init_method")
    ray = connect(f"init_method {init_method!r}")
    directory = _directory(ray, group)
    host = ray.util.get_node_ip_address()
    if node_id == 0:
        store = f"tcp://{host}:{_free_port(host)}"
        error = _ask(ray, directory.publish.remote(world_size, store), timeout, group)
        if error:
            raise ConfigError(f"node 0 of Ray group {group!r}: {error}")
    deadline = time.monotonic() + timeout
    pause = _POLL_S[0]
    while True:
        error, store, secret = _ask(ray, directory.lookup.remote(world_size), timeout, group)
        if error:
            raise ConfigError(f"node {node_id} of Ray group {group!r}: {error}")
        if store:
            return store, secret, host
        if time.monotonic() >= deadline:
            raise Timeout(f"node {node_id}: node 0 of Ray group {group!r} did not publish its rendezvous "
                          f"store within {timeout:g}s (stage rendezvous; init_method {init_method}): is "
                          "node 0 started, with the same init_method and world_size?")
        waits.sleep(pause)  # (the directory is polled: nothing wakes this thread)
        pause = min(_POLL_S[1], pause * 2)


#: The directories this process asked for, kept: Ray ends an actor once no handle to it is
#: left, and the group's later nodes must still find it.
_held: dict[str, Any] = {}


def node_options(node_id: int, takes: frozenset[str], core: dict[str, Any], ours: dict[str, Any],
                 timeout: float) -> None:
    """``mq.create``'s options of a node with ``init_method="ray://GROUP"``, completed in place:
    the init method becomes the group's ``tcp://`` store, the secret the group's (unless the
    node has ``secret=``, ``insecure=`` or ``MQ_SECRET``), and a transport that takes them listens
    on its Ray node's address (``listen_to``, ``socket_ifname``) unless told otherwise: its peers
    may be on other Ray nodes."""
    from mq.auth import ENV_VAR

    store, secret, host = meet(ours["init_method"], node_id, ours.get("world_size"), timeout)
    ours["init_method"] = store
    if core.get("secret") is None and not core.get("insecure") and not os.environ.get(ENV_VAR):
        core["secret"] = secret
    if "listen_to" in takes and not ours.get("listen_to"):
        ours["listen_to"] = f"tcp://{host}:0"
    if "socket_ifname" in takes and ours.get("socket_ifname") is None:
        ours["socket_ifname"] = interface_of(host)


def _free_port(host: str) -> int:
    from mq.platforms.plan import free_port  # (here: mq.platforms imports the rendezvous)

    return free_port(host)


def interface_of(ip: str) -> str | None:
    """The name of the network interface that has IPv4 address ``ip`` (None: none has)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def _directory(ray: Any, group: str) -> Any:
    if group in _held:  # (a second handle in the owner would let Ray end the first's actor)
        return _held[group]
    cls = ray.remote(num_cpus=0, max_restarts=0)(GroupDirectory)
    handle = cls.options(name=f"mq-group:{group}", namespace=NAMESPACE, get_if_exists=True).remote()
    _held[group] = handle
    return handle


def _ask(ray: Any, ref: Any, timeout: float, group: str) -> Any:
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise Timeout(f"the directory of Ray group {group!r} did not answer within {timeout:g}s "
                      "(is the Ray cluster overloaded?)") from None
    except ray.exceptions.RayActorError as exc:
        _held.pop(group, None)  # a later job of the same name makes a new one
        raise ConfigError(f"the directory of Ray group {group!r} is gone (the node that made it left: "
                          f"restart the whole group): {str(exc).splitlines()[0][:200]}") from None


class GroupDirectory:
    """The actor behind ``ray://GROUP``: where node 0 publishes its store, and the group's secret."""

    def __init__(self) -> None:
        self.world_size: int | None = None
        self.store: str | None = None
        self.secret = secrets.token_hex(16)

    def publish(self, world_size: int, store: str) -> str | None:
        """Node 0's store; an error text when the group is another job's."""
        if self.store is not None:
            return (f"the group already has a node 0 (its store is {self.store}): two jobs use the same "
                    "group name, or node 0 was started twice; give each job its own ray://GROUP")
        mismatch = self._mismatch(world_size)
        if mismatch:
            return mismatch
        self.world_size, self.store = world_size, store
        return None

    def lookup(self, world_size: int) -> tuple[str | None, str | None, str]:
        """(error, store or None while node 0 has not published, secret)."""
        return self._mismatch(world_size), self.store, self.secret

    def _mismatch(self, world_size: int) -> str | None:
        if self.world_size is not None and world_size != self.world_size:
            return (f"world_size {world_size} differs from node 0's {self.world_size}: every node of a "
                    "group must give the same world_size")
        return None
