"""TensorDict payloads: a ``tensordict`` object <-> a plain tree the codec packs like any other.

The codec (:mod:`mq.wire.codec`) calls :func:`to_tree` for a value whose class comes from the
``tensordict`` package and packs the tree it returns as one msgpack extension; its tensors are
ordinary leaves, so they travel out of band (shm, nvlink, rdma) like any tensor, and nothing is
pickled. On receive :func:`from_tree` rebuilds the object. ``tensordict`` is imported only when a
TensorDict is sent or received: ``import mq`` never imports it.

Trees (lists, the first item names the kind):

- ``["td", batch_size, device, names, {key: value}]``: a ``TensorDict``; values are tensors,
  nested trees or plain msgpack values;
- ``["nt", batch_size, device, data]``: a ``NonTensorData`` (``data`` must be something mq
  carries: numbers, strings, lists, dicts, arrays...);
- ``["lazy", stack_dim, [trees]]`` and ``["ntstack", stack_dim, [trees]]``: a
  ``LazyStackedTensorDict`` and a ``NonTensorStack``.

Anything else from ``tensordict`` (a ``TensorDictParams``, a sub-TensorDict, a persistent one, a
tensorclass) is an :class:`~mq.errors.EncodeError` that says how to convert it. A received tree
is checked kind by kind; whatever does not fit is a :class:`~mq.errors.ProtocolError`.
"""

from __future__ import annotations

import sys
from typing import Any

from mq.errors import EncodeError, ProtocolError

_KINDS = ("td", "nt", "lazy", "ntstack")


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` comes from the tensordict package (cheap: no import)."""
    return "tensordict" in sys.modules and type(obj).__module__.startswith("tensordict")


def nbytes(obj: Any) -> int:
    """About what a tensordict object costs in a queue (a stream's credit): its tensors' bytes."""
    try:
        return 64 + int(obj.bytes())
    except Exception:  # NonTensorData and other kinds without tensors of their own
        return 64


def to_tree(obj: Any) -> list[Any]:
    """The tree of one tensordict object (its children stay objects: the codec packs them)."""
    import tensordict as tdm

    kind = type(obj)
    if kind is tdm.TensorDict:
        names = list(obj.names) if obj._has_names() else None
        return ["td", list(obj.batch_size), _device(obj.device), names, {k: obj.get(k) for k in obj.keys()}]
    if isinstance(obj, tdm.NonTensorStack):
        return ["ntstack", obj.stack_dim, list(obj.tensordicts)]
    if isinstance(obj, tdm.NonTensorData):
        return ["nt", list(obj.batch_size), _device(obj.device), obj.data]
    if kind is tdm.LazyStackedTensorDict:
        return ["lazy", obj.stack_dim, list(obj.tensordicts)]
    raise EncodeError(f"cannot send a {kind.__module__}.{kind.__qualname__}: mq carries TensorDict, "
                      "LazyStackedTensorDict, NonTensorData and NonTensorStack; convert it first "
                      "(td.to_tensordict(), or .data of a TensorDictParams)")


def from_tree(tree: Any) -> Any:
    """The tensordict object of a received tree (its children already rebuilt).

    Raises:
        ProtocolError: the tree is not one :func:`to_tree` makes, or tensordict refuses it.
    """
    if not (type(tree) is list and tree and tree[0] in _KINDS):
        raise ProtocolError(f"malformed TensorDict payload: {str(tree)[:80]}")
    try:
        import tensordict as tdm
    except ImportError:
        raise ProtocolError("received a TensorDict, but tensordict is not installed here "
                            "(pip install tensordict)") from None
    try:
        return _build(tdm, tree)
    except ProtocolError:
        raise
    except Exception as exc:  # tensordict's own checks (shapes vs batch size, ...)
        raise ProtocolError(f"malformed TensorDict payload: {type(exc).__name__}: {exc}") from exc


def _build(tdm: Any, tree: list[Any]) -> Any:
    kind = tree[0]
    if kind == "td":
        _, batch, device, names, items = _fields(tree, 5)
        if type(items) is not dict or not all(type(k) is str for k in items):
            raise ProtocolError("malformed TensorDict payload: its items must be a dict of str keys")
        if names is not None and not (type(names) is list and len(names) == len(batch)
                                      and all(n is None or type(n) is str for n in names)):
            raise ProtocolError(f"malformed TensorDict payload: names {names!r}")
        td = tdm.TensorDict(batch_size=_batch(batch), device=_local_device(device), names=names)
        for key, value in items.items():
            td.set(key, value)
        return td
    if kind == "nt":
        _, batch, device, data = _fields(tree, 4)
        return tdm.NonTensorData(data=data, batch_size=_batch(batch), device=_local_device(device))
    _, dim, parts = _fields(tree, 3)
    if type(dim) is not int or type(parts) is not list or not parts:
        raise ProtocolError("malformed TensorDict payload: a stack needs an int dim and a non-empty list")
    if kind == "ntstack":
        return tdm.NonTensorStack(*parts, stack_dim=dim)
    return tdm.LazyStackedTensorDict(*parts, stack_dim=dim)


def _fields(tree: list[Any], n: int) -> list[Any]:
    if len(tree) != n:
        raise ProtocolError(f"malformed TensorDict payload: {tree[0]!r} has {len(tree)} fields, not {n}")
    return tree


def _batch(batch: Any) -> list[int]:
    if type(batch) is not list or len(batch) > 64 or not all(type(d) is int and d >= 0 for d in batch):
        raise ProtocolError(f"malformed TensorDict payload: batch size {batch!r}")
    return batch


def _device(device: Any) -> str | None:
    return None if device is None else str(device)


def _local_device(device: Any) -> Any:
    """The sender's device where this node has it, else the CPU (where the codec put the
    tensors: :func:`mq.wire.codec._place`)."""
    if device is None:
        return None
    if type(device) is not str:
        raise ProtocolError(f"malformed TensorDict payload: device {device!r}")
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0) if device.partition(":")[2].isdigit() else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return "cpu"
    return device
