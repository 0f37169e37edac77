"""Roles by rank: ``learner:1,collector:*`` -> each node's labels, the same on every platform."""

from __future__ import annotations

import re
from collections.abc import Sequence

from mq.errors import ConfigError
from mq.platforms.hostlist import MAX_HOSTS

_ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def assign_roles(spec: str, node_ids: Sequence[int]) -> dict[int, list[str]]:
    """Give each node of the job its role from a spec such as ``learner:1,collector:*``.

    Roles are dealt in node-id order, so the spec means the same locally, under Slurm and on
    k8s: ``learner:1,collector:*`` makes node 0 the learner and every other node a collector.
    A count is a positive integer or ``*`` (the nodes the other roles leave, at most one
    ``*``). A role may carry several labels joined by ``+`` (``learner+evaluator:1``).

    Args:
        spec: the role spec.
        node_ids: every node id of the job (not just this host's).

    Returns:
        node id -> sorted labels, for every id in ``node_ids``.

    Raises:
        ConfigError: a malformed entry, a zero or non-numeric count, a repeated role, two
            ``*``, or counts that do not add up to the job's size.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"roles {spec!r} is empty: expected a spec such as learner:1,collector:*")
    ids = sorted(node_ids)
    entries: list[tuple[list[str], int | None]] = []
    seen: set[str] = set()
    for item in (part.strip() for part in spec.split(",")):
        name, colon, count_text = item.partition(":")
        labels = [label.strip() for label in name.split("+")]
        if not colon or not all(_ROLE_RE.match(label) for label in labels):
            raise ConfigError(
                f"roles {spec!r}: {item!r} is not role:count (such as learner:1 or collector:*)"
            )
        count_text = count_text.strip()
        if count_text == "*":
            if any(count is None for _, count in entries):
                raise ConfigError(f"roles {spec!r}: only one role may take the rest ('*')")
            count = None
        elif count_text.isascii() and count_text.isdigit() and 0 < int(count_text) <= MAX_HOSTS:
            count = int(count_text)
        else:
            raise ConfigError(
                f"roles {spec!r}: the count of {name!r} is {count_text!r}; expected a positive "
                f"integer or '*' for the rest"
            )
        if "+".join(labels) in seen:
            raise ConfigError(f"roles {spec!r}: role {name!r} is given twice; add up its counts")
        seen.add("+".join(labels))
        entries.append((labels, count))
    fixed = sum(count for _, count in entries if count is not None)
    has_rest = any(count is None for _, count in entries)
    if fixed > len(ids) or (fixed < len(ids) and not has_rest):
        raise ConfigError(
            f"roles {spec!r} name {fixed} nodes but the job has {len(ids)}; fix the counts"
            + ("" if has_rest else " or give one role the rest with '*' (collector:*)")
        )
    out: dict[int, list[str]] = {}
    position = 0
    for labels, count in entries:
        take = len(ids) - fixed if count is None else count
        for n in ids[position:position + take]:
            out[n] = sorted(set(labels))
        position += take
    return out
