"""Slurm hostlist syntax: ``gpu[01-02],cpu007`` and tasks-per-node lists such as ``2(x3),1``."""

from __future__ import annotations

import re

from mq.errors import ConfigError

#: No real job has anywhere near this many hosts (python-hostlist caps a range at the same).
MAX_HOSTS = 100_000
#: Capping digits keeps int() away from Python's huge-integer guard (a bare ValueError).
MAX_DIGITS = 18
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    The expansion itself is python-hostlist's (``hostlist.expand_hostlist``, the library
    Slurm sites use): bracket ranges with zero padding (``n[008-011]``), text after a bracket
    (``gpu-a[1-2]-ib``), several bracket groups (``rack[1-2]-n[01-02]``, last varies fastest).
    This wrapper only adds what a launcher needs on top: duplicates are kept, blanks around
    commas are ignored, and every malformed text is a ConfigError quoting it.

    Args:
        text: the hostlist, e.g. ``"node[01-03,07],gpu-a[1-2]-ib,login1"``.

    Returns:
        The host names.

    Raises:
        ConfigError: the text is empty, has an empty entry (stray comma), whitespace inside
            an entry, or is rejected by python-hostlist (unbalanced or nested brackets, a bad
            or reversed range, more than 100000 hosts).
    """
    import hostlist

    if not isinstance(text, str):
        raise ConfigError(f"hostlist must be a string, got {type(text).__name__}: {text!r}")
    # python-hostlist silently drops empty entries and keeps blanks; a job script with either
    # has a typo the user should see.
    flat = re.sub(r"\s*,\s*", ",", text.strip())
    if not flat:
        raise ConfigError(f"hostlist {text!r} is empty: expected hosts such as node[01-03],login1")
    if flat.startswith(",") or flat.endswith(",") or ",," in flat:
        raise ConfigError(
            f"hostlist {text!r} is malformed: it has an empty entry (a leading, trailing "
            f"or doubled comma)"
        )
    if any(ch.isspace() for ch in flat):
        raise ConfigError(
            f"hostlist {text!r} is malformed: an entry contains whitespace; separate hosts "
            f"with commas"
        )
    try:
        hosts = hostlist.expand_hostlist(flat, allow_duplicates=True)
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"hostlist {text!r} is malformed: {exc}") from None
    if len(hosts) > MAX_HOSTS:
        raise ConfigError(f"hostlist {text!r} is too large: more than {MAX_HOSTS} hosts")
    return hosts


def parse_tasks_per_node(
    text: str, n_hosts: int, *, name: str = "SLURM_TASKS_PER_NODE"
) -> list[int]:
    """Parse Slurm's compressed tasks-per-node list into one count per host.

    Args:
        text: ``"2"``, ``"2(x3)"`` or ``"2(x2),1"``. A single plain count applies to every host
            (that is how ``SLURM_NTASKS_PER_NODE`` is written).
        n_hosts: the number of hosts in the node list the counts must cover.
        name: the variable the text came from, for error messages.

    Returns:
        ``n_hosts`` positive counts.

    Raises:
        ConfigError: malformed entries, a zero count, or a count list that does not match the
            number of hosts.
    """
    counts: list[int] = []
    items = [item.strip() for item in text.split(",")]
    repeated = False
    for item in items:
        match = _TASKS_RE.match(item)
        if match is None or len(item) > 2 * MAX_DIGITS:
            raise ConfigError(
                f"{name}={text!r} is malformed: {item!r} is not a count such as 2 or 2(x3)"
            )
        count = int(match.group(1))
        repeat = 1 if match.group(2) is None else int(match.group(2))
        repeated = repeated or match.group(2) is not None
        if count < 1 or repeat < 1:
            raise ConfigError(f"{name}={text!r} is malformed: {item!r} has a zero count")
        if len(counts) + repeat > MAX_HOSTS:
            raise ConfigError(f"{name}={text!r} covers more than {MAX_HOSTS} hosts")
        counts.extend([count] * repeat)
    if len(items) == 1 and not repeated:
        # One bare count is SLURM_NTASKS_PER_NODE's form: the same count on every host.
        counts = counts * n_hosts
    if len(counts) != n_hosts:
        raise ConfigError(
            f"{name}={text!r} gives task counts for {len(counts)} hosts but the node list has "
            f"{n_hosts}; the two variables must come from the same allocation or step"
        )
    return counts
