"""DI-engine ``emit``/``on`` latency and throughput on DI-engine's own nng bus against ``mq:nng``
and ``mq:torchrpc:cpu``, in one run (issue 25, item 4). It runs in DI-engine's environment:

    .ding-venv/bin/python -m tests.ding_jobs.bench --runs 3 --out FILE   # scripts/bench-pages ding

Every job is ``Parallel.runner(n_parallel_workers=2, mq_type=BUS, startup_interval=0)(worker)``
(DI-engine's launcher, its defaults otherwise: ``protocol="ipc"``, mesh), started in a process
session of its own and killed if it runs past ``--job-timeout``. A run starts one job per bus,
the order rotated from run to run (the buses interleave); ``--runs`` repeats the whole run.

In a job, worker 0 emits and worker 1 answers; both use only ``router.on``/``router.emit``, so
DI-engine pickles every event (its ``{"a": args, "k": kwargs}`` with the highest protocol) and
unpickles it on its listener thread, and the handlers run on DI-engine's event-loop threads:

- latency, small: ``emit("b_ping", seq, event)`` with ``event`` a dict of a few numbers; worker 1
  answers ``emit("b_pong", seq, event)`` (the same dict back). Round trip, ``--lat-small`` samples
  after a warm-up.
- latency, model: worker 0 emits what DI-engine's ``ModelExchanger`` emits,
  ``{"id": seq, "model": state_dict, "time": time()}`` with ``state_dict`` an ``OrderedDict`` of
  float32 torch tensors totalling ``--model-mb`` MB; worker 1 answers with a small ``b_pong``.
  ``--lat-model`` samples after a warm-up.
- throughput: a burst of N emits (``--burst-small`` small events, ``--burst-model`` model
  states), then ``b_burst_end``; worker 1 answers ``b_burst_ack`` with how many of the N it
  received. The time is from the first emit to the ack; ``--bursts`` bursts per job. Worker 0
  says ``b_burst_end`` again every 50 ms until it is acked (a bus that drops may lose it).

A sample that gets no answer within ``--wait`` seconds counts as lost (DI-engine's NNG ``Bus0``
drops under load and retries nothing). The table gives, per bus, the median of each run's median
and the spread (min-max) of the run medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import mq.integrations.ding  # noqa: F401  (registers mq:nng, mq:torchrpc:cpu, mq:torchrpc:cuda)
from ding.framework import Parallel

BUSES = ["nng", "mq:nng", "mq:torchrpc:cpu"]
ROOT = Path(__file__).resolve().parents[2]


def small_event(seq: int) -> dict:
    return {"id": seq, "env_step": 1000 + seq, "reward": 1.5, "loss": 0.0123, "eps": 0.05}


def model_state(mb: float) -> "OrderedDict":
    """A state_dict of float32 tensors, ``mb`` MB (10**6 bytes) in all, shaped like an MLP's."""
    import torch

    n = max(1, int(mb * 1e6) // 4)
    g = torch.Generator().manual_seed(0)
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    return OrderedDict((f"layer{i}.{'weight' if i % 2 == 0 else 'bias'}", torch.rand(s, generator=g))
                       for i, s in enumerate(sizes))


# ---------------------------------------------------------------------- the two workers
def worker(cfg: dict) -> None:
    router = Parallel()
    if router.node_id == 0:
        _emitter(router, cfg)
    else:
        _answerer(router, cfg)


def _answerer(router: Parallel, cfg: dict) -> None:
    done = threading.Event()
    lock = threading.Lock()
    counts: dict = {}

    def on_ping(seq, event, echo):
        router.emit("b_pong", seq, event if echo else None)

    def on_burst(tag, seq, event):
        with lock:
            counts[tag] = counts.get(tag, 0) + 1

    def on_burst_end(tag, n):
        # DI-engine runs handlers on a pool of 2 threads: the last burst event may still be in its
        # handler (a counter; DI-engine unpickled it already). Wait for it: until all N arrived or
        # the count stood still for 5 ms (a bus that dropped some), then say how many arrived.
        last, still = -1, time.perf_counter()
        while True:
            with lock:
                got = counts.get(tag, 0)
            if got >= n:
                break
            if got != last:
                last, still = got, time.perf_counter()
            elif time.perf_counter() - still > 0.005:
                break
            time.sleep(0.0005)
        router.emit("b_burst_ack", tag, got)

    router.on("b_hello", lambda: router.emit("b_hello_ack"))
    router.on("b_ping", on_ping)
    router.on("b_burst", on_burst)
    router.on("b_burst_end", on_burst_end)
    router.on("b_done", lambda: done.set())
    done.wait(cfg["job_timeout"])
    time.sleep(0.3)  # let the last answers leave before DI-engine stops the queue


def _emitter(router: Parallel, cfg: dict) -> None:
    wait = cfg["wait"]
    hello = threading.Event()
    pongs: dict = {}
    pong_cv = threading.Condition()
    acks: dict = {}

    def on_pong(seq, _event):
        with pong_cv:
            pongs[seq] = time.perf_counter()
            pong_cv.notify_all()

    def on_ack(tag, got):
        with pong_cv:
            acks[tag] = (time.perf_counter(), got)
            pong_cv.notify_all()

    router.on("b_hello_ack", lambda: hello.set())
    router.on("b_pong", on_pong)
    router.on("b_burst_ack", on_ack)
    t0 = time.monotonic()
    while not hello.is_set() and time.monotonic() - t0 < 60:  # both joined and subscribed
        router.emit("b_hello")
        hello.wait(0.1)
    if not hello.is_set():
        raise RuntimeError("worker 1 never answered b_hello within 60 s")
    time.sleep(0.2)

    state = model_state(cfg["model_mb"])
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    seq = iter(range(10**9))

    def wait_until(table: dict, key, timeout: float) -> bool:
        with pong_cv:
            return pong_cv.wait_for(lambda: key in table, timeout=timeout)

    def wait_for(table: dict, key) -> bool:
        return wait_until(table, key, wait)

    def round_trips(n: int, warm: int, model: bool) -> tuple[list[float], int]:
        rtts, lost = [], 0
        for i in range(warm + n):
            s = next(seq)
            start = time.perf_counter()
            if model:
                router.emit("b_ping", s, {"id": s, "model": state, "time": time.time()}, False)
            else:
                router.emit("b_ping", s, small_event(s), True)
            if not wait_for(pongs, s):
                lost += i >= warm
                continue
            if i >= warm:
                rtts.append(pongs[s] - start)
        return rtts, lost

    def bursts(n: int, count: int, model: bool) -> tuple[list[float], list[int]]:
        rates, got = [], []
        for _ in range(count):
            tag = next(seq)
            start = time.perf_counter()
            for i in range(n):
                if model:
                    router.emit("b_burst", tag, i, {"id": i, "model": state, "time": time.time()})
                else:
                    router.emit("b_burst", tag, i, small_event(i))
            router.emit("b_burst_end", tag, n)
            deadline = time.monotonic() + wait
            while not wait_until(acks, tag, 0.05):  # DI-engine's bus may drop the end or the ack:
                if time.monotonic() > deadline:     # say it again until answered
                    break
                router.emit("b_burst_end", tag, n)
            if tag not in acks:
                got.append(None)  # not even the ack came back: nothing known
                continue
            end, received = acks[tag]
            got.append(received)
            rates.append(received / (end - start))
        return rates, got

    res = {"bus": cfg["bus"], "model_bytes": model_bytes, "queue": type(router._mq).__name__}
    res["lat_small"], res["lat_small_lost"] = round_trips(cfg["lat_small"], max(5, cfg["lat_small"] // 10), False)
    res["lat_model"], res["lat_model_lost"] = round_trips(cfg["lat_model"], 2, True)
    res["tput_small"], res["tput_small_got"] = bursts(cfg["burst_small"], cfg["bursts"], False)
    res["tput_model"], res["tput_model_got"] = bursts(cfg["burst_model"], cfg["bursts"], True)
    Path(cfg["result"]).write_text(json.dumps(res))
    for _ in range(5):
        router.emit("b_done")
        time.sleep(0.05)


# ---------------------------------------------------------------------- one job, all jobs
def one_job(bus: str, cfg: dict) -> None:
    """In a child process: DI-engine's launcher, two workers, one bus."""
    Parallel.runner(n_parallel_workers=2, mq_type=bus, startup_interval=0)(worker, {**cfg, "bus": bus})


def run_job(bus: str, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="ding-bench-") as tmp:
        result = Path(tmp) / "result.json"
        args = [sys.executable, "-m", "tests.ding_jobs.bench", "--one", bus, "--cfg",
                json.dumps({**cfg, "result": str(result)})]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        started = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=cfg["job_timeout"])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # DI-engine's spawned workers, if any outlived it
            except ProcessLookupError:
                pass
        if not result.exists():
            return {"bus": bus, "error": f"rc={proc.returncode} after {time.monotonic() - started:.0f} s: "
                                         + "\n".join(out.strip().splitlines()[-15:])}
        res = json.loads(result.read_text())
        res["job_s"] = time.monotonic() - started
        return res


def _med(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def _cell(per_run: list, scale: float, fmt: str) -> str:
    vals = [v * scale for v in per_run if v is not None]
    if not vals:
        return "n/a"
    mid = statistics.median(vals)
    return f"{mid:{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})" if len(vals) > 1 else f"{mid:{fmt}}"


def report(results: list[dict], cfg: dict, command: str) -> str:
    mb = cfg["model_mb"]
    lines = [
        "# DI-engine emit/on: DI-engine's nng bus vs mq:nng vs mq:torchrpc:cpu",
        "",
        f"Command: `{command}`",
        "",
        f"{cfg['runs']} run(s); each run starts one 2-worker job per bus (`Parallel.runner(n_parallel_workers=2, "
        f"mq_type=..., startup_interval=0)`, protocol ipc, one host), bus order rotated per run. Per job: "
        f"{cfg['lat_small']} small round trips, {cfg['lat_model']} model round trips, {cfg['bursts']} bursts "
        f"of {cfg['burst_small']} small events and {cfg['bursts']} of {cfg['burst_model']} model states. "
        f"Each cell: median of the per-run medians (min-max of the run medians). Small event: a dict of 5 "
        f"numbers, echoed back. Model: `{{'id', 'model': state_dict, 'time'}}` as DI-engine's ModelExchanger "
        f"emits it, state_dict of float32 torch tensors, {mb:g} MB, answered with a small event. "
        f"Throughput: from the first emit of the burst to worker 1's ack, counting only what arrived "
        f"(the end of a burst is said again every 50 ms until acked, as a bus that drops may lose it). "
        f"Lost: round trips without an answer within {cfg['wait']:g} s; burst events that never arrived.",
        "",
        f"| bus | small RTT (us) | {mb:g} MB model RTT (ms) | small emits/s | {mb:g} MB model emits: MB/s "
        f"| lost (small RTT / model RTT / small burst / model burst) |",
        "|---|---|---|---|---|---|",
    ]
    for bus in BUSES:
        rows = [r for r in results if r["bus"] == bus and "error" not in r]
        errors = [r["error"] for r in results if r["bus"] == bus and "error" in r]
        if not rows:
            lines.append(f"| `{bus}` | failed | | | | {len(errors)} job(s) failed |")
            continue
        model_bytes = rows[0]["model_bytes"]
        def burst_lost(key: str, n: int) -> str:
            got = [g for r in rows for g in r[key]]
            text = str(sum(n - g for g in got if g is not None))
            unanswered = sum(g is None for g in got)
            return text + (f" (+{unanswered} bursts unanswered)" if unanswered else "")

        lost = (sum(r["lat_small_lost"] for r in rows), sum(r["lat_model_lost"] for r in rows),
                burst_lost("tput_small_got", cfg["burst_small"]), burst_lost("tput_model_got", cfg["burst_model"]))
        lines.append(
            f"| `{bus}` | {_cell([_med(r['lat_small']) for r in rows], 1e6, '.0f')} "
            f"| {_cell([_med(r['lat_model']) for r in rows], 1e3, '.1f')} "
            f"| {_cell([_med(r['tput_small']) for r in rows], 1, ',.0f')} "
            f"| {_cell([_med(r['tput_model']) for r in rows], model_bytes / 1e6, ',.0f')} "
            f"| {' / '.join(map(str, lost))}"
            + (f"; {len(errors)} job(s) failed" if errors else "") + " |")
    errs = [f"- `{r['bus']}`: {r['error']}" for r in results if "error" in r]
    if errs:
        lines += ["", "Failed jobs:", ""] + errs
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.ding_jobs.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--lat-small", type=int, default=200)
    p.add_argument("--lat-model", type=int, default=20)
    p.add_argument("--burst-small", type=int, default=2000)
    p.add_argument("--burst-model", type=int, default=10)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--model-mb", type=float, default=10.0)
    p.add_argument("--wait", type=float, default=10.0, help="seconds an answer may take before a sample is lost")
    p.add_argument("--job-timeout", type=float, default=120.0)
    p.add_argument("--buses", default=",".join(BUSES))
    p.add_argument("--out", help="write the markdown table here too")
    p.add_argument("--json", help="write the raw samples here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        one_job(a.one, json.loads(a.cfg))
        return 0
    cfg = {k: getattr(a, k) for k in ("runs", "lat_small", "lat_model", "burst_small", "burst_model",
                                      "bursts", "model_mb", "wait", "job_timeout")}
    buses = [b for b in a.buses.split(",") if b]
    unknown = set(buses) - set(BUSES)
    if unknown:
        p.error(f"unknown bus(es) {sorted(unknown)}: choose from {BUSES}")
    results = []
    t0 = time.monotonic()
    for run in range(a.runs):
        order = buses[run % len(buses):] + buses[:run % len(buses)]
        for bus in order:
            res = run_job(bus, cfg)
            res["run"] = run
            results.append(res)
            print(f"run {run} {bus}: " + (res["error"].splitlines()[0] if "error" in res else
                  f"{res['job_s']:.1f} s, small rtt {1e6 * (_med(res['lat_small']) or 0):.0f} us, model rtt "
                  f"{1e3 * (_med(res['lat_model']) or 0):.1f} ms"), flush=True)
    command = "python -m tests.ding_jobs.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(results, cfg, ".ding-venv/bin/" + command)
    text += f"\nTotal {time.monotonic() - t0:.0f} s; {os.cpu_count()} CPUs; DI-engine 0.5.3.\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
