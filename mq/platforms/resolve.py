"""Host names -> addresses, all at once and within a bound, before any worker starts."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import cast

from mq.node import waits
from mq.errors import ConfigError


def resolve_hosts(hosts: Sequence[str], source: str = "", *, timeout_s: float = 10.0) -> dict[str, str]:
    """Resolve every host name to an address, all at once and within ``timeout_s``.

    Workers listen on and dial these names; a name that does not resolve would otherwise
    surface as nng's "Address invalid" or a minute of torch c10d retries.

    Args:
        hosts: host names or IP addresses (duplicates are resolved once).
        source: where the names came from (``SLURM_STEP_NODELIST``), for the message.
        timeout_s: the bound on the whole lookup (a broken DNS server can hang for minutes).

    Returns:
        host -> IP address text.

    Raises:
        ConfigError: a name that does not resolve, or did not within ``timeout_s``.
    """
    results: dict[str, str | BaseException] = {}
    unique = list(dict.fromkeys(hosts))
    todo = list(reversed(unique))

    def lookup() -> None:
        while todo:
            try:
                host = todo.pop()
            except IndexError:
                return
            try:
                results[host] = cast(str, socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
            except OSError as exc:
                results[host] = exc

    # Daemon threads, not an executor: a lookup stuck in the resolver must not hold up exit.
    threads = [threading.Thread(target=lookup, daemon=True) for _ in range(min(32, len(unique)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        waits.join(t, deadline - time.monotonic())
    where = f" (from {source})" if source else ""
    fix = "add it to DNS or /etc/hosts on every host, or fix the name"
    for host in unique:
        got = results.get(host)
        if got is None:
            raise ConfigError(f"host name {host!r}{where} did not resolve within {timeout_s:g}s; {fix}")
        if isinstance(got, BaseException):
            reason = getattr(got, "strerror", None) or str(got)
            raise ConfigError(f"host name {host!r}{where} does not resolve ({reason}); {fix}")
    return {host: str(results[host]) for host in unique}
