"""mq's TorchRL weight-sync scheme side by side with TorchRL's own, in one run on one machine:
collection frames/s and weight-update latency (p50, p99) for a small MLP and a 100 MiB policy,
4 collectors, on one host and across 2 namespace hosts.

    python -m mq.tools.bench.torchrl --out bench-results/torchrl.md

Three settings, each case in a process of its own (a fresh torch.distributed, no leftovers):

- ``multi``: TorchRL's ``MultiSyncCollector`` with 4 workers and the scheme under test (mq,
  ``MultiProcessWeightSyncScheme``, ``SharedMemWeightSyncScheme``): the trainer takes a batch,
  changes its weights and calls ``update_policy_weights_()``, ``--updates`` times. frames/s is
  the frames of those batches over the whole loop (collection and updates).
- ``rpc``: TorchRL's ``RPCCollector`` (launcher ``mp``) with 4 workers, the same loop, with
  ``RPCWeightSyncScheme`` and mq's scheme.
- ``receivers`` (one host, and two namespace hosts with two receivers each): 4 receiver
  processes, each running a TorchRL ``Collector`` that acts with the scheme's weights, while the
  trainer updates them ``--updates`` times (a pause of 0.2 s between updates); mq's scheme
  against ``DistributedWeightSyncScheme`` (gloo). frames/s is what the 4 receivers collected
  per second, all together, while updates arrived.

Each update is timed from the call to its return (every worker applied it: all these schemes
wait for their workers' acknowledgement).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

WORKERS = 4
FRAMES = 50  # frames per worker per batch
ENV = "Pendulum-v1"
BIG_BYTES = 100 << 20


# ---------------------------------------------------------------------- policies and env
def make_env():
    from torchrl.envs import GymEnv

    return GymEnv(ENV)


class Actor(torch.nn.Module):
    """A small MLP; the 100 MiB policy adds a lookup table the actor reads one row of, so acting
    stays cheap and only the weights are large. At module level: the collectors' spawned workers
    unpickle the policy by its class's name (a class local to a function cannot be pickled)."""

    def __init__(self, table_bytes: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        rows = table_bytes // 4 // 1024
        self.table = torch.nn.Parameter(torch.zeros(rows, 1024)) if rows else None

    def forward(self, obs):
        out = self.net(obs)
        return out if self.table is None else out + self.table[0, :1]


def make_policy(kind: str):
    from tensordict.nn import TensorDictModule

    return TensorDictModule(Actor(BIG_BYTES if kind == "100mb" else 0), in_keys=["observation"], out_keys=["action"])


def nbytes(policy) -> int:
    return sum(p.numel() * p.element_size() for p in policy.parameters())


def perturb(policy) -> None:
    import torch

    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1e-3)


def summary(times: list[float], frames: int, seconds: float) -> dict[str, Any]:
    ordered = sorted(times)
    return {"updates": len(times), "p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "frames_per_s": frames / seconds if seconds > 0 else None}


def scheme_of(name: str, **mq_options: Any):
    from torchrl.weight_update import (DistributedWeightSyncScheme, MultiProcessWeightSyncScheme,
                                       RPCWeightSyncScheme, SharedMemWeightSyncScheme)

    from mq.integrations.torchrl import MQWeightSyncScheme

    return {"mq": lambda: MQWeightSyncScheme(**mq_options), "process": MultiProcessWeightSyncScheme,
            "shared": SharedMemWeightSyncScheme, "rpc": RPCWeightSyncScheme,
            "distributed": lambda: DistributedWeightSyncScheme(backend="gloo")}[name]()


# ---------------------------------------------------------------------- multi and rpc
def run_collector(setting: str, name: str, kind: str, updates: int) -> dict[str, Any]:
    """A TorchRL multiprocess (or RPC) collector with 4 workers and the scheme ``name``."""
    from torchrl.collectors import MultiSyncCollector
    from torchrl.collectors.distributed import RPCCollector

    policy, scheme = make_policy(kind), scheme_of(name)
    # A bounded total: RPCCollector's iterator ends at once on total_frames=-1 (StopIteration).
    common = {"frames_per_batch": WORKERS * FRAMES, "total_frames": WORKERS * FRAMES * (updates + 2),
              "weight_sync_schemes": {"policy": scheme}}
    started = time.monotonic()
    if setting == "multi":
        collector = MultiSyncCollector([make_env] * WORKERS, policy=policy, **common)
    else:
        collector = RPCCollector([make_env] * WORKERS, policy=policy, launcher="mp", sync=True,
                                 tcp_port=str(_free_port("127.0.0.1")), **common)
    setup = time.monotonic() - started
    try:
        batches = iter(collector)
        next(batches)
        times, frames, t0 = [], 0, time.monotonic()
        for _ in range(updates):
            frames += next(batches).numel()
            perturb(policy)
            t = time.perf_counter()
            collector.update_policy_weights_()
            times.append(time.perf_counter() - t)
        out = summary(times, frames, time.monotonic() - t0)
    finally:
        collector.shutdown()
        if hasattr(scheme, "q"):
            scheme.shutdown()
    return {**out, "setup_s": setup}


# ---------------------------------------------------------------------- receivers
def receiver_main(path: str, worker: int, kind: str, stop: str) -> None:
    """One receiver process: a TorchRL Collector acting with the scheme's weights until ``stop``
    exists; prints ``{"frames": n, "seconds": s}``."""
    import torch
    from torchrl.collectors import Collector

    import mq.integrations.torchrl  # noqa: F401  (mq's scheme class, for unpickling)

    torch.set_num_threads(1)
    with open(path, "rb") as f:  # this tool's own 0600 file, as TorchRL hands a worker its scheme
        name, scheme = pickle.load(f)
    collector = Collector(make_env(), make_policy(kind), frames_per_batch=FRAMES, total_frames=-1)
    rank = worker + 1 if name == "distributed" else worker  # TorchRL's distributed ranks start at 1
    scheme.init_on_receiver(model_id="policy", context=collector, worker_idx=rank)
    scheme.connect(worker_idx=rank) if name == "mq" else scheme.connect()
    frames, t0 = 0, time.monotonic()
    for batch in collector:
        frames += batch.numel()
        if os.path.exists(stop) or time.monotonic() - t0 > 600:
            break
    print(json.dumps({"frames": frames, "seconds": time.monotonic() - t0}), flush=True)
    scheme.shutdown()
    collector.shutdown()
    os._exit(0)  # a gloo process group left behind must not hold the exit


def run_receivers(name: str, kind: str, updates: int, hosts: int) -> dict[str, Any]:
    """4 receiver processes (here, or 2 on each of 2 namespace hosts) and the trainer's updates."""
    from mq.tools.netns import Hosts

    with tempfile.TemporaryDirectory(prefix="bench-torchrl-") as tmp:
        if hosts == 1:
            return _receivers(name, kind, updates, tmp, None, "127.0.0.1")
        with Hosts(2, root=True) as ns:
            return _receivers(name, kind, updates, tmp, ns, ns.root_addr)


def _receivers(name: str, kind: str, updates: int, tmp: str, ns: Any, addr: str) -> dict[str, Any]:
    policy = make_policy(kind)
    if name == "distributed":  # TorchRL's scheme advertises gethostbyname(gethostname()) and uses env://
        socket.gethostbyname = lambda _host, _addr=addr: _addr  # type: ignore[misc]  # mypy: a lambda's default
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(_free_port(addr)),
                          GLOO_SOCKET_IFNAME=ns.root_link[0] if ns else "lo")
        scheme = scheme_of(name)
        scheme.init_on_sender(model_id="policy", num_workers=WORKERS, model=policy)
    else:
        scheme = scheme_of(name, listen_to=f"tcp://{addr}:0", mesh=ns is not None)  # relays across hosts
        scheme.init_on_sender(model_id="policy", num_workers=WORKERS, model=policy)
    path, stop = os.path.join(tmp, "scheme.pkl"), os.path.join(tmp, "stop")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        pickle.dump((name, scheme), f)
    argv = [sys.executable, "-m", "mq.tools.bench.torchrl", "receiver", path, "", kind, stop]
    procs = []
    for w in range(WORKERS):
        cmd = argv[:5] + [str(w)] + argv[6:]
        # gloo binds the interface its host name resolves to, which a namespace host lacks
        env = {**os.environ, "GLOO_SOCKET_IFNAME": ns.links[w // 2][1] if ns else "lo"}
        procs.append(subprocess.Popen(ns.command(w // 2, cmd) if ns else cmd, stdout=subprocess.PIPE, text=True,
                                      env=env))
    try:
        scheme.connect()
        times = []
        for _ in range(updates):
            time.sleep(0.2)
            perturb(policy)
            t = time.perf_counter()
            scheme.send(weights=policy)
            times.append(time.perf_counter() - t)
        open(stop, "w").close()
        results = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    frames_per_s = sum(r["frames"] / r["seconds"] for r in results)
    out = summary(times, 0, 0)
    out["frames_per_s"] = frames_per_s
    return out


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the run and its page
def cases(updates: int, big_updates: int, two_hosts: bool) -> list[dict[str, Any]]:
    """Every case, the settings in order: multiprocess collectors, receivers on one host and on
    two, RPC collectors."""
    kinds = (("mlp", updates), ("100mb", big_updates))
    out = [{"setting": "multi", "scheme": s, "kind": k, "hosts": 1, "updates": n}
           for k, n in kinds for s in ("mq", "process", "shared")]
    for hosts in (1, 2) if two_hosts else (1,):
        out += [{"setting": "receivers", "scheme": s, "kind": k, "hosts": hosts, "updates": n}
                for k, n in kinds for s in ("mq", "distributed")]
    out += [{"setting": "rpc", "scheme": s, "kind": k, "hosts": 1, "updates": n}
            for k, n in kinds for s in ("mq", "rpc")]
    return out


def run_case(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One case in a fresh process; its result, or why it failed."""
    argv = [sys.executable, "-m", "mq.tools.bench.torchrl", "case", json.dumps(case)]
    started = time.monotonic()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"no result within {timeout:g}s"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        return {**case, "error": f"exit {p.returncode}: {tail}"}
    return {**case, **json.loads(lines[-1]), "case_s": round(time.monotonic() - started, 1)}


READING = """Where mq is not ahead, why: on one host TorchRL's `SharedMem` scheme writes the new
weights into memory every worker already maps and reads from (no copy per worker, nothing sent), and
`MultiProcess` hands the workers shared tensors through their pipes; mq's scheme copies each bucket
once into the trainer's shared-memory pool and every worker then copies it into its own policy (its
policy stays its own: a worker never acts with weights half written), so a 100 MiB update costs one
copy plus one per worker, which on 2 cores is most of mq's time. Where the weights cross a network
(`receivers`, TorchRL's `Distributed` over gloo) and under TorchRL's `RPCCollector` (`rpc`, against
its `RPC` scheme) mq is ahead at both sizes."""


def page(results: list[dict[str, Any]], command: str, seconds: float) -> str:
    import platform

    import tensordict
    import torch
    import torchrl

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return "failed" if "error" in r else format(r[key], fmt) if r.get(key) is not None else "-"

    lines = [
        "# TorchRL weight sync: mq's scheme and TorchRL's own",
        "",
        f"Run {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, machine: {os.cpu_count()} cores, "
        f"{platform.release()}; torch {torch.__version__}, TorchRL {torchrl.__version__}, "
        f"tensordict {tensordict.__version__}. Total {seconds:.0f} s.",
        "",
        "```bash", command, "```", "",
        (__doc__ or "").split("\n\n", 2)[2].strip(), "",
        f"{WORKERS} collectors, {FRAMES} frames per collector per batch, {ENV}. Policies: `mlp` "
        "(3-64-1, 1.3 KB) and `100mb` (the same MLP plus a 100 MiB table it reads one row of).", "",
        "| setting | policy | hosts | scheme | updates | update p50 (ms) | update p99 (ms) | frames/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['setting']} | {r['kind']} | {r['hosts']} | {r['scheme']} | {r['updates']} | "
                     f"{cell(r, 'p50_ms', '.1f')} | {cell(r, 'p99_ms', '.1f')} | {cell(r, 'frames_per_s', ',.0f')} |")
    lines += ["", READING]
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", "Failed cases:", ""]
        lines += [f"- {r['setting']} {r['kind']} {r['hosts']} host(s) {r['scheme']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "receiver":
        receiver_main(argv[1], int(argv[2]), argv[3], argv[4])
        return 0
    if argv and argv[0] == "case":
        case = json.loads(argv[1])
        if case["setting"] == "receivers":
            out = run_receivers(case["scheme"], case["kind"], case["updates"], case["hosts"])
        else:
            out = run_collector(case["setting"], case["scheme"], case["kind"], case["updates"])
        print(json.dumps(out), flush=True)
        os._exit(0)  # process groups and RPC agents of TorchRL's schemes must not hold the exit
    p = argparse.ArgumentParser(prog="python -m mq.tools.bench.torchrl", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the Markdown page here")
    p.add_argument("--updates", type=int, default=20, help="updates of the small MLP per case")
    p.add_argument("--big-updates", type=int, default=5, help="updates of the 100 MiB policy per case")
    p.add_argument("--case-timeout", type=float, default=240.0)
    p.add_argument("--only", default="", help="comma-separated settings to run (multi,rpc,receivers)")
    args = p.parse_args(argv)
    from mq.tools.netns import unavailable

    two_hosts = os.geteuid() == 0 and not unavailable()
    todo = [c for c in cases(args.updates, args.big_updates, two_hosts)
            if not args.only or c["setting"] in args.only.split(",")]
    started, results = time.monotonic(), []
    command = ("python -m mq.tools.bench.torchrl " + " ".join(argv)).strip()
    for case in todo:
        results.append(run_case(case, args.case_timeout))
        print(json.dumps(results[-1]), flush=True)
        text = page(results, command, time.monotonic() - started)
        if args.out:  # after every case: a run cut short still leaves what it measured
            with open(args.out, "w") as f:
                f.write(text)
    print(text)
    return 0 if not any("error" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
