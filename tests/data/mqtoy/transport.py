"""The toy backend's transport: nng's, held to TCP, that remembers its motto."""

from dataclasses import dataclass
from typing import Any

from mq.backends.nng.options import NngOptions
from mq.backends.nng.transport import NngTransport

TRUST = {"summary": "toy: trusts nobody it has not authenticated (it is nng underneath)"}


@dataclass(frozen=True)
class ToyOptions(NngOptions):
    """The toy mq type's options: nng's, plus

    Args:
        motto: how the toy's nodes greet in mq doctor (plain or loud).
    """

    motto: str = "plain"


class ToyTransport(NngTransport):
    Options = ToyOptions

    def __init__(self, node_id: int, options: ToyOptions, *, timeout: float = 30.0) -> None:
        super().__init__(node_id, options, timeout=timeout)
        self.motto = options.motto


def doctor_section(me: Any, peers: Any) -> dict:
    return {"toy": {"ready": True}, "rows": [["toy", "ready (a test's backend)"]]}
