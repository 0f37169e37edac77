"""The torchrpc backend's part of ``mq doctor``: TensorPipe's presence and the transports and
channels it would use here, and what torch RPC leaves open that mq cannot close."""

from __future__ import annotations

from typing import Any, Mapping

from mq.backends.torchrpc.tensorpipe import tensorpipe_options
from mq.locality import Locality

__all__ = ["TRUST", "section"]

#: What torchrpc leaves open that mq cannot close (TensorPipe's and torch's store's own trust
#: model): said where a user picks a backend (``mq doctor``, ``mq run --help``).
TRUST = {
    "summary": "torchrpc: mq authenticates its joins and signs its rendezvous values, but torch "
               "RPC's TensorPipe agent accepts any connection and unpickles Python-function "
               "RPCs: whoever reaches its port can run code in the node. mq binds it to "
               "loopback for one-host jobs; across hosts run torchrpc only on a trusted network "
               "(or use nng).",
    "hostile_input": "a few KiB of random bytes sent to TensorPipe's port abort the node "
                     "(std::bad_alloc, exit -6), and its listener can stop accepting after one "
                     "connect and close: anyone who reaches the port can stop the job",
    "store": "the rendezvous store (torch TCPStore, hosted by node 0 on every interface of its "
             "host) is open to anyone who reaches it: mq signs what it writes there and refuses "
             "(and logs) an entry without the job's signature, but torch's own entries are "
             "unsigned, and insecure=True signs nothing",
    "warning": "a node whose TensorPipe listens where other hosts can reach it logs one "
               "warning naming the interface (logger mq.torchrpc)",
}


def section(me: Locality, peers: Mapping[str, Locality]) -> dict[str, Any]:
    """``tensorpipe``: whether torch has the TensorPipe agent and the options mq would give it
    for a same-host and another-host peer; ``rows``: the same for the table."""
    present = False
    try:
        import torch.distributed.rpc as rpc

        present = bool(rpc.is_available()) and hasattr(rpc, "TensorPipeRpcBackendOptions")
        present = present and hasattr(rpc.BackendType, "TENSORPIPE")
    except Exception:
        present = False
    options = tensorpipe_options(me, {1: peers["local"], 2: peers["remote"]}, cuda=bool(me.gpus))
    transports = ", ".join(options["_transports"])
    if "shm" in options["_transports"]:
        transports += (" [yellow](shm busy-polls one CPU core per torchrpc process: "
                       "busy_poll=False, mq run --no-busy-poll)[/yellow]")
    rows = [["TensorPipe", "backend present" if present else "[red]absent[/red]"],
            ["  transports", transports], ["  channels", ", ".join(options["_channels"])]]
    return {"tensorpipe": {"backend_present": present, "options": options}, "rows": rows}
