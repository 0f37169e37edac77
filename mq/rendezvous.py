"""Rendezvous: nodes publish what peers need to know through a key-value store, so nobody
writes attach lists by hand. The one exchange every backend uses: nng publishes its addresses,
torchrpc its locality descriptor (before ``init_rpc``, which fixes TensorPipe's transports).

``init_method`` forms (the same as torch.distributed):

- ``tcp://host:port`` — node 0 hosts the store: mq's own (:mod:`mq.store`: no torch import),
  or, for torch RPC (``shared``), torch's TCPStore, which ``init_rpc`` then shares.
- ``env://`` — MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment.
- ``file:///shared/path`` — a torch FileStore on a filesystem every node sees.
- ``ray://GROUP`` — nodes in Ray actors: Ray tells them node 0's ``tcp://`` store
  (:mod:`mq.integrations.ray`; resolved by ``mq.create``).

Each node writes ``<run>/<node_id>`` = msgpack(info), signed with the job secret
(:func:`sign_entry`: anyone who reaches the store can write it), and waits for the others; it
then dials the peers its topology names (:func:`attach_targets`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping
from urllib.parse import urlparse

import msgpack

from mq.auth import seal, unseal
from mq.errors import ConfigError, ProtocolError, Timeout
from mq.options import TOPOLOGIES, check_choice
from mq.store import Missing, StoreClient, StoreServer

log = logging.getLogger("mq.rendezvous")
_RAY_GROUP = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@dataclass(frozen=True)
class InitMethod:
    scheme: str  # tcp | file | ray (path: the group)
    host: str = ""
    port: int = 0
    path: str = ""
    rank: int | None = None
    world_size: int | None = None


def parse_init_method(init_method: str, environ: Mapping[str, str] | None = None) -> InitMethod:
    """Parse ``tcp://host:port``, ``env://``, ``file://path`` or ``ray://GROUP``.

    Raises:
        ConfigError: the form is wrong or env:// variables are missing.
    """
    env = os.environ if environ is None else environ
    if not isinstance(init_method, str):
        raise ConfigError(f"init_method must be a string such as tcp://127.0.0.1:29500, got {init_method!r}")
    if init_method.startswith("env://"):
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ConfigError(f"init_method env:// needs {', '.join(missing)} set in the environment "
                              "(and RANK, WORLD_SIZE unless given as options)")
        rank = _int_env(env, "RANK")
        world = _int_env(env, "WORLD_SIZE")
        return InitMethod("tcp", env["MASTER_ADDR"], _port(env["MASTER_PORT"], init_method), rank=rank,
                          world_size=world)
    if init_method.startswith("tcp://"):
        parsed = urlparse(init_method)
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise ConfigError(f"init_method {init_method!r} needs a host and a port, e.g. tcp://10.0.0.1:29500")
        return InitMethod("tcp", parsed.hostname, port)
    if init_method.startswith("file://"):
        path = init_method[len("file://"):]
        if not path:
            raise ConfigError(f"init_method {init_method!r} needs a path, e.g. file:///tmp/mq-rendezvous")
        return InitMethod("file", path=path)
    if init_method.startswith("ray://"):  # resolved to a tcp:// store by mq.create (mq.integrations.ray)
        group = init_method[len("ray://"):]
        if not _RAY_GROUP.match(group):
            raise ConfigError(f"init_method {init_method!r}: the group after ray:// must be 1-100 letters, "
                              "digits, '_', '.' or '-', the same on every node of the job (e.g. ray://my-job)")
        return InitMethod("ray", path=group)
    raise ConfigError(f"init_method {init_method!r} must start with tcp://, env://, file:// or ray://")


def attach_targets(node_id: int, node_ids: list[int], topology: str) -> list[int]:
    """Which peers a node dials: mesh dials every lower id (each pair once), star dials the
    lowest id (the hub), alone dials nobody."""
    check_choice(topology, "topology", TOPOLOGIES)
    ids = sorted(node_ids)
    if topology == "mesh":
        return [i for i in ids if i < node_id]
    if topology == "star":
        return [ids[0]] if ids and ids[0] != node_id else []
    return []


class Rendezvous:
    """One node's handle on the store; node 0 hosts a TCP store and keeps it while it runs.

    Args:
        init_method: where the store is (see the module docstring).
        node_id: this node's rank in the store.
        world_size: how many nodes write; default: ``WORLD_SIZE`` of ``env://``.
        timeout: seconds to reach the store, and for every node to write.
        run: the key prefix (one per kind of entry).
        what: what an entry holds, for the log line that refuses a forged one.
        shared: open the store the way ``torch.distributed``'s own rendezvous does (a
            multi-tenant TCPStore), so a later ``init_rpc`` on the same address shares node 0's
            server instead of binding the port twice.

    Raises:
        ConfigError: a bad ``init_method`` or ``world_size``, or node 0 cannot host the store.
        Timeout: the store could not be reached within ``timeout``.
    """

    def __init__(self, init_method: str, node_id: int, world_size: int | None, *, timeout: float,
                 run: str = "mq", what: str = "rendezvous entry", shared: bool = False):
        spec = parse_init_method(init_method)
        self.world_size = world_size if world_size is not None else spec.world_size
        if not self.world_size or self.world_size < 1:
            raise ConfigError(f"init_method {init_method!r} needs world_size >= 1 (option world_size= "
                              "or WORLD_SIZE for env://)")
        if not 0 <= node_id < self.world_size:
            raise ConfigError(f"node_id {node_id} must be in [0, world_size={self.world_size}) with init_method")
        self.node_id = node_id
        self.init_method = init_method
        self.timeout = timeout
        self.prefix = f"{run}/"
        self.what = what
        try:
            self.store = _open_store(spec, init_method, node_id, self.world_size, timeout, shared)
        except Timeout as exc:
            raise Timeout(f"node {node_id}: rendezvous at {init_method} failed within {timeout:g}s: {exc} "
                          "(is node 0 running, with the same init_method and world_size?)") from None
        except (RuntimeError, ValueError, OSError) as exc:
            text = str(exc)
            if "address already in use" in text.lower() or "EADDRINUSE" in text:
                raise ConfigError(f"node {node_id}: cannot host the rendezvous store at "
                                  f"{init_method}: the port is in use; pick a free port") from None
            first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
            raise Timeout(f"node {node_id}: rendezvous at {init_method} failed within {timeout:g}s: "
                          f"{first} (is node 0 running, with the same init_method and "
                          "world_size?)") from exc

    def exchange(self, info: dict[str, Any], secret: Any = None) -> dict[int, Any]:
        """Publish ``info`` and return every node's info by node id. With the job ``secret``
        (:class:`mq.auth.Secret`) values are signed, and a value a stranger planted is refused.

        Raises:
            Timeout: a node did not write within ``timeout`` (the message names them).
            ProtocolError: an entry is not signed with the job's secret.
        """
        self.store.set(f"{self.prefix}{self.node_id}", sign_entry(secret, info))
        keys = [f"{self.prefix}{i}" for i in range(self.world_size)]  # type: ignore[arg-type]  # __init__ checked it
        try:
            values = self.store.gather(keys, self.timeout)
        except Missing as exc:
            missing = [k[len(self.prefix):] for k in exc.keys]
            raise Timeout(f"node {self.node_id}: nodes {', '.join(missing)} did not join the rendezvous "
                          f"within {self.timeout:g}s (stage rendezvous; world_size={self.world_size}, "
                          f"init_method={self.init_method}): are all nodes started?") from None
        if self.node_id != 0:
            self.close()  # joined: one socket less (node 0 serves the store until it stops)
        return {i: open_entry(secret, value, f"node {i}'s {self.what}") for i, value in enumerate(values)}

    def close(self) -> None:
        """Let the store go (node 0: stop serving it; a node may close once it has joined)."""
        self.store.close()


class _TorchStore:
    """A torch store (TCPStore, FileStore) behind the two calls a rendezvous makes."""

    def __init__(self, store: Any):
        self.torch_store = store

    def set(self, key: str, value: bytes) -> None:
        self.torch_store.set(key, value)

    def gather(self, keys: list[str], timeout: float) -> list[bytes]:
        try:
            self.torch_store.wait(keys, timedelta(seconds=timeout))
        except RuntimeError:
            raise Missing([k for k in keys if not self.torch_store.check([k])]) from None
        return [self.torch_store.get(k) for k in keys]

    def close(self) -> None:
        pass  # (torch keeps it while anything refers to it: init_rpc may share it)


class _MqStore:
    """mq's own store (:mod:`mq.store`); node 0 also serves it."""

    def __init__(self, spec: InitMethod, node_id: int, world_size: int, timeout: float):
        self.server = StoreServer(spec.port, world_size) if node_id == 0 else None
        try:
            self.client = StoreClient(spec.host, spec.port, timeout)
        except BaseException:
            self.close()
            raise

    def set(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def gather(self, keys: list[str], timeout: float) -> list[bytes]:
        return self.client.wait(keys, timeout)

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.server is not None:
            self.server.close()


def _open_store(spec: InitMethod, init_method: str, node_id: int, world_size: int, timeout: float,
                shared: bool) -> Any:
    if spec.scheme == "tcp" and not shared:
        return _MqStore(spec, node_id, world_size, timeout)
    import torch.distributed as dist  # heavy: only where torch's own store is wanted

    wait = timedelta(seconds=timeout)
    if shared:
        store = next(dist.rendezvous(init_method, rank=node_id, world_size=world_size, timeout=wait))[0]
        store.set_timeout(wait)
        return _TorchStore(store)
    return _TorchStore(dist.FileStore(spec.path, world_size))


def sign_entry(secret: Any, info: Any) -> bytes:
    """``info`` as mq writes it to a store: msgpack, signed with the job ``secret`` (None:
    unsigned, for insecure jobs)."""
    return seal(secret, msgpack.packb(info, use_bin_type=True))


def open_entry(secret: Any, blob: bytes, what: str) -> Any:
    """A :func:`sign_entry` value read back, its signature checked before msgpack sees it.

    Anyone who reaches the store can write it, so a value not signed with the job's secret is
    refused, and logged as the attack (or misconfiguration) it is, never decoded.

    Raises:
        ProtocolError: the signature is wrong.
    """
    try:
        data = unseal(secret, blob, what)
    except ProtocolError:
        log.warning("refused %s: not signed with this job's secret (a stranger wrote it, or that "
                    "node has another secret)", what)
        raise
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r} must be a non-negative integer")
    return int(value)


def _port(text: str, where: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"port {text!r} in {where} must be 1-65535")
    return int(text)
