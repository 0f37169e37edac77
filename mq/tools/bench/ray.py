"""mq against Ray's own ways of moving data between Ray actors, in one run:

    python -m mq.tools.bench.ray --out bench-results/ray.md     # needs root for the 2-host rows

It starts its own Ray cluster (a head here; with ``--hosts 2`` also a second Ray node on a
namespace host, :mod:`mq.tools.netns`) and, per placement (both actors on one Ray node, or one
on each), times round trips of a float32 payload from actor A to actor B and back:

- ``mq``: A ``send``s it to B's mq node (``init_method="ray://..."``), B echoes it (``recv`` then
  ``send``), A ``recv``s it;
- ``ray call``: A calls B's method with the payload and ``ray.get``s its return (the payload);
- ``ray put/get``: A ``ray.put``s it and calls B with the reference; B ``ray.get``s it and
  ``ray.put``s it back; A ``ray.get``s that (the object store both ways).

And one weight update to 8 actors (one Ray node): mq's ``publish`` to 8 subscribers, each
acknowledging, against RLlib's way, one ``ray.put`` then a method call per actor with the
reference, each actor reading the weights (``ray.get`` of the calls).

Times are taken inside actor A (no driver in the loop): p50 and p99 of ``--samples`` (fewer for
the largest sizes), after a warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import numpy as np

from mq.tools.bench.units import format_size, parse_size

SIZES = "1.25KB,20KB,1.25MB,10MB,40MB,640MB"
WEIGHT_SIZES = "1.25MB,10MB,100MB"
SUBSCRIBERS = 8


def _samples_for(nbytes: int, samples: int) -> int:
    return max(3, min(samples, int(2e9 // max(nbytes, 1))))


class Peer:
    """Actor B (and the subscribers): an mq node that echoes, and Ray methods that echo."""

    def __init__(self, rank: int, world: int, group: str):
        import threading

        import mq

        self.q = mq.create("nng", rank, init_method=f"ray://{group}", world_size=world, timeout=120)
        if rank:
            self.q.subscribe("weights")
        self.q.listen()
        self.rank = rank
        if rank:  # (actor A reads its own queue: a second reader there would take its answers)
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import mq

        while True:
            try:
                m = self.q.recv(timeout=5)
            except mq.Timeout:
                continue  # nothing to echo yet
            except mq.MQError:  # stopped
                return
            if m.topic == "echo":
                self.q.send(m.sender, "echo", m.payload)
            elif m.topic == "weights":
                self.q.send(m.sender, "ack", int(np.asarray(m.payload).shape[0]))

    def ready(self, world: int) -> int:
        self.q.wait_for_peers(world - 1, timeout=120)
        return self.rank

    def echo(self, x: Any) -> Any:
        return x

    def echo_ref(self, refs: list) -> list:
        import ray

        return [ray.put(ray.get(refs[0]))]

    def set_weights(self, w: Any) -> int:
        return int(np.asarray(w).shape[0])  # RLlib's env runners read them

    def host(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def stop(self) -> None:
        self.q.stop(raise_undelivered=False)


class Driver(Peer):
    """Actor A: times every way against its peers."""

    def round_trips(self, how: str, peer: Any, nbytes: int, samples: int, warmup: int = 3) -> list[float]:
        import ray

        x = np.ones(nbytes // 4, np.float32)
        out = []
        for i in range(warmup + samples):
            t0 = time.perf_counter()
            if how == "mq":
                self.q.send(1, "echo", x)
                got = self.q.recv(timeout=300).payload
            elif how == "ray call":
                got = ray.get(peer.echo.remote(x))
            else:
                got = ray.get(ray.get(peer.echo_ref.remote([ray.put(x)]))[0])
            dt_ms = (time.perf_counter() - t0) * 1e3
            assert np.asarray(got).nbytes == x.nbytes
            del got
            if i >= warmup:
                out.append(dt_ms)
        return out

    def updates(self, how: str, peers: list, nbytes: int, samples: int, warmup: int = 2) -> list[float]:
        import ray

        w = np.ones(nbytes // 4, np.float32)
        self.q.wait_for_subscribers("weights", len(peers), timeout=120)
        out = []
        for i in range(warmup + samples):
            t0 = time.perf_counter()
            if how == "mq publish":
                sent = self.q.publish("weights", w, timeout=300)
                acks = [self.q.recv(timeout=300) for _ in sent]
                assert len(acks) == len(peers)
            else:
                ref = ray.put(w)
                assert ray.get([p.set_weights.remote(ref) for p in peers]) == [w.shape[0]] * len(peers)
            dt_ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                out.append(dt_ms)
        return out


def _stats(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


@contextlib.contextmanager
def _cluster(hosts: int) -> Iterator[tuple[str, dict[str, str], Any]]:
    """A Ray head here (and a second Ray node on a namespace host when ``hosts`` is 2)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    tmp = tempfile.mkdtemp(prefix="mqray-")
    procs: list[subprocess.Popen] = []
    netns = None
    try:
        if hosts == 2:
            from mq.tools.netns import Hosts

            netns = Hosts(1, root=True).create()
            ip = netns.root_addr
        else:
            import ray

            ip = ray.util.get_node_ip_address()
        port = _port()
        env = {**os.environ, "RAY_ADDRESS": f"{ip}:{port}"}
        common = ["--block", "--disable-usage-stats", f"--num-cpus={SUBSCRIBERS + 2}"]
        procs.append(subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", f"--node-ip-address={ip}",
                                       "--include-dashboard=false", f"--temp-dir={tmp}", *common], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        if netns is not None:
            procs.append(subprocess.Popen(netns.command(0, [ray_bin, "start", f"--address={ip}:{port}",
                                                            f"--node-ip-address={netns.addrs[0]}",
                                                            '--resources={"peerhost": 100}', *common]),
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        os.environ.update(env)
        import ray

        deadline = time.monotonic() + 120
        while True:
            try:
                ray.init(address=env["RAY_ADDRESS"], logging_level="ERROR",  # type: ignore[arg-type]  # a name too
                         log_to_driver=False)
                if sum(1 for n in ray.nodes() if n["Alive"]) >= hosts:
                    break
                ray.shutdown()
            except ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not get {hosts} nodes within 120 s")
            time.sleep(1)
        yield env["RAY_ADDRESS"], env, ray
    finally:
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        for proc in reversed(procs):
            for sig in (15, 9):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(15)
                    break
        if netns is not None:
            netns.remove()
        shutil.rmtree(tmp, ignore_errors=True)


def _port() -> int:
    import random

    for _ in range(200):
        port = random.randrange(20000, 30000)  # outside Ray's worker ports (10002-19999)
        with socket.socket() as s:
            with contextlib.suppress(OSError):
                s.bind(("", port))
                return port
    raise RuntimeError("no free port in 20000-30000")


def _round_trip_rows(ray: Any, hosts: int, sizes: list[int], samples: int) -> list[dict[str, Any]]:
    group = f"bench-{secrets.token_hex(4)}"
    A = ray.remote(Driver).options(num_cpus=1)
    B = ray.remote(Peer).options(num_cpus=1, max_concurrency=4,
                                  **({"resources": {"peerhost": 1}} if hosts == 2 else {}))
    a, b = A.remote(0, 2, group), B.remote(1, 2, group)
    ray.get([a.ready.remote(2), b.ready.remote(2)])
    where = ray.get([a.host.remote(), b.host.remote()])
    rows = []
    try:
        for nbytes in sizes:
            n = _samples_for(nbytes, samples)
            for how in ("mq", "ray call", "ray put/get"):
                p50, p99 = _stats(ray.get(a.round_trips.remote(how, b, nbytes, n)))
                rows.append({"hosts": "2 Ray nodes" if hosts == 2 else "1 Ray node", "size": nbytes, "how": how,
                             "samples": n, "p50": p50, "p99": p99, "where": where})
                print(f"  {rows[-1]['hosts']} {format_size(nbytes)} {how}: p50 {p50:.3f} ms p99 {p99:.3f} ms",
                      flush=True)
    finally:
        ray.get([a.stop.remote(), b.stop.remote()])
        for h in (a, b):
            ray.kill(h)
    return rows


def _update_rows(ray: Any, sizes: list[int], samples: int) -> list[dict[str, Any]]:
    group = f"bench-w-{secrets.token_hex(4)}"
    world = SUBSCRIBERS + 1
    a = ray.remote(Driver).options(num_cpus=1).remote(0, world, group)
    subs = [ray.remote(Peer).options(num_cpus=1, max_concurrency=4).remote(r, world, group) for r in range(1, world)]
    ray.get([h.ready.remote(world) for h in [a, *subs]])
    rows = []
    try:
        for nbytes in sizes:
            n = _samples_for(nbytes * SUBSCRIBERS, samples)
            for how in ("mq publish", "ray.put + calls"):
                p50, p99 = _stats(ray.get(a.updates.remote(how, subs, nbytes, n)))
                rows.append({"size": nbytes, "how": how, "samples": n, "p50": p50, "p99": p99})
                print(f"  update x{SUBSCRIBERS} {format_size(nbytes)} {how}: p50 {p50:.2f} ms", flush=True)
    finally:
        ray.get([h.stop.remote() for h in [a, *subs]])
        for h in [a, *subs]:
            ray.kill(h)
    return rows


def report(rt_rows: list[dict[str, Any]], up_rows: list[dict[str, Any]], argv: list[str], seconds: float) -> str:
    import ray
    import torch

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = ["# mq between Ray actors, against Ray's own ways", "",
             f"Run {now}, machine: {os.cpu_count()} cores, {platform.release()}; Python {platform.python_version()}, "
             f"Ray {ray.__version__}, torch {torch.__version__}. Total {seconds:.0f} s.", "",
             "```bash", "python -m mq.tools.bench.ray " + " ".join(argv), "```", "",
             (__doc__ or "").split("\n\n", 2)[2].split("\n\nTimes are")[0].strip(), "",
             "## Round trip A -> B -> A (ms)", "",
             "| placement | size | mq p50 | ray call p50 | ray put/get p50 | mq p99 | ray call p99 | ray put/get p99 "
             "| mq / ray call |",
             "|---|---|---|---|---|---|---|---|---|"]
    keyed = {(r["hosts"], r["size"], r["how"]): r for r in rt_rows}
    for hosts in dict.fromkeys(r["hosts"] for r in rt_rows):
        for size in dict.fromkeys(r["size"] for r in rt_rows if r["hosts"] == hosts):
            m, c, p = (keyed[(hosts, size, h)] for h in ("mq", "ray call", "ray put/get"))
            lines.append(f"| {hosts} | {format_size(size)} | {m['p50']:.3g} | {c['p50']:.3g} | {p['p50']:.3g} | "
                         f"{m['p99']:.3g} | {c['p99']:.3g} | {p['p99']:.3g} | {m['p50'] / c['p50']:.2f}x |")
    if up_rows:
        lines += ["", f"## One weight update to {SUBSCRIBERS} actors on one Ray node (ms, every actor has it)", "",
                  "| size | mq publish p50 | ray.put + calls p50 | mq p99 | ray p99 | mq / ray |",
                  "|---|---|---|---|---|---|"]
        ups = {(r["size"], r["how"]): r for r in up_rows}
        for size in dict.fromkeys(r["size"] for r in up_rows):
            m, r_ = ups[(size, "mq publish")], ups[(size, "ray.put + calls")]
            lines.append(f"| {format_size(size)} | {m['p50']:.3g} | {r_['p50']:.3g} | {m['p99']:.3g} | "
                         f"{r_['p99']:.3g} | {m['p50'] / r_['p50']:.2f}x |")
    placements = {r["hosts"]: r["where"] for r in rt_rows}
    lines += ["", "Actors ran on: " + "; ".join(f"{k}: A on {v[0]}, B on {v[1]}" for k, v in placements.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mq.tools.bench.ray", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=SIZES, help=f"round-trip sizes [default: {SIZES}]")
    parser.add_argument("--weight-sizes", default=WEIGHT_SIZES, help=f"weight update sizes [default: {WEIGHT_SIZES}]")
    parser.add_argument("--samples", type=int, default=50, help="samples per row (fewer for large sizes)")
    parser.add_argument("--hosts", default="1,2", help="placements: 1 (one Ray node), 2 (two), or 1,2")
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)
    # Before Ray is imported (it reads them then): the clusters this run starts use a token of
    # their own, as Ray 2.60 starts clusters.
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                       "RAY_USAGE_STATS_ENABLED": "0"})
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    weights = [parse_size(s) for s in args.weight_sizes.split(",") if s]
    t0 = time.monotonic()
    rt_rows: list[dict[str, Any]] = []
    up_rows: list[dict[str, Any]] = []
    for hosts in (int(h) for h in args.hosts.split(",")):
        with _cluster(hosts) as (_address, _env, ray):
            print(f"{hosts} Ray node(s):", flush=True)
            rt_rows += _round_trip_rows(ray, hosts, sizes, args.samples)
            if hosts == 1 and weights:
                up_rows += _update_rows(ray, weights, args.samples)
    text = report(rt_rows, up_rows, sys.argv[1:] if argv is None else argv, time.monotonic() - t0)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
