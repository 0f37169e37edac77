"""Kill-anywhere stress harness (issue 45): a node blocked on a peer must never hang when that
peer dies, freezes or is cut off.

Each run has a survivor node S and a victim node V in separate processes. S blocks on V in one
*operation*; at a random moment while S is blocked (the operation has not returned for 0.3 s,
then a further uniform 0-0.5 s) V is hit by one *kill mode*. The harness measures the time from
the hit to the end of S's operation, and what it raised::

    python -m mq.tools.stress --route tcp,ipc,shm,tcp-hosts,torchrpc,rdma --load 0,2,4 --runs 200 \\
        [--ops send-window,call] [--kills sigkill,sigstop,cut] [--seed N] [--peer-timeout 4] [--json FILE]

A run passes when S's operation raised ``mq.PeerLost`` naming V (for ``stop``: ``stop()``
returned, with an ``mq.Undelivered`` naming V or None) within ``peer_timeout + 1`` s of the hit.
Still blocked ``peer_timeout + 10`` s after the hit is a HANG: S's stacks go into the report,
everything of the run is killed, and the next run starts. Exit status 1 if any run failed.

How it runs (a tool, built on mq's public API only):

- nng routes: S lives in this process and is kept across runs (a new one after a ``stop`` run
  and after any failed run); each V is forked from a *zygote*, a process that imported mq once
  (on the namespace routes, a zygote on the second host). V's node id is new each run.
- torchrpc: torch allows one RPC agent per process and its shutdown may hang after a peer died,
  so S and V are both forked per run from a zygote that imported torch; S runs the same
  operation code there and reports its outcome over a socket.
- cut: the host end of the veth to the second host is set down (no FIN, no RST: only silence
  tells), and set up again once the run is over.

Everything started here (zygotes, victims, namespaces, load processes) dies with this process,
also on Ctrl-C, SIGTERM and errors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

from mq.tools.stress_procs import Zygote, zygote_main
from mq.tools.stress_run import (KILLS, NNG_PROTOCOL, ON_HOSTS, OP_TIMEOUT, OPS, POOL_BYTES, ROUTE_KIND, ROUTES,
                                 SELFTEST_OPS, SURVIVOR_ID, Config, PidHitter, classify, execute, kills_for, ops_for)

__all__ = ["KILLS", "OPS", "ROUTES", "Config", "main", "route_unavailable", "run_matrix"]


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _LogTail(logging.Handler):
    """The last mq log lines of this process (attached to failed runs)."""

    def __init__(self, keep: int = 40):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.keep = keep
        self.setFormatter(logging.Formatter("%(relativeCreated)9.0fms %(threadName)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.lines.append(self.format(record))
            del self.lines[:-self.keep]

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


# ------------------------------------------------------------------------------ routes
class RouteSkipped(Exception):
    pass


class NngRoute:
    """An nng route: S here (kept across runs), V forked from a zygote (on the second host for
    tcp-hosts and rdma)."""

    def __init__(self, route: str, cfg: Config, env: "Environment"):
        self.route, self.cfg, self.env = route, cfg, env
        self.hosts = env.hosts() if route in ON_HOSTS else None
        self.zygote = env.zygote("hosts" if self.hosts else "local")
        self.S: Any = None
        self.generation = 0
        self.next_vid = 1

    def _survivor(self) -> Any:
        import mq

        if self.S is not None and self.S.running:
            return self.S
        self.close_survivor()
        opts: dict[str, Any] = dict(timeout=OP_TIMEOUT, peer_timeout=self.cfg.peer_timeout,
                                    heartbeat=self.cfg.heartbeat, protocol=NNG_PROTOCOL[self.route],
                                    rdma="tcp" if self.route == "rdma" else False)
        host = self.hosts.host_addr if self.hosts else "127.0.0.1"
        opts["listen_to"] = f"tcp://{host}:0"
        if self.route == "shm":
            opts["shm_pool_bytes"] = POOL_BYTES
        if self.route == "rdma":
            opts["rdma_pool_bytes"] = POOL_BYTES
        # A new id for every S: its threads (mq<id>-...) are told from those of an abandoned one.
        self.generation += 1
        self.S = mq.create("nng", SURVIVOR_ID + self.generation, "survivor", **opts)
        self.S.listen()
        self.next_vid = 1
        return self.S

    def close_survivor(self, timeout: float = 5.0) -> str | None:
        """Stop S (bounded: a stop() that does not return is abandoned and said so)."""
        S, self.S = self.S, None
        if S is None:
            return None
        done = threading.Event()

        def stop() -> None:
            with contextlib.suppress(Exception):
                S.stop(timeout=timeout, raise_undelivered=False)
            done.set()

        threading.Thread(target=stop, daemon=True, name="stress-stop-S").start()
        if not done.wait(timeout + 5):
            return f"S.stop(timeout={timeout:g}) did not return within {timeout + 5:g}s: S abandoned"
        return None

    def run(self, op: str, kill: str, i: int, rng: random.Random) -> dict[str, Any]:
        cfg = self.cfg
        S = self._survivor()
        vid, self.next_vid = self.next_vid, self.next_vid + 1
        topic = f"t{vid}"
        spec = {"role": "victim", "mq_type": "nng", "vid": vid, "sid": S.node_id, "op": op, "topic": topic,
                "attach": S.addresses["tcp"], "protocol": NNG_PROTOCOL[self.route],
                "rdma": "tcp" if self.route == "rdma" else False,
                "listen": f"tcp://{self.hosts.peer_addr}:0" if self.hosts else None,
                "peer_timeout": cfg.peer_timeout, "heartbeat": cfg.heartbeat, "setup_s": cfg.setup_s}
        res: dict[str, Any] = {"vid": vid}
        t0 = time.monotonic()
        v = self.zygote.fork(spec)
        try:
            try:
                hello = v.recv(cfg.setup_s + 5)
            except TimeoutError:
                hello = None
            if not (isinstance(hello, dict) and hello.get("ready")):
                res["error"] = f"the victim did not get ready: {_short(hello)}"
                return res
            S.wait_for_peers(ids=[vid], timeout=cfg.setup_s)
            res["joined_s"] = round(time.monotonic() - t0, 3)
            route = S.routes().get(vid)
            res["route_kind"] = route.kind if route else None
            if res["route_kind"] != ROUTE_KIND[self.route]:
                res["error"] = (f"route to V is {res['route_kind']!r}, not {ROUTE_KIND[self.route]!r}: "
                                f"{route.reason if route else 'no route'}")
                return res
            cut = (lambda down: self.env.cut(self.hosts, down)) if self.hosts else None
            res.update(execute(S, vid, op, kill, topic, PidHitter(v.pid, cut), rng, cfg))
            return res
        finally:
            v.kill()
            if self.hosts is not None:
                self.env.cut(self.hosts, False)  # never leave it cut

    def after(self, res: dict[str, Any], outcome: str, op: str) -> None:
        """A new S after a stop run, a failed run, or always with --fresh-survivor."""
        if op == "stop" or outcome != "pass" or self.cfg.fresh_survivor:
            note = self.close_survivor()
            if note:
                res["note"] = note

    def close(self) -> None:
        self.close_survivor()


class TorchRoute:
    """torchrpc:cpu: S and V forked per run from a zygote that imported torch; S reports its
    outcome over its socket."""

    def __init__(self, route: str, cfg: Config, env: "Environment"):
        self.route, self.cfg, self.env = route, cfg, env
        self.zygote = env.zygote("torch")

    def run(self, op: str, kill: str, i: int, rng: random.Random) -> dict[str, Any]:
        cfg = self.cfg
        init = f"tcp://127.0.0.1:{_free_port()}"
        topic = "t1"
        common = {"mq_type": "torchrpc:cpu", "sid": 0, "op": op, "topic": topic, "init_method": init,
                  "peer_timeout": cfg.peer_timeout, "heartbeat": cfg.heartbeat, "setup_s": cfg.setup_s}
        res: dict[str, Any] = {"vid": 1}
        v = self.zygote.fork({"role": "victim", "vid": 1, **common})
        s = None
        try:
            s = self.zygote.fork({"role": "survivor", "vid": 1, "kill": kill, "victim_pid": v.pid,
                                  "rng": rng.getstate(), "cfg": dataclasses.asdict(cfg), **common})
            deadline = time.monotonic() + 2 * cfg.setup_s + cfg.never_blocked_s + cfg.hang_limit_s + 30
            watch = [s, v]
            while True:
                ready, _, _ = select.select([c.sock for c in watch], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    res["hang"] = True
                    res["stack"] = "the torchrpc S process did not report in time; " + _py_spy(s.pid)
                    return res
                if v in watch and v.sock in ready:
                    msg = v.recv(5)
                    if msg is None:  # V died (S killed it): only S reports from here
                        watch.remove(v)
                    elif isinstance(msg, dict) and msg.get("error"):
                        res["error"] = f"the victim failed: {_short(msg)}"
                        return res
                if s.sock in ready:
                    msg = s.recv(5)
                    if msg is None:
                        res["error"] = "the torchrpc S process died without a report"
                        return res
                    if "result" in msg:
                        res.update(msg["result"])
                        return res
                    if msg.get("error"):
                        res["error"] = f"S failed: {_short(msg)}"
                        return res
        finally:
            if s is not None:
                s.kill()
            v.kill()

    def after(self, res: dict[str, Any], outcome: str, op: str) -> None:
        pass

    def close(self) -> None:
        pass


def _py_spy(pid: int) -> str:
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        return "(py-spy not installed: no stacks)"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        return f"py-spy dump --pid {pid}:\n{done.stdout}{done.stderr}"
    except Exception as exc:
        return f"(py-spy failed: {exc})"


def _short(obj: Any, n: int = 2000) -> str:
    text = obj.get("error") if isinstance(obj, dict) and obj.get("error") else repr(obj)
    return text[-n:]  # type: ignore[index]  # the error's text, or the repr: a str


# ------------------------------------------------------------------------------ environment
class Environment:
    """What the runs share, made on first use and removed at close: zygotes, the namespace host."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._hosts: Any = None
        self._zygotes: dict[str, Zygote] = {}
        self._cut_down = False

    def hosts(self) -> Any:
        if self._hosts is None:
            from mq.tools.netns import TwoHosts, unavailable

            reason = unavailable()
            if reason:
                raise RouteSkipped(reason)
            self._hosts = TwoHosts().create()
        return self._hosts

    def zygote(self, kind: str) -> Zygote:
        z = self._zygotes.get(kind)
        if z is not None and not z.alive():
            z.close()
            z = None
        if z is None:
            prefix = self.hosts().command([]) if kind == "hosts" else None
            z = self._zygotes[kind] = Zygote(kind, prefix, torch=kind == "torch")
        return z

    def cut(self, hosts: Any, down: bool) -> None:
        """Cut (or restore) the link to the second host: its veth end here set down (up)."""
        if down == self._cut_down:
            return
        done = subprocess.run(["ip", "link", "set", hosts.host_if, "down" if down else "up"],
                              capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            raise RuntimeError(f"ip link set {hosts.host_if} {'down' if down else 'up'}: {done.stderr.strip()}")
        self._cut_down = down
        if not down:  # the prefix route comes back with the link; wait until it is usable
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                r = subprocess.run(["ip", "route", "get", hosts.peer_addr], capture_output=True, text=True)
                if r.returncode == 0 and hosts.host_if in r.stdout:
                    break
                time.sleep(0.02)

    def close(self) -> None:
        for z in self._zygotes.values():
            z.close()
        self._zygotes.clear()
        if self._hosts is not None:
            with contextlib.suppress(Exception):
                self.cut(self._hosts, False)
            self._hosts.remove()
            self._hosts = None


def route_unavailable(route: str) -> str | None:
    """Why ``route`` cannot run here, or None."""
    if route in ON_HOSTS:
        from mq.tools.netns import unavailable

        reason = unavailable()
        if reason:
            return f"needs a namespace host: {reason}"
    if route == "rdma":
        import importlib

        errors = []
        for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):  # what mq's rdma path loads
            try:
                importlib.import_module(name)
                break
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        else:
            return "needs NIXL (pip install '.[rdma]'): " + "; ".join(errors)
    if route == "torchrpc":
        try:
            import torch.distributed.rpc as rpc
        except ImportError as exc:
            return f"needs torch: {exc}"
        if not rpc.is_available():
            return "this torch has no RPC support"
    return None


# ------------------------------------------------------------------------------ the matrix
def _schedule(route: str, runs: int, ops: list[str] | None, kills: list[str] | None) -> list[tuple[str, str]]:
    """(op, kill) for each run: ops round-robin, each kill mode for a whole round of ops."""
    route_ops = [o for o in (ops or ops_for(route)) if o in ops_for(route) or o in SELFTEST_OPS]
    route_kills = [k for k in (kills or kills_for(route)) if k in kills_for(route)]
    if not route_ops or not route_kills:
        return []
    return [(route_ops[i % len(route_ops)], route_kills[(i // len(route_ops)) % len(route_kills)])
            for i in range(runs)]


def _line(r: dict[str, Any]) -> str:
    secs = f"{r['seconds']:7.3f}s" if r.get("seconds") is not None else "      - "
    what = r.get("error") or r.get("raised") or (f"returned {r['returned']}" if r.get("returned") else "")
    if r["outcome"] == "hang":
        what = f"still blocked {r['hang_limit_s']:g}s after the hit"
    what = " ".join(str(what).split())
    return (f"{r['route']:<9} load={r['load']:<2} {r['run']:>4} {r['op']:<12} {r['kill']:<8} "
            f"{r['outcome'].upper() if r['outcome'] != 'pass' else 'pass':<6} {secs}  {what[:150]}")


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        row = rows.setdefault((r["route"], r["load"]), {"route": r["route"], "load": r["load"], "runs": 0, "passed": 0,
                                                       "slow": 0, "wrong": 0, "hangs": 0, "errors": 0, "_secs": []})
        row["runs"] += 1
        key = {"pass": "passed", "slow": "slow", "wrong": "wrong", "hang": "hangs", "error": "errors"}[r["outcome"]]
        row[key] += 1
        if r.get("seconds") is not None:
            row["_secs"].append(r["seconds"])
    out = []
    for row in rows.values():
        secs = row.pop("_secs")
        row["worst_s"] = round(max(secs), 3) if secs else None
        row["p50_s"] = round(statistics.median(secs), 3) if secs else None
        out.append(row)
    return out


def _table(summary: list[dict[str, Any]]) -> str:
    head = f"{'route':<10}{'load':>5}{'runs':>6}{'passed':>8}{'slow':>6}{'wrong':>7}{'hangs':>7}{'errors':>8}" \
           f"{'worst s':>9}{'p50 s':>8}"
    lines = [head, "-" * len(head)]

    def fmt(v: float | None) -> str:
        return f"{v:.3f}" if v is not None else "-"

    for row in summary:
        lines.append(f"{row['route']:<10}{row['load']:>5}{row['runs']:>6}{row['passed']:>8}{row['slow']:>6}"
                     f"{row['wrong']:>7}{row['hangs']:>7}{row['errors']:>8}{fmt(row['worst_s']):>9}"
                     f"{fmt(row['p50_s']):>8}")
    return "\n".join(lines)


def run_matrix(routes: list[str], loads: list[int], runs: int, cfg: Config, *, ops: list[str] | None = None,
               kills: list[str] | None = None, out: Callable[[str], None] = print,
               results: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run ``runs`` runs per route and load; returns ``{"runs": [...], "summary": [...], "skipped": {...}}``.
    ``results`` (appended to as runs end) keeps what ran when this is interrupted."""
    from mq.tools.load import BackgroundLoad

    results = [] if results is None else results
    skipped: dict[str, str] = {}
    matrix = _Matrix(cfg, out, results)
    try:
        for route in routes:
            reason = route_unavailable(route)
            if reason:
                skipped[route] = reason
                out(f"{route}: skipped: {reason}")
        live = [r for r in routes if r not in skipped]
        for load in loads:
            with BackgroundLoad(load):
                for route in live:
                    schedule = _schedule(route, runs, ops, kills)
                    if not schedule:
                        skipped.setdefault(route, "no operation or kill mode asked for applies to it")
                        continue
                    why = matrix.route(route, load, schedule)
                    if why:
                        skipped[route] = why
                        out(f"{route}: skipped: {why}")
    finally:
        matrix.close()
    return {"runs": results, "summary": summarize(results), "skipped": skipped}


class _Matrix:
    """The runs of one invocation: the shared environment, S's log, the stacks seen so far."""

    def __init__(self, cfg: Config, out: Callable[[str], None], results: list[dict[str, Any]]):
        self.cfg, self.out, self.results = cfg, out, results
        self.env = Environment(cfg)
        self.tail = _LogTail()
        self.seen_stacks: dict[str, dict[str, Any]] = {}
        self._log = logging.getLogger("mq")
        self._saved = (self._log.level, self._log.propagate)
        self._log.addHandler(self.tail)
        self._log.setLevel(logging.INFO)
        self._log.propagate = False  # S's lost peers (every run) go to the failed runs' reports

    def route(self, route: str, load: int, schedule: list[tuple[str, str]]) -> str | None:
        """Every run of ``schedule`` on ``route``; why the route was skipped, or None."""
        try:
            runner: Any = (TorchRoute if route == "torchrpc" else NngRoute)(route, self.cfg, self.env)
        except RouteSkipped as exc:
            return str(exc)
        except Exception as exc:  # any: cannot run here: one error for the route
            self._record({"route": route, "load": load, "run": 0, "op": "-", "kill": "-", "outcome": "error",
                          "error": f"cannot start the route: {type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()})
            return None
        try:
            for i, (op, kill) in enumerate(schedule):
                self._one(runner, route, load, i, op, kill)
        finally:
            runner.close()
        return None

    def _one(self, runner: Any, route: str, load: int, i: int, op: str, kill: str) -> None:
        cfg = self.cfg
        rng = random.Random(f"{cfg.seed}/{route}/{load}/{i}")
        t0 = time.monotonic()
        self.tail.take()
        try:
            res = runner.run(op, kill, i, rng)
        except Exception as exc:  # any: a broken run is an error, not the end
            res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        outcome = classify(res, op, res.get("vid", -1), cfg)
        res.update(route=route, load=load, run=i, op=op, kill=kill, outcome=outcome, bound_s=cfg.bound_s,
                   hang_limit_s=cfg.hang_limit_s, wall_s=round(time.monotonic() - t0, 3))
        if res.get("seconds") is not None:
            res["seconds"] = round(res["seconds"], 4)
        res.pop("hit", None)
        runner.after(res, outcome, op)
        if outcome != "pass":
            res["log"] = self.tail.take()
        self._record(res)

    def _record(self, res: dict[str, Any]) -> None:
        self.results.append(res)
        self.out(_line(res))
        if res["outcome"] == "hang" and res.get("stack"):
            first = self.seen_stacks.setdefault(_signature(res["stack"]), res)
            self.out(_indent(res["stack"]) if first is res else
                     f"    S's operation blocked where it was in run {first['run']} ({first['route']}, "
                     f"load {first['load']}, {first['op']}, {first['kill']})")
        if res["outcome"] == "error" and self.cfg.verbose and res.get("traceback"):
            self.out(_indent(res["traceback"]))

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            self._log.removeHandler(self.tail)
            self._log.setLevel(self._saved[0])
            self._log.propagate = self._saved[1]


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _signature(stack: str) -> str:
    """A stack without line numbers' noise: what makes two hangs the same hang."""
    return re.sub(r", line \d+", "", stack)


def blocked_where(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """route -> op -> where in mq S's operation waited at the hit -> runs: which wait each run tried."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in results:
        if r.get("blocked_in"):
            where = out.setdefault(r["route"], {}).setdefault(r["op"], {})
            where[r["blocked_in"]] = where.get(r["blocked_in"], 0) + 1
    return out


def report(result: dict[str, Any], out: Callable[[str], None] = print, *, verbose: bool = False) -> None:
    """The summary table, every failed run, and each distinct stack S hung in; ``verbose``:
    also where S's operations waited when V was hit."""
    out("")
    out(_table(result["summary"]) if result["summary"] else "no runs")
    if verbose:
        out("\nwhere S waited when V was hit (runs):")
        for route, ops in blocked_where(result["runs"]).items():
            for op, where in ops.items():
                out(f"  {route:<9} {op:<12} " + "; ".join(f"{w} ({n})" for w, n in where.items()))
    for route, reason in result["skipped"].items():
        out(f"{route}: skipped: {reason}")
    failed = [r for r in result["runs"] if r["outcome"] != "pass"]
    if not failed:
        return
    out(f"\n{len(failed)} failed run(s):")
    for r in failed:
        out(_line(r))
        for key in ("raised", "returned", "error", "note"):
            if r.get(key) and (key != "error" or len(r[key]) > 150):
                out(_indent(f"{key}: {r[key]}"))
        if r.get("raised_traceback"):
            out(_indent(r["raised_traceback"]))
    hangs: dict[str, list[dict[str, Any]]] = {}
    for r in failed:
        if r.get("stack"):
            hangs.setdefault(_signature(r["stack"]), []).append(r)
    for i, runs in enumerate(hangs.values(), 1):
        names = ", ".join(f"{r['route']}/load {r['load']}/run {r['run']} {r['op']} {r['kill']}" for r in runs)
        out(f"\nhang {i} of {len(hangs)}: {len(runs)} run(s): {names}")
        out("  S's operation, still blocked at the hang limit:")
        out(_indent(runs[0]["stack"]))
        if runs[0].get("mq_threads"):
            out("  S's mq threads then:")
            out(_indent(runs[0]["mq_threads"]))
        if runs[0].get("log"):
            out("  mq log of S (last lines):")
            out(_indent("\n".join(runs[0]["log"][-8:])))
    others = [r for r in failed if not r.get("stack") and r.get("log")]
    for r in others[:10]:
        out(f"\nmq log of S in {r['route']}/load {r['load']}/run {r['run']} {r['op']} {r['kill']} ({r['outcome']}):")
        out(_indent("\n".join(r["log"][-8:])))


# ------------------------------------------------------------------------------ CLI
def _csv(choices: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or '(none)'}: choose from {', '.join(choices)}")
        return items
    return parse


def _loads(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--load: numbers of processes, e.g. 0,2,4; got {text!r}") from None
    if not out or any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"--load: numbers >= 0, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mq.tools.stress", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--route", type=_csv(ROUTES), default=list(ROUTES),
                   help=f"routes, comma-separated: {', '.join(ROUTES)} (default: all; those this machine "
                        "cannot run are skipped, with the reason)")
    p.add_argument("--load", type=_loads, default=[0], help="background load(s): CPU-bound processes, e.g. 0,2,4")
    p.add_argument("--runs", type=int, default=20, help="runs per route and load (default 20)")
    p.add_argument("--ops", type=_csv(OPS + SELFTEST_OPS), default=None,
                   help=f"operations (default: all that apply): {', '.join(OPS)}")
    p.add_argument("--kills", type=_csv(KILLS), default=None,
                   help=f"kill modes (default: all that apply): {', '.join(KILLS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the random moments of the hits")
    p.add_argument("--peer-timeout", type=float, default=4.0, help="nodes' peer_timeout (default 4)")
    p.add_argument("--heartbeat", type=float, default=None, help="nodes' heartbeat (default min(1, peer_timeout/4))")
    p.add_argument("--hang-after", type=float, default=10.0,
                   help="a run still blocked peer_timeout + this many seconds after the hit is a hang (default 10)")
    p.add_argument("--slack", type=float, default=1.0,
                   help="a run passes when it ended within peer_timeout + this many seconds of the hit (default 1)")
    p.add_argument("--fresh-survivor", action="store_true", help="a new S for every run (nng routes)")
    p.add_argument("--json", metavar="FILE", help="write every run and the summary here")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also where each operation waited when V was hit, and tracebacks of harness errors")
    p.add_argument("--zygote", type=int, help=argparse.SUPPRESS)
    p.add_argument("--torch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zygote is not None:
        zygote_main(args.zygote, args.torch)
        return 0
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if not 0 < args.peer_timeout < 3600:
        p.error("--peer-timeout must be in (0, 3600)")
    cfg = Config(peer_timeout=args.peer_timeout, heartbeat=args.heartbeat or min(1.0, args.peer_timeout / 4),
                 seed=args.seed, hang_s=args.hang_after, slack_s=args.slack, fresh_survivor=args.fresh_survivor,
                 verbose=args.verbose)

    def out(line: str) -> None:
        print(line, flush=True)

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    out(f"mq stress: routes {','.join(args.route)}, loads {','.join(map(str, args.load))}, {args.runs} runs each, "
        f"peer_timeout {cfg.peer_timeout:g}s, heartbeat {cfg.heartbeat:g}s, pass within {cfg.bound_s:g}s, "
        f"hang at {cfg.hang_limit_s:g}s, seed {cfg.seed}")
    results: list[dict[str, Any]] = []
    interrupted = False
    try:
        result = run_matrix(args.route, args.load, args.runs, cfg, ops=args.ops, kills=args.kills, out=out,
                            results=results)
    except KeyboardInterrupt:
        interrupted = True
        out("interrupted: everything started was stopped; the runs that ended:")
        result = {"runs": results, "summary": summarize(results), "skipped": {}}
    report(result, out, verbose=args.verbose)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**dataclasses.asdict(cfg), "routes": args.route, "loads": args.load,
                                  "runs": args.runs, "ops": args.ops, "kills": args.kills},
                       "interrupted": interrupted, "blocked_in": blocked_where(result["runs"]), **result}, f, indent=1)
    if interrupted:
        return 130
    if not result["runs"]:
        out("nothing ran")
        return 2
    return 1 if any(r["outcome"] != "pass" for r in result["runs"]) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # an abandoned S (a hung stop()) must not keep this process alive
