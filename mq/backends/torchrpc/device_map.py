"""CUDA device maps: the ``node_gpu_gpu`` grammar -> per-peer TensorPipe device maps.

A spec is a comma-separated list of ``<peer node id>_<local gpu>_<peer gpu>`` tokens, e.g.
``1_0_1,2_0_2,0_0_0``. :func:`parse` turns it into ``{peer_node_id: {local_gpu: peer_gpu}}``,
which the torch RPC backend hands to ``TensorPipeRpcBackendOptions.set_device_map`` peer by peer.

Rules (each broken rule is a :class:`~mq.errors.ConfigError` that quotes the token):

* every token has exactly three non-negative integer parts;
* tokens whose peer is this node are ignored (one spec can be shared by every node);
* local GPU indices are logical (after ``CUDA_VISIBLE_DEVICES`` and ``--local-cuda-devices``);
* an identical repeated token counts once; the same (peer, local GPU) sent to two different
  peer GPUs is a conflicting duplicate;
* each per-peer map is one-to-one (TensorPipe inverts it for replies).

Only mq types that move tensors device to device take a map (``Backend.device_map_types``:
``torchrpc:cuda``); the others reject a non-empty one (:func:`reject_for_cpu`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from mq.errors import ConfigError

__all__ = [
    "format",
    "invert",
    "parse",
    "parse_devices",
    "reject_for_cpu",
]

_GRAMMAR = "<peer node id>_<local gpu>_<peer gpu> such as 1_0_1"
_FIELDS = ("peer node id", "local gpu", "peer gpu")
# Indices beyond this are certainly typos, and capping the digit count keeps int() away
# from Python's huge-integer guard (which would raise a bare ValueError).
_MAX_DIGITS = 9


def _is_index(value: object) -> bool:
    """True for a plain non-negative int (bool is an int subclass but never an index)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_index(
    part: str, token: str, field: str, *, what: str = "cuda device map token", expected: str = _GRAMMAR
) -> int:
    """Parse one non-negative integer field of ``token``, or raise a ConfigError naming it."""
    text = part.strip()
    if not text:
        raise ConfigError(
            f"{what} {token!r} is malformed: the {field} is empty; expected {expected}"
        )
    if text.startswith("-") and text[1:].isascii() and text[1:].isdigit():
        raise ConfigError(
            f"{what} {token!r} has a negative {field} {text}: node ids and GPU indices "
            f"must be non-negative integers; expected {expected}"
        )
    # isdigit() alone accepts non-ASCII digits ('٣', '²'); only 0-9 are meaningful here.
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(
            f"{what} {token!r} is malformed: the {field} {text!r} is not a non-negative "
            f"integer; expected {expected}"
        )
    if len(text.lstrip("0")) > _MAX_DIGITS:
        raise ConfigError(
            f"{what} {token!r} has a {field} {text} that is too large (at most "
            f"{_MAX_DIGITS} digits); expected {expected}"
        )
    return int(text)


def _check_device_list(devices: Iterable[object], name: str) -> list[int]:
    """Validate a list of logical GPU indices passed by the caller (not from a spec)."""
    out: list[int] = []
    for dev in devices:
        if not _is_index(dev):
            raise ConfigError(
                f"{name} entry {dev!r} is not a GPU index: use non-negative integers such as [0, 1]"
            )
        if dev in out:
            raise ConfigError(f"{name} lists GPU {dev} twice: list each GPU once, e.g. [0, 1]")
        out.append(dev)  # type: ignore[arg-type]
    return out


def _check_node_id(node_id: object, name: str = "node_id") -> int:
    if not _is_index(node_id):
        raise ConfigError(f"{name} {node_id!r} is not a node id: use a non-negative integer such as 0")
    return node_id  # type: ignore[return-value]


def _visible_cuda_devices() -> list[int]:
    """Logical CUDA devices of this process; [] when torch or CUDA is absent.

    Imported lazily so that parsing a spec never pays for (or requires) torch.
    """
    try:
        import torch
    except ImportError:
        return []
    try:
        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    except Exception:  # a broken driver means "no usable GPUs", not a crash while parsing
        return []


def _default_map(
    node_id: int,
    local: list[int] | None,
    peers: Iterable[int],
    peer_cuda_devices: Mapping[int, Sequence[int]] | None,
) -> dict[int, dict[int, int]]:
    """Identity map: each local GPU to the same index on every peer that has it."""
    if local is None:
        local = _visible_cuda_devices()
    result: dict[int, dict[int, int]] = {}
    for peer in sorted({_check_node_id(p, "peer") for p in peers}):
        if peer == node_id:
            continue
        if peer_cuda_devices is not None and peer in peer_cuda_devices:
            remote = set(_check_device_list(peer_cuda_devices[peer], f"peer_cuda_devices[{peer}]"))
        else:
            remote = set(local)  # unknown peer: assume it looks like this node
        mapping = {d: d for d in local if d in remote}
        # An empty map would be a no-op for set_device_map; leave the peer out instead.
        if mapping:
            result[peer] = mapping
    return result


def parse(
    spec: str | Mapping[int, Mapping[int, int]] | None,
    node_id: int,
    local_cuda_devices: Sequence[int] | None = None,
    *,
    peers: Iterable[int] | None = None,
    peer_cuda_devices: Mapping[int, Sequence[int]] | None = None,
) -> dict[int, dict[int, int]]:
    """Parse a ``node_gpu_gpu`` device-map spec into per-peer TensorPipe device maps.

    Args:
        spec: ``"1_0_1,2_0_2"``-style string. ``None``, ``""`` or blank means the default identity
            map. An already-parsed ``{peer: {local: peer_gpu}}`` mapping is validated the same way.
        node_id: this node's id; tokens naming it as the peer are ignored.
        local_cuda_devices: logical local GPU indices this node may use. When given, a token naming
            any other local GPU is an error. When ``None`` and the default map is built, the GPUs
            torch sees are used.
        peers: node ids of the other nodes. Required for the default map (without it the default
            is ``{}`` and the backend fills it in later). When given with an explicit spec, a token
            naming a node outside ``peers`` (and not this node) is an error.
        peer_cuda_devices: optional ``{peer: [gpu, ...]}``. Limits the default map to GPUs both
            sides have, and makes a token naming a GPU the peer lacks an error.

    Returns:
        ``{peer_node_id: {local_gpu: peer_gpu}}``, each inner map one-to-one, without this node.

    Raises:
        ConfigError: a malformed, empty, negative, unknown, conflicting or non-invertible token;
            the message quotes the token, names the rule and says how to fix it.
    """
    node_id = _check_node_id(node_id)
    local = None if local_cuda_devices is None else _check_device_list(local_cuda_devices, "local_cuda_devices")
    peer_set = None if peers is None else {_check_node_id(p, "peer") for p in peers}

    if isinstance(spec, Mapping):
        spec = format(spec)  # validates types and invertibility, then goes through one path
    if spec is not None and not isinstance(spec, str):
        raise ConfigError(
            f"cuda device map {spec!r} must be a string such as '1_0_1,2_0_2' (got {type(spec).__name__})"
        )
    if spec is None or not spec.strip():
        if peer_set is None:
            return {}
        return _default_map(node_id, local, peer_set, peer_cuda_devices)

    result: dict[int, dict[int, int]] = {}
    # Per peer: which token set each local GPU and each peer GPU, to quote both in errors.
    by_local: dict[tuple[int, int], str] = {}
    by_remote: dict[tuple[int, int], str] = {}
    raw_tokens = spec.split(",")
    for position, raw in enumerate(raw_tokens, start=1):
        token = raw.strip()
        peer, lgpu, rgpu = _parse_token(token, spec, position, len(raw_tokens))
        if peer == node_id:
            continue  # one spec serves every node: our own entries mean nothing here
        _check_token_devices(token, peer, lgpu, rgpu, peer_set, local, peer_cuda_devices)
        _add_token(result, by_local, by_remote, token, (peer, lgpu, rgpu))
    return result


def _parse_token(token: str, spec: str, position: int, count: int) -> tuple[int, int, int]:
    """``peer_local_peergpu`` -> the three indices; ConfigError quoting a malformed token."""
    if not token:
        raise ConfigError(
            f"cuda device map {spec!r} has an empty token '' at position {position} of "
            f"{count}: separate tokens with single commas and no trailing comma, "
            f"each {_GRAMMAR}"
        )
    parts = token.split("_")
    if len(parts) != 3:
        raise ConfigError(
            f"cuda device map token {token!r} is malformed: it has {len(parts)} part(s) but "
            f"expected 3, {_GRAMMAR}"
        )
    peer, lgpu, rgpu = (_parse_index(p, token, f) for p, f in zip(parts, _FIELDS))
    return peer, lgpu, rgpu


def _check_token_devices(token: str, peer: int, lgpu: int, rgpu: int, peer_set: set[int] | None,
                         local: list[int] | None,
                         peer_cuda_devices: Mapping[int, Sequence[int]] | None) -> None:
    """A token may only name known peers, this node's GPUs and GPUs the peer has."""
    if peer_set is not None and peer not in peer_set:
        raise ConfigError(
            f"cuda device map token {token!r} names unknown peer node {peer}: the peers are "
            f"{sorted(peer_set)}; use one of them or drop the token"
        )
    if local is not None and lgpu not in local:
        raise ConfigError(
            f"cuda device map token {token!r} names unknown local GPU {lgpu}: this node's "
            f"logical CUDA devices are {local} (indices after CUDA_VISIBLE_DEVICES and "
            f"--local-cuda-devices); use one of them or add it to --local-cuda-devices"
        )
    if peer_cuda_devices is not None and peer in peer_cuda_devices:
        remote = _check_device_list(peer_cuda_devices[peer], f"peer_cuda_devices[{peer}]")
        if rgpu not in remote:
            raise ConfigError(
                f"cuda device map token {token!r} names unknown peer GPU {rgpu}: node {peer} "
                f"has CUDA devices {remote}; map to one of them"
            )


def _add_token(result: dict[int, dict[int, int]], by_local: dict[tuple[int, int], str],
               by_remote: dict[tuple[int, int], str], token: str,
               entry: tuple[int, int, int]) -> None:
    """Add one token's mapping; each peer's map must stay one-to-one (identical repeats pass)."""
    peer, lgpu, rgpu = entry
    prev = by_local.get((peer, lgpu))
    if prev is not None:
        if result[peer][lgpu] == rgpu:
            return  # an identical repeat says nothing new
        raise ConfigError(
            f"cuda device map token {token!r} is a conflicting duplicate of {prev!r}: local "
            f"GPU {lgpu} for peer {peer} is mapped to both GPU {result[peer][lgpu]} and GPU "
            f"{rgpu}; keep only one of them"
        )
    prev = by_remote.get((peer, rgpu))
    if prev is not None:
        raise ConfigError(
            f"cuda device map token {token!r} makes the map for peer {peer} not invertible: "
            f"{prev!r} already maps a local GPU to peer GPU {rgpu} (TensorPipe needs a "
            f"one-to-one map per peer); map each local GPU to a different peer GPU"
        )
    by_local[(peer, lgpu)] = token
    by_remote[(peer, rgpu)] = token
    result.setdefault(peer, {})[lgpu] = rgpu


def format(mapping: Mapping[int, Mapping[int, int]]) -> str:  # shadows the builtin: the name is the API
    """Render ``{peer: {local_gpu: peer_gpu}}`` as the canonical spec string.

    Tokens are sorted by peer then local GPU, so equal maps give equal strings and
    ``parse(format(m), node_id)`` returns ``m`` (for a ``node_id`` not among its peers).

    Args:
        mapping: per-peer device maps, as returned by :func:`parse`.

    Returns:
        e.g. ``"1_0_1,2_0_2"``; ``""`` for an empty mapping.

    Raises:
        ConfigError: a non-integer or negative id, or a per-peer map that is not one-to-one.
    """
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            f"cuda device map {mapping!r} must be a mapping {{peer: {{local_gpu: peer_gpu}}}}"
        )
    tokens: list[str] = []
    for peer, inner in mapping.items():
        if not isinstance(inner, Mapping):
            raise ConfigError(
                f"cuda device map for peer {peer!r} must be a mapping {{local_gpu: peer_gpu}}, "
                f"got {inner!r}"
            )
        for lgpu, rgpu in inner.items():
            if not (_is_index(peer) and _is_index(lgpu) and _is_index(rgpu)):
                raise ConfigError(
                    f"cuda device map entry '{peer!r}_{lgpu!r}_{rgpu!r}' is malformed: peer node "
                    f"id, local gpu and peer gpu must be non-negative integers; expected {_GRAMMAR}"
                )
        invert(inner, peer=peer)  # raises if two local GPUs share a peer GPU
    for peer in sorted(mapping):
        for lgpu in sorted(mapping[peer]):
            tokens.append(f"{peer}_{lgpu}_{mapping[peer][lgpu]}")
    return ",".join(tokens)


def invert(mapping: Mapping[int, int], *, peer: int | None = None) -> dict[int, int]:
    """Invert one peer's ``{local_gpu: peer_gpu}`` map into ``{peer_gpu: local_gpu}``.

    This is the map the peer uses for traffic coming back to us.

    Args:
        mapping: one per-peer device map.
        peer: the peer's node id, only used to make error messages precise.

    Returns:
        The inverse map.

    Raises:
        ConfigError: two local GPUs map to the same peer GPU (the map is not invertible).
    """
    out: dict[int, int] = {}
    for lgpu, rgpu in mapping.items():
        if rgpu in out:
            who = f" for peer {peer}" if peer is not None else ""
            first = f"{peer}_{out[rgpu]}_{rgpu}" if peer is not None else f"{out[rgpu]}->{rgpu}"
            second = f"{peer}_{lgpu}_{rgpu}" if peer is not None else f"{lgpu}->{rgpu}"
            raise ConfigError(
                f"cuda device map entry {second!r} makes the map{who} not invertible: {first!r} "
                f"already maps a local GPU to peer GPU {rgpu} (TensorPipe needs a one-to-one "
                f"map per peer); map each local GPU to a different peer GPU"
            )
        out[rgpu] = lgpu
    return out


def reject_for_cpu(mq_type: str, spec: str | Mapping[int, Mapping[int, int]] | None,
                   accepted: Collection[str] = ("torchrpc:cuda",)) -> None:
    """Refuse a non-empty device map for an mq type that cannot move CUDA tensors.

    Args:
        mq_type: e.g. ``"nng"``, ``"torchrpc:cpu"``, ``"torchrpc:cuda"``.
        spec: the device map as given by the user (string or parsed mapping).
        accepted: the mq types that take one (its backend's ``device_map_types``).

    Raises:
        ConfigError: ``spec`` is non-empty and ``mq_type`` is not one of ``accepted``.
    """
    if spec is None:
        return
    if isinstance(spec, str):
        empty = not spec.strip()
    elif isinstance(spec, Mapping):
        empty = not any(spec.values())  # {peer: {}} maps nothing
    else:
        empty = False
    if empty or mq_type in accepted:
        return
    shown = spec if isinstance(spec, str) else format(spec)
    need = " or ".join(sorted(accepted))
    raise ConfigError(
        f"cuda device map {shown!r} was given with mq type {mq_type!r}, which cannot use it: "
        f"device maps need {need}; use --mq-type {need} or drop --cuda-device-map"
    )


def parse_devices(text: str | None) -> list[int]:
    """Parse the CLI value of ``--local-cuda-devices``, e.g. ``"0,1"``.

    Args:
        text: comma-separated logical GPU indices; ``None`` or blank means none given.

    Returns:
        The indices in the order given.

    Raises:
        ConfigError: an empty, non-integer, negative or repeated entry (the message quotes it).
    """
    if text is None or not text.strip():
        return []
    what = "--local-cuda-devices entry"
    raw_items = text.split(",")
    out: list[int] = []
    for position, raw in enumerate(raw_items, start=1):
        item = raw.strip()
        if not item:
            raise ConfigError(
                f"--local-cuda-devices {text!r} has an empty entry '' at position {position} of "
                f"{len(raw_items)}: separate GPU indices with single commas, e.g. 0,1"
            )
        dev = _parse_index(item, item, "GPU index", what=what, expected="GPU indices such as 0,1")
        if dev in out:
            raise ConfigError(
                f"{what} {item!r} is a duplicate: GPU {dev} is already listed in {text!r}; "
                f"list each GPU once, e.g. 0,1"
            )
        out.append(dev)
    return out
