"""The nng transport's options (:class:`NngOptions`) and its address grammar (:func:`check_address`).

Validated once, when the options are made: every bad value is a
:class:`~mq.errors.ConfigError` naming the option and the fix. The common options
(``timeout``, ``queue_size``, ...) are :class:`mq.MQ`'s, routed there by :func:`mq.create`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from mq.errors import ConfigError
from mq.backends.nng import PROTOCOLS
from mq.options import TOPOLOGIES, check_bool, check_choice, check_int

_SCHEMES = ("tcp://", "tls+tcp://", "ipc://", "abstract://", "inproc://")
_DEFAULT_LISTEN = "tcp://127.0.0.1:0"


def check_address(address: str, what: str = "address") -> str:
    """Validate an NNG address such as ``tcp://127.0.0.1:50515``; returns it unchanged."""
    if not isinstance(address, str) or not address.startswith(_SCHEMES):
        raise ConfigError(f"{what} {address!r} must start with one of {', '.join(_SCHEMES)} "
                          "(e.g. tcp://127.0.0.1:50515)")
    if address.startswith(("tcp://", "tls+tcp://")):
        host, sep, port = address.partition("://")[2].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"{what} {address!r} needs a host and a port 0-65535, e.g. tcp://127.0.0.1:50515")
    elif address.rstrip("/").endswith(("ipc:", "abstract:", "inproc:")) or address.endswith("://"):
        raise ConfigError(f"{what} {address!r} needs a path or name after the scheme")
    return address


@dataclass(frozen=True)
class NngOptions:
    """The ``nng`` mq type's own options (see :func:`mq.create` for the common ones).

    Args:
        listen_to: this node's TCP address (``tcp://host:port``). Default: an ephemeral port on
            127.0.0.1 (peers on other hosts then cannot dial back: give a routable address).
        attach_to: addresses of peers to join (a list, or one comma-separated str). The peers
            dial back, so one side is enough.
        protocol: ``auto`` (best route per peer: ``shm`` on the same host), ``tcp`` or ``ipc``
            (force that socket for every peer except peers in this process, bytes included).
        send_buffer: frames queued per peer behind a busy pipe before ``send`` waits.
        batch_window: seconds (opt-in, e.g. ``100e-6``). A frame sent to a peer this soon
            after the previous one, with nothing received meanwhile (a stream, not
            request/reply), queues behind it and leaves batched from the peer's flusher thread;
            0 (the default) batches only behind a full pipe.
        init_method: ``tcp://host:port``, ``env://``, ``file://path`` or ``ray://GROUP`` (nodes
            in Ray actors): find peers through a rendezvous store instead of ``attach_to``
            (needs ``world_size``).
        world_size: with ``init_method``, the number of nodes.
        topology: with ``init_method``, which peers to dial: ``mesh``, ``star`` or ``alone``.
        tls: ``{"cert": path, "key": path, "ca": path}`` (PEM files): links between hosts use
            TLS (``tls+tcp://``), both ends proving a certificate signed by ``ca``. Same-host
            routes (shm, ipc, inproc) do not leave the host and stay as they are.
        unix_links: same-host peers (routes ``shm`` and ``ipc``) talk over unix SEQPACKET
            sockets (:mod:`mq.backends.nng.links.unix`), where a frame wakes the receiving thread
            directly (about half the round trip of NNG's ipc for small messages); False: NNG's
            ipc socket (the only one that batches, see ``batch_window``). Both ends must have
            it on; else NNG's ipc is used.
        tcp_links: peers on other hosts (route ``tcp``) talk over TCP sockets of mq's own
            (:mod:`mq.backends.nng.links.tcp`: one thread hop per frame where NNG's tcp takes
            three), on an ephemeral port of ``listen_to``'s interface advertised in the
            handshake; NNG's port stays the one peers join at. Where that port cannot be
            reached, where TLS is on, or with ``batch_window`` set (batching is NNG's), NNG's
            tcp carries the frames.
        busy_poll: a thread waiting in ``recv()`` or ``call()`` polls its links without
            sleeping for up to 0.5 ms before it sleeps, while its recent waits were that short
            (:mod:`mq.backends.nng.busypoll`): a prompt answer is found without the cost of
            waking a sleeping thread (about half a small same-host round trip). False: every
            wait sleeps at once (an idle CPU stays idle).

    After validation ``listen_to`` is a plain ``tcp://`` address (TLS is ``tls``'s business),
    ``attach_to`` a tuple of checked addresses and ``tls_files`` the PEM texts (or None).
    """

    listen_to: str | None = None
    attach_to: Iterable[str] = ()
    protocol: str = "auto"
    send_buffer: int = 64
    batch_window: float = 0.0
    init_method: str | None = None
    world_size: int | None = None
    topology: str = "mesh"
    tls: Any = None
    unix_links: bool = True
    tcp_links: bool = True
    busy_poll: bool = True
    tls_files: dict[str, str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_choice(self.protocol, "protocol", PROTOCOLS)
        set_ = object.__setattr__  # frozen: normalized once, here
        set_(self, "listen_to", _listen_address(self.listen_to, self.tls))
        set_(self, "attach_to", _attach_addresses(self.attach_to))
        check_choice(self.topology, "topology", TOPOLOGIES)
        check_int(self.send_buffer, "send_buffer")
        if type(self.batch_window) not in (int, float) or not 0 <= self.batch_window <= 0.01:
            raise ConfigError(f"batch_window must be seconds between 0 and 0.01 (e.g. 100e-6), "
                              f"got {self.batch_window!r}")
        set_(self, "batch_window", float(self.batch_window))
        for name in ("unix_links", "tcp_links", "busy_poll"):
            check_bool(getattr(self, name), name)
        set_(self, "tls_files", _tls_files(self.tls))


def _listen_address(listen_to: Any, tls: Any) -> str:
    address = check_address(listen_to, "listen_to") if listen_to else _DEFAULT_LISTEN
    if address.startswith("tls+"):  # TLS is the tls= option's business; the address is tcp
        if tls is None:
            raise ConfigError(f"listen_to {listen_to!r} wants TLS: give tls={{'cert':..., 'key':..., 'ca':...}}")
        address = address[len("tls+"):]
    if not address.startswith("tcp://"):
        raise ConfigError(f"listen_to {listen_to!r} must be a tcp:// address (ipc and inproc "
                          "addresses are made by mq itself)")
    return address


def _attach_addresses(attach_to: Any) -> tuple[str, ...]:
    if isinstance(attach_to, str):
        attach_to = [a for a in attach_to.split(",") if a]
    if not hasattr(attach_to, "__iter__"):
        raise ConfigError(f"attach_to must be a list of addresses such as "
                          f"['tcp://10.0.0.1:50515'], got {attach_to!r}")
    return tuple(check_address(a, "attach_to address") for a in attach_to)


def _tls_files(tls: Any) -> dict[str, str] | None:
    """Read the PEM files named by the ``tls`` option; ConfigError naming what is wrong."""
    if tls is None:
        return None
    if not isinstance(tls, dict) or set(tls) != {"cert", "key", "ca"}:
        raise ConfigError(f"tls must be {{'cert': path, 'key': path, 'ca': path}} (PEM files), got {tls!r}")
    out = {}
    for name, path in tls.items():
        try:
            with open(path) as f:
                out[name] = f.read()
        except (OSError, TypeError) as exc:
            raise ConfigError(f"tls {name} file {path!r} cannot be read: {exc}") from None
    return out
