"""TorchRL on mq: a weight-sync scheme, ``WeightSyncScheme.from_backend("mq")``.

Importing this module registers :class:`MQWeightSyncScheme` as TorchRL's backend ``"mq"``::

    import mq.integrations.torchrl                      # registers backend "mq"
    from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

    scheme = WeightSyncScheme.from_backend("mq")        # no arguments needed
    collector = MultiSyncCollector([make_env] * 3, policy, frames_per_batch=64, total_frames=-1,
                                   weight_sync_schemes={"policy": scheme})
    collector.update_policy_weights_()                  # every worker acts with the new weights

How it works. The trainer's end (``init_on_sender``, in the process that owns the collector)
brings up mq node 0 and listens; each receiver (a worker TorchRL started: a multiprocess
collector's worker, a distributed collector's node) brings up node ``worker + 1`` in its own
process when TorchRL connects it, joins node 0 and subscribes. The scheme's pickled state holds
the trainer's address and nothing secret: the job secret comes from ``MQ_SECRET`` or the per-user
0600 file (:mod:`mq.auth`), which the trainer makes before any worker starts, so workers of one
machine (or of hosts sharing a home) find it without it ever being printed or pickled.

An update (``send``) flattens the policy's weights (``TensorDict.from_module``) into a
manifest (sorted names, dtypes, shapes) and buckets of at most ``bucket_bytes`` (a tensor
larger than a bucket is cut into flat slices across buckets). Each bucket is
one ``publish``: one copy into the trainer's shared-memory pool for every same-host receiver; one
copy per receiver across hosts (the scheme's own nodes join the trainer only, so relays are off),
or one per host on a mesh (``mesh=True``, or a mesh job's own queue ``q=``: mq's relays). A
receiver copies each tensor of the bucket into its own parameters (in place: no second model)
and answers; the next bucket goes once every receiver answered, so a receiver holds its model
plus one bucket, whatever the model's size. ``send`` returns when every receiver applied the
whole version (TorchRL's contract: ``update_policy_weights_`` then ``state_dict`` match).

Versions and policy lag: the trainer's ``q.metrics()["policy_lag"]["torchrl.<model>"]`` (per
receiver node: trainer version minus the version it applied; ``mq top`` shows it) and
``q.metrics()["weight_sync"]`` (version, update count, p50/p99 milliseconds, bytes). Every node
the scheme starts answers ``mq top --attach-to <scheme.address>``.

Errors are mq's (:mod:`mq.errors`) and every wait is bounded by ``timeout``:

- a scheme used before its collector initialised it: :class:`~mq.errors.ConfigError`;
- a receiver that dies during an update: :class:`~mq.errors.PeerLost` naming the worker;
- a receiver whose model's parameters differ from the trainer's: :class:`~mq.errors.ConfigError`
  naming the keys (raised at the trainer, from the receiver's answer).

Wire format (topic ``torchrl.<model_id>``, msgpack plus out-of-band tensors, nothing pickled):
``{"v": version, "b": bucket, "n": buckets, "k": [names], "r": [[first, end] element of each
piece], "t": [tensors: whole, or a flat slice], "m": manifest or None}``; answers on
``torchrl.<model_id>.ack``: ``{"v": version, "b": bucket, "error": str or None, "done": whether
the version is now applied whole}``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme, register_weight_sync_backend

import mq
import mq.telemetry
from mq import auth
from mq.errors import ConfigError, MQError, PeerLost, Timeout
from mq.registry import DEFAULT_MQ_TYPE, backend_for

__all__ = ["BUCKET_BYTES", "MQWeightSyncScheme", "TIMEOUT_S"]

log = logging.getLogger("mq.integrations.torchrl")

#: Largest bucket of one update message (a receiver holds its model plus one of these).
BUCKET_BYTES = 64 << 20
#: Default bound of every wait (workers joining, one bucket's answers).
TIMEOUT_S = 60.0
TRAINER = 0  # the trainer's node id; worker w is node w + 1
_TIMES_KEPT = 256  # update durations kept for p50/p99


def flatten(weights: Any) -> dict[str, torch.Tensor]:
    """The tensors of a weights TensorDict, a state dict or a module, by dotted name."""
    if isinstance(weights, torch.nn.Module):
        weights = TensorDict.from_module(weights)
    elif isinstance(weights, dict):
        weights = TensorDict(weights, batch_size=[])
    if not isinstance(weights, TensorDictBase):
        raise ConfigError(f"weights must be a module, a TensorDict or a state dict, got {type(weights).__name__}")
    out = {}
    for key, value in weights.items(include_nested=True, leaves_only=True):
        if isinstance(value, torch.Tensor):
            out[key if isinstance(key, str) else ".".join(key)] = value
    return dict(sorted(out.items()))


def manifest(flat: dict[str, torch.Tensor]) -> list[list[Any]]:
    return [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in flat.items()]


def buckets(flat: dict[str, torch.Tensor], limit: int) -> list[list[tuple[str, int, int]]]:
    """Pieces ``(name, first, end)`` (elements of the flattened tensor) in order, in runs of at
    most ``limit`` bytes: a tensor larger than what is left of a bucket is cut, so a receiver
    never holds more than one bucket of an update, whatever its largest tensor."""
    out: list[list[tuple[str, int, int]]] = [[]]
    room = limit
    for name, t in flat.items():
        size, total, first = t.element_size(), t.numel(), 0
        while True:
            if room < size and out[-1]:
                out.append([])
                room = limit
            take = min(total - first, max(1, room // size))
            out[-1].append((name, first, first + take))
            room -= take * size
            first += take
            if first >= total:
                break
    return out


def _piece(t: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return t if (first, end) == (0, t.numel()) else t.reshape(-1)[first:end]


def differences(trainer: list[list[Any]], here: dict[str, torch.Tensor]) -> list[str]:
    """How a receiver's parameters differ from the trainer's manifest (empty: they match)."""
    mine = {name: [str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in here.items()}
    theirs = {str(e[0]): [e[1], e[2]] for e in trainer}
    out = []
    missing, extra = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
    if missing:
        out.append(f"missing here: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if extra:
        out.append(f"not in the trainer's: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    for name in sorted(set(mine) & set(theirs)):
        if mine[name] != theirs[name]:
            out.append(f"{name} is {mine[name][0]} {mine[name][1]} here, {theirs[name][0]} {theirs[name][1]} "
                       "at the trainer")
    return out


def _local_ip_towards(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Trainer:
    """The trainer's end: node 0, its receivers' answers, and one update at a time."""

    def __init__(self, q: Any, topic: str, workers: list[int], nodes: list[int], bucket_bytes: int, timeout: float):
        self.q, self.topic, self.workers, self.nodes = q, topic, list(workers), list(nodes)
        self.bucket_bytes, self.timeout = bucket_bytes, timeout
        self.version = -1
        self.applied: dict[int, int] = {}  # node -> newest version it applied
        self._answers: dict[int, tuple[int, int]] = {}  # node -> (version, bucket) it answered last
        self._errors: dict[int, str] = {}
        self._lock = threading.Lock()
        self._times: list[float] = []
        self._bytes = 0
        self._manifest: list[list[Any]] | None = None
        q.subscribe(f"{topic}.ack", self._on_answer)

    def node(self, worker: int) -> int:
        return self.nodes[worker]

    def worker(self, node: int) -> int:
        return self.nodes.index(node) if node in self.nodes else -1

    def _on_answer(self, msg: Any) -> None:
        p = msg.payload
        if not (isinstance(p, dict) and isinstance(p.get("v"), int) and isinstance(p.get("b"), int)):
            log.warning("node %d: %r: dropped a malformed answer from node %s", self.q.node_id, self.topic, msg.sender)
            return
        with self._lock:
            if p.get("error"):
                self._errors[msg.sender] = str(p["error"])
            self._answers[msg.sender] = (p["v"], p["b"])
            if p.get("done"):
                self.applied[msg.sender] = p["v"]
        self.q.waits.wake(self)
        self._report()

    def wait_joined(self) -> None:
        """Every receiver subscribed (they join as TorchRL starts them)."""
        want = len(self.workers)
        try:
            self.q.wait_for_subscribers(self.topic, want, timeout=self.timeout)
        except Timeout:
            have = self.q.wait_for_subscribers(self.topic, 0, timeout=0)
            missing = sorted(set(map(self.node, self.workers)) - set(have))
            raise Timeout(f"mq weight sync {self.topic!r}: {len(have)} of {want} collector workers joined within "
                          f"{self.timeout:g}s (missing workers "
                          f"{', '.join(str(self.worker(n)) for n in missing)}): did they fail to start? "
                          "Their logs say why; a longer MQWeightSyncScheme(timeout=...) helps slow starts") from None

    def push(self, weights: Any, workers: list[int]) -> int:
        """Send one version to ``workers`` bucket by bucket; returns when each applied it."""
        flat = flatten(weights)
        shape = manifest(flat)
        if self._manifest is not None and shape != self._manifest:
            raise ConfigError(f"mq weight sync {self.topic!r}: the weights to send differ from the first ones "
                              f"sent: {'; '.join(differences(self._manifest, flat))}. Send the same "
                              "policy's weights every time")
        self._manifest = shape
        nodes = [self.node(w) for w in workers]
        self.version += 1
        start = time.monotonic()
        names = buckets(flat, self.bucket_bytes)
        for b, part in enumerate(names):
            payload = {"v": self.version, "b": b, "n": len(names), "k": [k for k, _, _ in part],
                       "r": [[first, end] for _, first, end in part],
                       "t": [_piece(flat[k], first, end) for k, first, end in part], "m": shape if b == 0 else None}
            self._send(payload, nodes, everyone=sorted(workers) == sorted(self.workers))
            del payload
            self._wait(nodes, self.version, b, len(names))
        with self._lock:
            partial = [n for n in nodes if self.applied.get(n) != self.version]
        if partial:
            raise self._lost("it joined again during the update and skipped it (it gets the next version)",
                             {"v": self.version, "b": len(names) - 1, "n": len(names)}, partial)
        self._times = (self._times + [time.monotonic() - start])[-_TIMES_KEPT:]
        self._bytes += sum(t.numel() * t.element_size() for t in flat.values())
        self._report()
        return self.version

    def _send(self, payload: dict[str, Any], nodes: list[int], everyone: bool) -> None:
        missing: list[int] = []
        try:
            if everyone:  # one encode; same host by handle
                got = set(self.q.publish(self.topic, payload, timeout=self.timeout))
                missing = sorted(set(nodes) - got)
            else:
                for n in nodes:
                    self.q.send(n, self.topic, payload, timeout=self.timeout)
        except PeerLost as exc:
            raise self._lost(str(exc), payload, nodes) from exc
        if missing:
            raise self._lost("it no longer takes weights (it left or died)", payload, missing)

    def _wait(self, nodes: list[int], version: int, bucket: int, count: int) -> None:
        def answered() -> bool:
            with self._lock:
                if any(n in self._errors for n in nodes):
                    return True
                return all(self._answers.get(n, (-1, -1)) >= (version, bucket) for n in nodes)

        def late() -> str:
            slow = [n for n in nodes if self._answers.get(n, (-1, -1)) < (version, bucket)]
            return (f"mq weight sync {self.topic!r}: workers {', '.join(str(self.worker(n)) for n in slow)} did not "
                    f"apply bucket {bucket + 1} of {count} of version {version} within {self.timeout:g}s "
                    "(stuck or overloaded: pass a longer MQWeightSyncScheme(timeout=...))")

        try:
            self.q.waits.until(answered, time.monotonic() + self.timeout, on=(self,), peers=nodes, what=late)
        except PeerLost as exc:
            raise self._lost(str(exc), {"v": version, "b": bucket, "n": count}, nodes) from exc
        with self._lock:
            errors = {n: self._errors.pop(n) for n in nodes if n in self._errors}
        if errors:
            raise ConfigError("; ".join(f"worker {self.worker(n)} (mq node {n}): {e}" for n, e in errors.items()))

    def _lost(self, why: str, p: dict[str, Any], nodes: list[int]) -> PeerLost:
        live = set(self.q.peers())
        gone = [n for n in nodes if n not in live] or nodes
        who = ", ".join(f"worker {self.worker(n)} (mq node {n})" for n in gone)
        return PeerLost(f"mq weight sync {self.topic!r}: {who} lost during the update to version {p['v']} "
                        f"(bucket {p['b'] + 1} of {p['n']}): {why}. The others may act with either version; "
                        "restart the lost worker's collector")

    def _report(self) -> None:
        live = set(self.q.peers())
        lags = {n: self.version - v for n, v in sorted(self.applied.items()) if n in live}
        self.q.set_metric("policy_lag", {self.topic: lags})
        self.q.set_metric("weight_sync", {self.topic: {  # (cast: the percentile of some times is a float)
            "version": self.version, "updates": len(self._times), "bytes": self._bytes,
            "update_ms_p50": None if not self._times else 1e3 * cast(float, _percentile(self._times, 0.5)),
            "update_ms_p99": None if not self._times else 1e3 * cast(float, _percentile(self._times, 0.99))}})

    def update_times(self) -> list[float]:
        """Seconds each update took (the newest last; at most 256)."""
        return list(self._times)


class _Receiver:
    """A worker's end: applies each bucket to its model in place and answers."""

    def __init__(self, scheme: "MQWeightSyncScheme", q: Any, topic: str, worker: int):
        self.scheme, self.q, self.topic, self.worker = scheme, q, topic, worker
        self.version = -1  # newest version applied in full
        self.returned = -1  # newest version ``receive`` returned
        self._targets: dict[str, torch.Tensor] | None = None
        self._at = -1  # the version whose first bucket this receiver saw
        self._failed: str | None = None
        q.subscribe(topic, self._on_bucket)

    def _on_bucket(self, msg: Any) -> None:
        p = msg.payload
        if not (isinstance(p, dict) and all(isinstance(p.get(k), int) for k in ("v", "b", "n"))
                and all(isinstance(p.get(k), list) for k in ("k", "r", "t"))
                and len(p["k"]) == len(p["t"]) == len(p["r"])):
            log.warning("node %d: %r: dropped a malformed update from node %s", self.q.node_id, self.topic, msg.sender)
            return
        version, bucket, count = p["v"], p["b"], p["n"]
        error = None
        try:
            if bucket == 0:
                self._at, self._failed = version, None
                self._targets = self._resolve(p.get("m") or [])
            if self._at != version:  # joined during this version: answered, not applied (the
                pass                   # trainer names it); the next version is ours
            elif self._failed is None:
                self._apply(p["k"], p["r"], p["t"])
        except MQError as exc:
            error = self._failed = str(exc)
        except Exception as exc:  # a copy torch refused: the trainer hears why, the worker goes on
            error = self._failed = f"{type(exc).__name__}: {exc}"
        del p, msg  # the bucket's views go back to the trainer's pool before it sends the next
        done = bucket == count - 1 and self._failed is None and self._at == version
        answer = {"v": version, "b": bucket, "error": error, "done": done}
        try:  # answered before the version shows: a worker stopping as soon as receive() returns
            self.q.send(self.scheme.trainer, f"{self.topic}.ack", answer, timeout=self.scheme.timeout)
        except MQError as exc:  # has its answer queued (stop() sends it), not lost
            log.warning("node %d: %r: could not answer the trainer: %s", self.q.node_id, self.topic, exc)
        if done:
            self.version = version
            self.q.set_metric("weight_sync", {self.topic: {"version": version}})
            self.scheme._applied(version)
        self.q.waits.wake(self)

    def _resolve(self, trainer: list[Any]) -> dict[str, torch.Tensor]:
        """This worker's parameters by name, checked against the trainer's manifest; a policy
        TorchRL sent without weights (on the meta device) gets its memory here, once."""
        model = self.scheme.model
        if model is None:
            raise ConfigError(f"worker {self.worker}: no model to apply weights to (TorchRL gave the scheme "
                              "none: pass model= to init_on_receiver, or a context holding the policy)")
        here = flatten(model)
        diff = differences(trainer, here)
        if diff:
            raise ConfigError(f"this collector's policy differs from the trainer's: {'; '.join(diff)}. Build "
                              "both from the same module or policy_factory")
        if any(t.is_meta for t in here.values()) and isinstance(model, torch.nn.Module):
            real = TensorDict.from_module(model).apply(
                lambda t: torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t)
            self.scheme.strategy.apply_weights(model, real, inplace=False)
            here = flatten(model)
        return here

    def _apply(self, names: list[Any], ranges: list[Any], tensors: list[Any]) -> None:
        targets = self._targets or {}
        with torch.no_grad():
            for name, span, t in zip(names, ranges, tensors):
                target = targets.get(name) if isinstance(name, str) else None
                if target is None or not isinstance(t, torch.Tensor):
                    raise ConfigError(f"update carries {name!r}, which this collector's policy does not have")
                first, end = span if isinstance(span, list) and len(span) == 2 else (-1, -1)
                if (first, end) == (0, target.numel()) and t.shape == target.shape:
                    target.copy_(t)
                elif (isinstance(first, int) and isinstance(end, int) and 0 <= first < end <= target.numel()
                      and t.shape == (end - first,) and target.is_contiguous()):
                    target.view(-1)[first:end].copy_(t)
                else:
                    raise ConfigError(f"update carries elements {span!r} of {name!r} shaped {tuple(t.shape)}, "
                                      f"which do not fit this collector's {tuple(target.shape)} "
                                      f"{'' if target.is_contiguous() else '(non-contiguous) '}parameter")


# Copies of a scheme unpickled in this process and not set up yet. TorchRL's RPCCollector sends
# the scheme to each remote collector twice (its constructor's weight_recv_schemes, then
# register_scheme_receiver), and the collector shuts the first copy down before it sets the
# second up: the first hands its node to the second (same worker, same links, same version)
# instead of leaving the job and joining again under the same node id.
_FRESH_COPIES: "weakref.WeakSet[MQWeightSyncScheme]" = weakref.WeakSet()


@register_weight_sync_backend("mq")
class MQWeightSyncScheme(WeightSyncScheme):
    """TorchRL's weight sync over mq (see the module docstring).

    Args:
        strategy: TorchRL's ``"tensordict"`` (default) or ``"state_dict"``: how weights are
            taken from the trainer's policy.
        mq_type: the mq type of the scheme's own nodes: ``nng`` (default), ``inproc`` (one
            process, for tests), or any whose backend allows several nodes per process.
        listen_to: the trainer's address (``tcp://host:port``). Default: ``127.0.0.1`` for
            collectors on this host, this host's address (as TorchRL's distributed collectors
            use) for ``DistributedCollector`` and ``RPCCollector``; port 0 picks a free one.
        bucket_bytes: the largest message of an update (a receiver holds its model plus one).
        timeout: the bound of every wait, in seconds.
        options: more ``mq.create`` options for every node (``busy_poll=False``, ...).
        q: run over this listening :class:`mq.MQ` instead of nodes of the scheme's own (a job
            started by ``mq run``, on any mq type): the trainer's and each worker's own queue.
        nodes: with ``q``, the node id of each worker, in TorchRL's worker order.
        trainer: with ``q``, the trainer's node id.
        mesh: the scheme's nodes meet in a rendezvous the trainer hosts and link with each other,
            so a publish crosses the network once per host (mq's relays) however many receivers
            a host has. Needs every worker started before the trainer connects (TorchRL's
            multiprocess and distributed collectors do; an ``RPCCollector`` does not).
    """

    def __init__(self, strategy: str = "tensordict", *, mq_type: str = DEFAULT_MQ_TYPE, listen_to: str | None = None,
                 bucket_bytes: int = BUCKET_BYTES, timeout: float = TIMEOUT_S, options: dict[str, Any] | None = None,
                 q: Any = None, nodes: list[int] | None = None, trainer: int = TRAINER, mesh: bool = False):
        super().__init__(strategy)
        backend = backend_for(mq_type)  # (ConfigError for an unknown type)
        if backend.one_per_process:
            raise ConfigError(f"MQWeightSyncScheme(mq_type={mq_type!r}): the scheme runs nodes of its own beside "
                              f"TorchRL's, and {backend.name} allows one per process (torch RPC's one agent belongs "
                              f"to TorchRL here); use {DEFAULT_MQ_TYPE!r}")
        self._spans_processes = backend.launch is not None  # (not: nodes of one process, for tests)
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1 << 16:
            raise ConfigError(f"bucket_bytes must be an int >= 65536, got {bucket_bytes!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if options and ({"secret", "node_id", "attach_to"} & set(options)):
            raise ConfigError("MQWeightSyncScheme(options=...) takes mq.create options other than secret, "
                              "node_id and attach_to: the secret comes from MQ_SECRET or the per-user file, "
                              "ids and addresses from the scheme")
        self.mq_type, self.listen_to = mq_type, listen_to
        self.bucket_bytes, self.timeout = bucket_bytes, float(timeout)
        self.options = dict(options or {})
        self._address: str | None = None  # the trainer's, once it listens
        self._workers: list[int] = []
        self._rank_base = 0  # receivers numbered from 1 (torch.distributed ranks) in distributed collectors
        self._q: Any = q
        self._owns_q = q is None  # a queue given is the caller's to stop
        self.trainer = trainer
        self._nodes = list(nodes) if nodes is not None else None
        if q is not None and not getattr(q, "running", False):
            raise ConfigError("MQWeightSyncScheme(q=...) needs a listening queue (q.listen(), or a `with q:` block)")
        self._trainer: _Trainer | None = None
        self._receiver: _Receiver | None = None
        self._early = False  # sent to workers before init_on_sender (they do not wait for version 0)
        self.mesh = bool(mesh) and q is None and self._spans_processes
        self._mesh_at: str | None = None  # the mesh's rendezvous (init_method)
        self._trainer_nodes: list[int] = []
        self._unpickled = False
        self._inherited: tuple[Any, _Receiver] | None = None  # a first copy's node (see _FRESH_COPIES)

    # ------------------------------------------------------------------ properties
    @property
    def q(self) -> Any:
        """This end's :class:`mq.MQ` (None before it started): ``scheme.q.metrics()``."""
        return self._q

    @property
    def address(self) -> str | None:
        """The trainer's address (``mq top --attach-to`` it), once its end started."""
        q = self._q
        return q.addresses.get("tcp", self._address) if q is not None and self._owns_q else self._address

    @property
    def topic(self) -> str:
        return f"torchrl.{self._model_id or 'policy'}"

    def metrics(self) -> dict[str, Any]:
        """This end's mq metrics (``policy_lag``, ``weight_sync``, routes, ...)."""
        if self._q is None:
            raise ConfigError(self._not_started("metrics"))
        return self._q.metrics()

    def update_times(self) -> list[float]:
        """Seconds each update took at the trainer (newest last)."""
        return [] if self._trainer is None else self._trainer.update_times()

    # ------------------------------------------------------------------ the trainer's end
    def _init_on_sender_impl(self, *, model_id: str | None = None, context: Any = None, num_workers: int | None = None,
                             model: Any = None, weights: Any = None, **_ignored: Any) -> None:
        self.model_id = model_id or "policy"
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        if weights is not None:
            self.weights = weights
        n = num_workers if num_workers is not None else getattr(context, "num_workers", None)
        if n is None and self._nodes is not None:
            n = len(self._nodes)
        if not isinstance(n, int) or n < 1:
            raise ConfigError("MQWeightSyncScheme.init_on_sender needs num_workers (or a collector as context "
                              f"that has num_workers), got {n!r}")
        self._workers = list(range(n))
        self._rank_base = 1 if type(context).__name__ in ("DistributedCollector", "DistributedSyncCollector") else 0
        nodes = self._nodes if self._nodes is not None else [w + 1 for w in self._workers]
        if len(nodes) != n or self.trainer in nodes:
            raise ConfigError(f"MQWeightSyncScheme(nodes={nodes}) must name {n} workers' node ids, "
                              f"none of them the trainer's ({self.trainer})")
        self._trainer_nodes = nodes
        if self._q is None and self.mesh:
            # Every node meets in a rendezvous the trainer hosts: its listen waits for all the
            # workers, so it starts in connect(), once TorchRL started them.
            listen = self._trainer_listen(context)
            assert listen is not None  # a mesh spans processes: an address
            host = listen.partition("://")[2].rpartition(":")[0]
            self._address = self._mesh_at = f"tcp://{host}:{_free_port(host)}"
            auth.resolve_secret()
            return
        q = self._q if self._q is not None else self._start_trainer(context)
        self._trainer = _Trainer(q, self.topic, self._workers, nodes, self.bucket_bytes, self.timeout)

    def _start_trainer(self, context: Any) -> Any:
        auth.resolve_secret()  # made here, once, before workers start (they read the same 0600 file)
        q = self._make_node(TRAINER, {"torchrl-trainer"}, (), self._trainer_listen(context), **self._meeting())
        self._address = self._mesh_at or q.addresses.get("tcp") or q.addresses.get("inproc")
        return q

    def _meeting(self) -> dict[str, Any]:
        """A mesh's mq.create options: the rendezvous, its size, everybody dials everybody."""
        if not self._mesh_at:
            return {}
        return {"init_method": self._mesh_at, "world_size": len(self._workers) + 1, "topology": "mesh"}

    def _trainer_listen(self, context: Any) -> str | None:
        if not self._spans_processes:
            return self.listen_to
        if self.listen_to:
            return self.listen_to
        distributed = type(context).__module__.startswith("torchrl.collectors.distributed")
        host = socket.gethostbyname(socket.gethostname()) if distributed else "127.0.0.1"
        return f"tcp://{host}:0"

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                     weights: Any = None) -> None:
        if self._trainer is None:  # a mesh: the rendezvous waits for every worker
            q = self._start_trainer(self.context)
            self._trainer = _Trainer(q, self.topic, self._workers, self._trainer_nodes, self.bucket_bytes,
                                     self.timeout)
        self._trainer.wait_joined()
        self._trainer.push(weights if weights is not None else self._current_weights(), self._workers)

    def _current_weights(self) -> Any:
        prepared = self.prepare_weights(weights=None, model_id=self._model_id, strategy=self._strategy,
                                        context=self.context)
        if prepared is not None:
            return prepared
        if self._model_ref is not None:
            model = self._model_ref()
            if model is None:
                raise ConfigError("MQWeightSyncScheme: the trainer's policy was garbage-collected (the scheme holds "
                                  "it weakly, as TorchRL's schemes do): keep a reference to it")
            return self._strategy.extract_weights(model)
        weights = getattr(self, "_weights", None)
        if weights is None:
            raise ConfigError("MQWeightSyncScheme: no weights to send: give init_on_sender model= or weights=, "
                              "or a collector (context) that holds the policy")
        return weights

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Send the policy's weights (or ``weights``) to every worker (or ``worker_ids``);
        returns once each applied them.

        Raises:
            ConfigError: the scheme was not set up by a collector yet, or a worker's policy differs.
            PeerLost: a worker died during the update.
            Timeout: a worker did not apply a bucket within ``timeout``.
        """
        if not (self.initialized_on_sender and self.synchronized_on_sender) or self._trainer is None:
            raise ConfigError(self._not_started("send"))
        if weights is None:
            prepared = self._current_weights()
        else:
            prepared = self.prepare_weights(weights=weights, model_id=self._model_id, strategy=self._strategy,
                                            context=self.context)
        if worker_ids is None:
            workers = self._workers
        else:
            workers = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        unknown = sorted(set(workers) - set(self._workers))
        if unknown:
            raise ConfigError(f"worker_ids {unknown} are not workers of this collector (0 to {len(self._workers) - 1})")
        self._trainer.push(prepared, workers)

    def _not_started(self, what: str) -> str:
        return (f"MQWeightSyncScheme.{what}() before a collector set the scheme up: pass it to a collector "
                "(weight_sync_schemes={'policy': scheme}), which calls init_on_sender() and connect() on its "
                "start, then call collector.update_policy_weights_()")

    # ------------------------------------------------------------------ a worker's end
    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, worker_idx: int | None = None,
                               model: Any = None, **_ignored: Any) -> None:
        if self._address is None and self._owns_q:
            raise ConfigError("MQWeightSyncScheme reached a worker before its trainer end started: the collector "
                              "must call init_on_sender() before it starts its workers (MultiSyncCollector, "
                              "MultiAsyncCollector and DistributedCollector do)")
        self.model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        if worker_idx is None:
            worker_idx = getattr(context, "worker_idx", None)
        known = len(self._workers) or 1 << 20  # (unknown yet where the scheme went out before init_on_sender)
        if not isinstance(worker_idx, int) or not 0 <= worker_idx - self._rank_base < known:
            raise ConfigError(f"MQWeightSyncScheme: worker index {worker_idx!r} is not one of this collector's "
                              f"{len(self._workers)} workers")
        self._worker_idx = worker_idx
        _FRESH_COPIES.discard(self)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        worker = (self._worker_idx if worker_idx is None else worker_idx) - self._rank_base
        if self._adopt(worker):
            return
        if self._owns_q:
            assert self._address is not None  # _init_on_receiver_impl checked it
            listen = None
            if self._spans_processes:
                host = self._address.partition("://")[2].rpartition(":")[0]
                listen = f"tcp://{_local_ip_towards(host)}:0"
            attach = () if self._mesh_at else (self._address,)
            q = self._make_node(worker + 1, {"torchrl-collector"}, attach, listen, **self._meeting())
            if self._mesh_at:  # the rendezvous saw every node; relays need the links between them
                q.wait_for_peers(ids=[i for i in range(len(self._workers) + 1) if i != worker + 1],
                                 timeout=self.timeout)
        else:
            q = self._q
        self._receiver = receiver = _Receiver(self, q, self.topic, worker)
        if self._early:  # the trainer connects later (RPCCollector): weights come in the background
            return
        what = (f"worker {worker}: no weights from the trainer at {self._address} within {self.timeout:g}s "
                "(is the trainer's collector still starting its other workers?)")
        q.waits.until(lambda: receiver.version >= 0 or receiver._failed, time.monotonic() + self.timeout,
                      on=(receiver,), peers=[self.trainer], what=what)
        if receiver._failed:
            raise ConfigError(f"worker {worker}: {receiver._failed}")
        receiver.returned = receiver.version  # receive() returns versions newer than this first one

    def receive(self, timeout: float | None = None) -> Any:
        """The policy's weights once a version newer than the last returned one was applied
        (they are applied as they arrive, by the node's handler thread); None when none came
        within ``timeout`` (None: do not wait)."""
        receiver = self._receiver
        if receiver is None:
            raise ConfigError(self._not_started("receive"))
        if timeout:
            try:
                receiver.q.waits.until(lambda: receiver.version > receiver.returned, time.monotonic() + timeout,
                                       on=(receiver,), peers=[self.trainer])
            except Timeout:
                return None
        if receiver.version <= receiver.returned:
            return None
        receiver.returned = receiver.version
        return flatten(self.model) if self.model is not None else None

    def _applied(self, version: int) -> None:
        """A whole version is in the model: tell the collector that holds it (its policy version,
        or its own workers when it is a multiprocess collector inside a distributed one)."""
        context = self.context
        if context is None:
            return
        try:
            from torchrl.collectors import Collector

            if isinstance(context, Collector):
                context.increment_version()  # the weights are already in its policy
            elif hasattr(context, "update_policy_weights_") and self.model is not None:
                context.update_policy_weights_(model_id=self._model_id,
                                               policy_or_weights=TensorDict.from_module(self.model))
        except Exception as exc:  # the weights are applied; the collector's bookkeeping is its own
            log.warning("worker %s: version %d applied, but the collector refused the news: %s",
                        self._worker_idx, version, exc)

    # ------------------------------------------------------------------ both ends
    def _make_node(self, node_id: int, labels: set[str], attach: tuple[str, ...], listen: str | None,
                   **meeting: Any) -> Any:
        # Relays need the receivers of a host to be peers of each other. Without a mesh the
        # scheme's nodes join the trainer only, so a relay could not pass a bucket on (its
        # publisher would then send it again, directly): they send directly from the start.
        options: dict[str, Any] = {"timeout": self.timeout, **meeting, **self.options}
        if not meeting:
            options.setdefault("relay_min_bytes", None)
        if listen:
            options["listen_to"] = listen
        if attach:
            options["attach_to"] = list(attach)
        q = mq.create(self.mq_type, node_id=node_id, labels=labels, **options)
        q.listen()
        mq.telemetry.serve(q)  # mq top --attach-to <scheme.address> shows versions and policy lag
        self._q = q
        return q

    def create_transport(self, **kwargs: Any) -> Any:
        raise ConfigError("MQWeightSyncScheme has no per-worker transports: its mq nodes carry every worker")

    def shutdown(self) -> None:
        """Stop this end's node (bounded: a few seconds at most), or hand a worker's node to a
        copy of the scheme that replaces this one in the same process. Idempotent."""
        q, self._q = getattr(self, "_q", None), None
        inherited, self._inherited = getattr(self, "_inherited", None), None
        if inherited is not None:  # given to us, never set up: nobody else will stop it
            inherited[0].stop(timeout=2.0, raise_undelivered=False)
        if q is not None and getattr(self, "_owns_q", True) and not self._hand_over(q):
            q.stop(timeout=2.0, raise_undelivered=False)
        super().shutdown()

    def _hand_over(self, q: Any) -> bool:
        """Give this worker's node to a fresh copy of the scheme for the same trainer and model."""
        receiver, self._receiver = self._receiver, None
        if receiver is None:
            return False
        heir = next((s for s in list(_FRESH_COPIES) if s is not self and s._address == self._address
                     and s.topic == self.topic and s._inherited is None), None)
        if heir is None:
            return False
        _FRESH_COPIES.discard(heir)
        heir._inherited = (q, receiver)
        return True

    def _adopt(self, worker: int) -> bool:
        """Take the node a replaced copy handed over, when it is this worker's."""
        inherited, self._inherited = self._inherited, None
        if inherited is None:
            return False
        q, receiver = inherited
        if receiver.worker != worker or not q.running:
            q.stop(timeout=2.0, raise_undelivered=False)
            return False
        receiver.scheme, self._q, self._receiver = self, q, receiver
        return True

    def __getstate__(self) -> dict[str, Any]:
        if (self._q is None and self._address is None and not self._unpickled and not self.initialized_on_sender
                and not self.initialized_on_receiver):
            # An RPCCollector sends the scheme to its workers before it calls init_on_sender:
            # the trainer's end starts now, so that they know where to join.
            self._start_trainer(None)
            self._early = True
        state = super().__getstate__()
        state.update(_q=None, _trainer=None, _receiver=None, _inherited=None)  # a worker makes its own node
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._unpickled = True  # a copy never starts a trainer's end of its own
        if not self.initialized_on_receiver:
            _FRESH_COPIES.add(self)
