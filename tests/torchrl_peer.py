"""A receiver of mq's TorchRL weight-sync scheme in a process of its own (tests/test_torchrl.py):
``python tests/torchrl_peer.py SCHEME_FILE WORKER [MIB (0: the small policy) [DONE_FILE]]``. It builds the test's policy with other
weights (or, with MIB, a policy of that many MiB), connects, and prints ``version N sum S`` for
each version it applied (versions 0 and 1), then its peak memory growth past the model
(``grew KIB``), then leaves."""

from __future__ import annotations

import os
import pickle
import resource
import sys
import time

import torch

import mq.integrations.torchrl  # noqa: F401  (the scheme's class, for unpickling)


def policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 256))


def big_policy(mib: int) -> torch.nn.Module:
    model = torch.nn.Module()
    model.table = torch.nn.Parameter(torch.full((mib << 18,), 2.0))  # written: its pages are in use
    return model


def checksum(model: torch.nn.Module) -> float:
    # In float64, a million elements at a time: a whole-tensor .double() is twice the model
    # (it was the receiver's "growth", while buckets arrived, in the memory test).
    total = 0.0
    for p in model.state_dict().values():
        flat = p.reshape(-1)
        total += sum(float(flat[i:i + (1 << 20)].double().sum()) for i in range(0, flat.numel(), 1 << 20))
    return total


def main() -> None:
    path, worker = sys.argv[1], int(sys.argv[2])
    with open(path, "rb") as f:  # the test's own file (0600), as TorchRL hands a worker its scheme
        scheme = pickle.load(f)
    torch.manual_seed(100 + worker)
    mib = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    model = big_policy(mib) if mib else policy()
    with_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker)
    scheme.connect(worker_idx=worker)
    print(f"version 0 sum {checksum(model)!r} routes {sorted(r.kind for r in scheme.q.routes().values())}", flush=True)
    if scheme.receive(timeout=60) is None:
        print("no version 1", flush=True)
    print(f"version 1 sum {checksum(model)!r}", flush=True)
    if len(sys.argv) > 4:  # stay until the trainer's update returned: on a mesh, this receiver
        done = sys.argv[4]  # may be the relay of its host's other receivers
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"grew {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - with_model}", flush=True)
    scheme.shutdown()


if __name__ == "__main__":
    main()
