"""The inproc transport's options (:class:`InprocOptions`) and its address grammar
(``inproc://name``), validated once when the options are made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from mq.errors import ConfigError
from mq.options import check_int

SCHEME = "inproc://"


def check_address(address: Any, what: str) -> str:
    """``address`` if it looks like ``inproc://name``."""
    if not isinstance(address, str) or not address.startswith(SCHEME) or len(address) <= len(SCHEME):
        raise ConfigError(f"{what} {address!r} must look like inproc://name")
    return address


@dataclass(frozen=True)
class InprocOptions:
    """The ``inproc`` mq type's own options (see :func:`mq.create` for the common ones).

    Args:
        listen_to: ``inproc://name`` (default: a fresh unique name, made by the transport).
        attach_to: names of nodes in this process to join (a list, or one comma-separated str).
        inbox_size: frames waiting in the inbox before senders wait (backpressure).
    """

    listen_to: str | None = None
    attach_to: Iterable[str] = ()
    inbox_size: int = 64

    def __post_init__(self) -> None:
        if self.listen_to is not None:
            check_address(self.listen_to, "listen_to")
        attach = self.attach_to
        if isinstance(attach, str):
            attach = [a for a in attach.split(",") if a]
        object.__setattr__(self, "attach_to", tuple(check_address(a, "attach_to address") for a in attach))
        check_int(self.inbox_size, "inbox_size")
