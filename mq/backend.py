"""What a backend tells mq about itself: one :class:`Backend` object, exported as ``BACKEND`` by
its package (``mq/backends/<name>/__init__.py``, or an installed package registered in the
``mq.backends`` entry-point group). The registry (:mod:`mq.registry`) finds them; ``mq.create``,
the launcher (``mq run``), ``mq doctor`` and the conformance suite ask the object and never
name a backend. A new backend is one folder (or one package) and nothing else.

The object is cheap to import: it names its transport as ``"module:Class"``, imported only when
a node is made (torch RPC is heavy), and its launch profile and doctor section are plain objects
of its own package.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from mq.errors import ConfigError

if TYPE_CHECKING:
    from mq.locality import Locality
    from mq.platforms import PlatformPlan

__all__ = ["Backend", "ConformanceCase", "Flag", "LaunchProfile", "LocalJob", "import_ref"]


def import_ref(ref: str) -> Any:
    """The object ``"package.module:Name"`` names (imported now)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


Options = dict[int, dict[str, Any]]


@dataclass(frozen=True)
class LocalJob:
    """This machine's workers under ``--platform local``, as the launcher checked them."""

    node_ids: list[int]
    world_size: int
    topology: str
    address: str
    ports: list[int]  # one per worker, or empty: none given
    attach_to: list[str]  # extra addresses every worker dials
    init_method: str | None
    pick_port: Callable[[str], int]  # a free port on an address, when the backend needs one

    def pick_ports(self, count: int) -> list[int]:
        """``count`` different free ports on the job's address (picked one by one, two picks
        can be the same port: two workers would then try to listen on it)."""
        ports: list[int] = []
        for _ in range(64 * count):
            port = self.pick_port(self.address)
            if port not in ports:
                ports.append(port)
            if len(ports) == count:
                return ports
        raise ConfigError(f"could not find {count} different free ports on {self.address}: give --ports")


class LaunchProfile(Protocol):
    """How the launcher (``mq run``, :mod:`mq.launch`) starts a backend's workers; it never
    branches on the mq type itself."""

    def local_options(self, job: LocalJob) -> Options:
        """Each worker's connection options for a job on this machine."""

    def platform_options(self, plan: PlatformPlan, init_method: str | None) -> Options:
        """Each worker's connection options for a Slurm or k8s plan."""

    def check_platform(self, plan: PlatformPlan, init_method: str | None) -> None:
        """ConfigError for a given option that the platform's plan contradicts."""

    def binds_plan_ports(self) -> bool:
        """Whether the workers listen on the plan's ports (the launcher checks them first)."""

    def check_worker_options(self, mq_type: str, node_id: int, options: dict[str, Any]) -> None:
        """ConfigError for a worker's options that cannot work here (checked for the first
        worker on this machine, before any starts)."""

    def relays_abort(self, topology: str) -> bool:
        """Whether a worker that got a job abort must pass it on to its own peers."""


@dataclass(frozen=True)
class Flag:
    """One of the backend's transport options that ``mq run`` offers as a flag (``--protocol``).

    The flag's name is the option's with dashes; a bool option becomes a ``--x/--no-x`` switch.
    Its help is the option's own, from the options type's docstring (``Args:``), unless given.

    Attributes:
        option: the field of the backend's options type the flag sets.
        metavar: how ``--help`` shows the value (``auto|tcp|ipc``).
        parse: the flag's text -> the option's value (for list options such as ``0,1``).
        check: validates a value given to the launcher (flag or ``mq.launch`` keyword) before
            any worker starts; returns it (normalized) or raises ConfigError.
    """

    option: str
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    check: Callable[[Any], Any] | None = None

    @property
    def cli_name(self) -> str:
        return "--" + self.option.replace("_", "-")


@dataclass(frozen=True)
class ConformanceCase:
    """One way the conformance suite (:mod:`mq.conformance`, ``tests/test_conformance.py``)
    runs a backend: its nodes made with ``options`` of ``mq_type``, each peer on ``route``.

    Attributes:
        id: the case's name in test ids (``nng-tcp``).
        mq_type: one of the backend's mq types.
        route: the route kind every peer must get (the data path's, ``shm``, where one takes
            the large buffers).
        options: the transport options the case fixes (``{"protocol": "tcp"}``).
    """

    id: str
    mq_type: str
    route: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Backend:
    """A backend as mq sees it.

    Attributes:
        name: the family (``nng``); its mq types are ``name`` or ``name:variant``.
        mq_types: each mq type and the transport options it fixes (``{"torchrpc:cpu":
            {"device": "cpu"}}``).
        transport: ``"module:Class"`` of its :class:`mq.transport.Transport`, whose ``Options``
            (a frozen dataclass) are the type's own options.
        options: ``"module:Class"`` of that options type, importable without the transport (the
            launcher and CLI read its fields and docs).
        routes: the route kinds its transport carries (:data:`mq.routing.ROUTE_KINDS`).
        data_paths: the data paths whose descriptors it carries to same-host peers (``shm``:
            the route ``shm``, where this host's pool works and the peer can open it).
        summary: one line for ``mq run --help`` and ``mq doctor``.
        aliases: other names of its mq types (``torchrpc`` -> ``torchrpc:cpu``).
        launch: how ``mq run`` starts its workers (:class:`LaunchProfile`);
            None: its nodes live in one process and cannot be launched.
        one_per_process: a process holds at most one of its listening nodes (torch RPC: one
            agent per process), so a library that runs nodes of its own beside the user's
            (TorchRL's weight sync) cannot use it.
        flags: the options ``mq run`` offers as flags.
        trust: ``"module:NAME"`` of a dict of what it leaves open that mq cannot close
            (``summary`` and details, shown by ``mq doctor``), or None.
        doctor: ``"module:function"``; ``function(me, peers) -> dict`` is its own section of
            ``mq doctor`` (JSON-safe), given this node and a sample peer per place (``local``,
            ``remote``); its ``rows`` (``[[component, status], ...]``) go into the table.
        conformance: the ways the conformance suite runs it (each route it must give its
            peers); a launchable backend's nodes are processes ``mq.launch`` starts.
        nodes: for a backend that cannot be launched, ``"module:function"`` making its nodes
            of one process for the conformance suite (:data:`mq.testing.MakeNodes`).
    """

    name: str
    mq_types: Mapping[str, Mapping[str, Any]]
    transport: str
    options: str
    routes: frozenset[str]
    summary: str
    data_paths: frozenset[str] = frozenset({"shm"})
    aliases: Mapping[str, str] = field(default_factory=dict)
    launch: LaunchProfile | None = None
    one_per_process: bool = False
    flags: tuple[Flag, ...] = ()
    trust: str | None = None
    doctor: str | None = None
    conformance: tuple[ConformanceCase, ...] = ()
    nodes: str | None = None

    def __post_init__(self) -> None:
        bad = [t for t in self.mq_types if t != self.name and not t.startswith(self.name + ":")]
        if bad or not self.mq_types:
            raise ValueError(f"backend {self.name!r}: mq types must be {self.name!r} or "
                             f"{self.name}:<variant>, got {sorted(self.mq_types)}")
        foreign = [c.mq_type for c in self.conformance if c.mq_type not in self.mq_types]
        if foreign:
            raise ValueError(f"backend {self.name!r}: conformance cases name mq types it lacks: {foreign}")
        if self.conformance and self.launch is None and self.nodes is None:
            raise ValueError(f"backend {self.name!r} cannot be launched: its conformance cases need "
                             "nodes='module:function' making its nodes in one process")

    def transport_class(self) -> type:
        return import_ref(self.transport)

    def flag_help(self, option: str) -> str:
        """The first sentence of ``option``'s entry under ``Args:`` in the options docstring."""
        doc, _ = _options_source(self.options)
        m = re.search(rf"^\s*{re.escape(option)}: (.+?)(?:\n\s*\w+: |\n\s*\n|\Z)", doc, re.M | re.S)
        if not m:
            return ""
        text = re.sub(r":\w+:`~?([^`]+)`|``([^`]+)``", lambda g: g.group(1) or g.group(2), " ".join(m.group(1).split()))
        return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]

    def flag_is_switch(self, option: str) -> bool:
        """Whether the option is a bool (its flag is ``--x/--no-x``)."""
        return _options_source(self.options)[1].get(option) == "bool"

    def trust_notes(self) -> dict[str, str]:
        return dict(import_ref(self.trust)) if self.trust else {}

    def doctor_section(self, me: Locality, peers: Mapping[str, Locality]) -> dict[str, Any]:
        return import_ref(self.doctor)(me, peers) if self.doctor else {}


@functools.cache
def _options_source(ref: str) -> tuple[str, dict[str, str]]:
    """(docstring, {field: annotation}) of the options class ``ref``, read from its source
    without importing it: ``mq --help`` must not load torch for torchrpc's options."""
    module, _, name = ref.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return "", {}
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            fields = {n.target.id: ast.unparse(n.annotation) for n in node.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            return ast.get_docstring(node) or "", fields
    return "", {}
