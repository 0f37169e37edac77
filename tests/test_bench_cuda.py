"""`mq bench --device cuda`: the plan (D2D bound, `+copy` twins, raw torch RPC cuda rows), the
rows' ratios, the GPU pass lines and their rendering, on synthetic results (no GPU needed);
and, marked `cuda`, the same run end to end on a GPU (scripts/gpu-check runs those).

No timing assertions: numbers come from the benchmark, tests only check its shape."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mq.cli.bench import _print_tables, bench
from mq.tools import bench as lib
from mq.tools.bench.cases import SizeResult
from mq.tools.bench.gpu import BIG, SMALL, gpu_checks
from mq.tools.bench.rows import report_rows

MB = 1 << 20


def _cfg(**kw) -> lib.BenchConfig:
    base = dict(mq_types=["nng", "torchrpc:cuda"], device="cuda", routes=["auto"], modes=["oneway"],
                sizes=[SMALL, BIG])
    return lib.BenchConfig(**{**base, **kw}).validate()


def _planned(cfg: lib.BenchConfig) -> tuple[lib._Runner, list]:
    """The runner and every case it would run (mq cases, their raw baselines, the bounds)."""
    runner = lib._Runner(cfg, None)
    cases = []
    for hosts, name, mine in runner.plan():
        cases += mine + runner._raw_cases(hosts, name, mine)
    return runner, cases + list(runner.bounds.values())


def _fill(cases, p50_ms: dict, arrived: dict | None = None) -> None:
    """Give each case at each size five samples around ``p50_ms[(name, size)]`` (name: the row
    label's start, e.g. ``nng``, ``nng+copy``, ``raw:rpc-cuda``, ``d2d``)."""
    for c in cases:
        key = c.mq_type + ("+copy" if c.owned else "")
        for size in (SMALL, BIG):
            ms = p50_ms.get((key, size))
            if ms is None:
                continue
            ns = int(ms * 1e6)
            c.results[size] = SizeResult(samples_ns=[ns - 1, ns, ns, ns, ns + 1], done=True,
                                         arrived_on=set((arrived or {}).get((key, size), {"cuda:0"})))


# --------------------------------------------------------------------------- the plan
@pytest.mark.timeout(30)
def test_cuda_rows_get_a_d2d_bound_copy_twins_and_the_raw_rpc_cuda_baseline():
    runner, cases = _planned(_cfg())
    assert {d: b.mq_type for d, b in runner.bounds.items()} == {"cuda": "d2d"}  # no host memcpy row
    assert runner.bounds["cuda"].spec("127.0.0.1", 1)["kind"] == "d2d"
    mq = {(c.mq_type, c.route, c.owned) for c in cases if c.kind == "mq"}
    assert mq == {("nng", "auto", False), ("nng", "auto", True), ("nng", "handle", False),
                  ("torchrpc:cuda", "auto", False), ("torchrpc:cuda", "auto", True)}
    by = {(c.mq_type, c.route, c.owned): c for c in cases if c.kind == "mq"}
    for owned in (False, True):
        assert by["torchrpc:cuda", "auto", owned].baseline.mq_type == "raw:rpc-cuda"
        assert by["nng", "auto", owned].baseline.mq_type == "raw:pynng"
        assert by["nng", "auto", owned].spec("127.0.0.1", 1)["owned"] is owned
    assert by["nng", "auto", True].name.endswith("+copy")
    rpc = next(c for c in cases if c.mq_type == "raw:rpc-cuda")
    spec = rpc.spec("127.0.0.1", 1)
    assert spec["device_maps"] is True and spec["device"] == "cuda" and spec["kind"] == "rpc"


@pytest.mark.timeout(30)
def test_a_run_with_cpu_and_cuda_payloads_has_both_bounds_and_cpu_rows_no_twins():
    cfg = _cfg(mq_types=["nng", "torchrpc:cuda"], device="cpu", devices={"torchrpc:cuda": "cuda"})
    runner, cases = _planned(cfg)
    assert {d: b.mq_type for d, b in runner.bounds.items()} == {"cpu": "memcpy", "cuda": "d2d"}
    assert not [c for c in cases if c.owned and c.mq_type == "nng"]
    assert [c.owned for c in cases if c.kind == "mq" and c.mq_type == "torchrpc:cuda"] == [False, True]
    assert lib.plan_bounds(_cfg(device="cpu", mq_types=["nng"])).keys() == {"cpu"}


@pytest.mark.timeout(30)
def test_fanout_copy_twins_compare_with_the_fanout_to_one_copy_twin():
    runner, cases = _planned(_cfg(mq_types=["nng"], modes=["fanout"], subscribers=3, sizes=[SMALL]))
    twins = {c.subscribers: c for c in cases if c.kind == "mq" and c.owned}
    assert set(twins) == {1, 3} and twins[3].baseline is twins[1]


# --------------------------------------------------------------------------- rows and checks
# p50 ms per (row, size): nng meets every line, torchrpc:cuda misses the bound and 1.25 KB.
P50 = {("d2d", SMALL): 0.002, ("d2d", BIG): 0.5,
       ("nng", SMALL): 0.2, ("nng", BIG): 0.9, ("nng+copy", SMALL): 0.21, ("nng+copy", BIG): 1.5,
       ("raw:pynng", SMALL): 0.3, ("raw:pynng", BIG): 900.0,
       ("torchrpc:cuda", SMALL): 0.7, ("torchrpc:cuda", BIG): 1.2,
       ("torchrpc:cuda+copy", SMALL): 0.72, ("torchrpc:cuda+copy", BIG): 7.0,
       ("raw:rpc-cuda", SMALL): 1.2, ("raw:rpc-cuda", BIG): 6.5}


def _report(arrived: dict | None = None) -> lib.Report:
    cfg = _cfg()
    runner, cases = _planned(cfg)
    _fill(cases, P50, arrived)
    rows = report_rows(cases, runner.bounds, cfg)
    return lib.Report(machine={"cpu": "x", "cores": 16, "gpus": ["NVIDIA H100"]}, rows=rows, links=[],
                      config={}, targets=lib._targets(rows), checks=gpu_checks(rows))


def _row(report: lib.Report, mq_type: str, size: int, owned: bool = False, route: str = "auto") -> dict:
    return next(r for r in report.rows if r["mq_type"] == mq_type and r["size_bytes"] == size
                and r["route"] == route and bool(r.get("owned")) is owned)


@pytest.mark.timeout(30)
def test_cuda_rows_are_to_the_d2d_bound_and_to_raw_rpc_cuda():
    report = _report()
    bound = _row(report, "d2d", BIG, route="warm")
    assert bound["kind"] == "bound" and bound["ratio_bound"] == pytest.approx(1.0)
    assert lib.row_label(bound) == "D2D copy cuda (bound)"
    nng = _row(report, "nng", BIG)
    assert nng["bound_kind"] == "d2d" and nng["bound_ms"] == pytest.approx(0.5)
    assert nng["ratio_bound"] == pytest.approx(1.8)
    assert nng["baseline"] == "raw:pynng/ipc" and nng["ratio"] == pytest.approx(0.001)
    assert nng["rpc_cuda_p50_ms"] == pytest.approx(6.5) and nng["rpc_cuda_ratio"] == pytest.approx(0.9 / 6.5, rel=1e-3)
    assert nng["arrived_on"] == "cuda:0" and nng["owned"] is False
    copy = _row(report, "nng", BIG, owned=True)
    assert copy["owned"] is True and lib.row_label(copy) == "nng/auto oneway cuda +copy"
    assert "view + copy into an owned tensor" in lib.row_note(copy)
    assert "bound: 1 D2D copy" in lib.row_note(copy) and "0.231x raw rpc-cuda" in lib.row_note(copy)
    rpc = _row(report, "torchrpc:cuda", BIG)
    assert rpc["ratio"] == rpc["rpc_cuda_ratio"] and "raw rpc-cuda" not in lib.row_note(rpc)  # its baseline
    raw = _row(report, "raw:rpc-cuda", BIG)
    assert raw["rpc_cuda_ratio"] is None and raw["owned"] is None and raw["ratio_bound"] == pytest.approx(13.0)
    assert set(lib.ROW_FIELDS) <= set(nng)


@pytest.mark.timeout(30)
def test_gpu_pass_lines_are_computed_per_mq_type():
    checks = {c["name"]: c for c in _report().checks}
    assert list(checks) == [
        "nng/auto 1.25 GB one way <= 2x the D2D copy bound",
        "nng/auto 1.25 GB one way <= raw torch RPC cuda (view ready)",
        "nng/auto 1.25 GB one way <= raw torch RPC cuda (view + copy into an owned tensor)",
        "nng/auto 1.25 KB one way p50 <= 0.5 ms",
        "torchrpc:cuda 1.25 GB one way <= 2x the D2D copy bound",
        "torchrpc:cuda 1.25 GB one way <= raw torch RPC cuda (view ready)",
        "torchrpc:cuda 1.25 GB one way <= raw torch RPC cuda (view + copy into an owned tensor)",
        "torchrpc:cuda 1.25 KB one way p50 <= 0.5 ms",
    ]
    for c in checks.values():
        assert set(c) == {"name", "value", "limit", "unit", "passed", "row", "note"}
        assert c["passed"] is (c["value"] <= c["limit"])
    assert all(c["passed"] for n, c in checks.items() if n.startswith("nng"))
    assert checks["nng/auto 1.25 GB one way <= 2x the D2D copy bound"]["value"] == pytest.approx(1.8)
    assert checks["nng/auto 1.25 KB one way p50 <= 0.5 ms"]["value"] == pytest.approx(0.2)
    failed = [n for n, c in checks.items() if not c["passed"]]
    assert failed == ["torchrpc:cuda 1.25 GB one way <= 2x the D2D copy bound",
                      "torchrpc:cuda 1.25 GB one way <= raw torch RPC cuda (view + copy into an owned tensor)",
                      "torchrpc:cuda 1.25 KB one way p50 <= 0.5 ms"]
    assert checks["torchrpc:cuda 1.25 GB one way <= 2x the D2D copy bound"]["row"] == "torchrpc:cuda/auto oneway cuda 1.25 GB"


@pytest.mark.timeout(30)
def test_a_staged_or_missing_row_says_so_in_its_check():
    report = _report(arrived={("nng", BIG): {"cpu"}})
    nng = _row(report, "nng", BIG)
    assert "arrived on cpu: staged through host memory" in lib.row_note(nng)
    check = next(c for c in report.checks if c["name"].startswith("nng/auto 1.25 GB one way <= 2x"))
    assert "staged" in check["note"]
    rows = [r for r in report.rows if r["mq_type"] != "raw:rpc-cuda"]
    for r in rows:
        r["rpc_cuda_ratio"] = None
    by = {c["name"]: c for c in gpu_checks(rows)}
    c = by["nng/auto 1.25 GB one way <= raw torch RPC cuda (view ready)"]
    assert c["passed"] is False and c["value"] is None and "no raw:rpc-cuda row" in c["note"]
    assert lib.check_line(c).startswith("NO DATA: ")
    assert gpu_checks([r for r in report.rows if r["device"] != "cuda"]) == []  # a CPU run: none
    small = [r for r in report.rows if r["size_bytes"] == SMALL]  # 1.25 GB not measured: left out
    assert [c["name"] for c in gpu_checks(small)] == ["nng/auto 1.25 KB one way p50 <= 0.5 ms",
                                                      "torchrpc:cuda 1.25 KB one way p50 <= 0.5 ms"]


@pytest.mark.timeout(30)
def test_markdown_json_and_table_show_the_cuda_ratios_and_pass_lines(capsys):
    report = _report()
    md = lib.to_markdown(report)
    assert "## CUDA payloads: p50 ms (x the D2D copy bound, x raw torch RPC cuda)" in md
    assert "| nng/auto oneway cuda | 0.2 (100.00x D2D, 0.17x rpc) | 0.9 (1.80x D2D, 0.14x rpc) |" in md
    assert "| D2D copy cuda (bound) | 0.002 | 0.5 |" in md
    assert "## Pass lines" in md
    assert "- PASS: nng/auto 1.25 GB one way <= 2x the D2D copy bound: 1.8x (nng/auto oneway cuda 1.25 GB)" in md
    assert "- FAIL: torchrpc:cuda 1.25 KB one way p50 <= 0.5 ms: 0.7 ms" in md
    data = json.loads(lib.to_json(report))
    assert data["checks"] == report.checks and len(data["checks"]) == 8
    assert not any(t["rows_checked"] for t in report.targets)  # CPU targets: CUDA rows have checks
    header = lib.to_csv(report).splitlines()[0].split(",")
    assert header[-7:] == ["owned", "arrived_on", "bound_kind", "rpc_cuda_p50_ms", "rpc_cuda_ratio", "link_fraction",
                           "load"]
    _print_tables(report)
    out = capsys.readouterr().out
    assert "CUDA payloads" in out and "GPU pass lines" in out and "+copy" in out
    assert "FAIL: torchrpc:cuda 1.25 GB one way <= 2x the D2D copy bound: 2.4x" in out


@pytest.mark.timeout(30)
def test_a_cpu_report_has_no_gpu_section():
    runner, cases = _planned(_cfg(device="cpu", mq_types=["nng"]))
    _fill(cases, {("memcpy", SMALL): 0.001, ("nng", SMALL): 0.2, ("raw:pynng", SMALL): 0.2})
    rows = report_rows(cases, runner.bounds, _cfg(device="cpu", mq_types=["nng"]))
    report = lib.Report(machine={}, rows=rows, links=[], config={}, targets=[], checks=gpu_checks(rows))
    md = lib.to_markdown(report)
    assert report.checks == [] and "## CUDA payloads" not in md and "## Pass lines" not in md
    assert _row(report, "nng", SMALL)["bound_kind"] == "memcpy" and _row(report, "nng", SMALL)["owned"] is None


@pytest.mark.timeout(120)
def test_stop_reads_what_a_worker_said_before_it_exited():
    """B's arrival devices come with its goodbye; a worker that already exited still counts."""
    from mq.tools.bench.cases import WorkerProc

    runner = lib._Runner(_cfg(device="cpu", mq_types=["nng"]), None)
    p = WorkerProc(runner.ctx, "A", {"kind": "bound", "device": "cpu", "route": "warm", "mode": "bound"})
    try:
        p.recv("listening", 60)
        p.send("stop")
        p.proc.join(60)
        assert p.proc.exitcode == 0
        assert runner._stop_procs([p]) == {p: {"error": None, "arrived_on": {}}}
    finally:
        p.kill()


# --------------------------------------------------------------------------- the CLI
@pytest.mark.timeout(30)
def test_device_cuda_without_a_gpu_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(lib, "cuda_available", lambda: False)
    result = CliRunner().invoke(bench, ["--device", "cuda", "--mq-type", "nng", "--sizes", "1.25KB", "-q"])
    assert result.exit_code == 2
    assert result.output.strip() == "Error: --device cuda needs a CUDA GPU, and none is visible"


@pytest.mark.timeout(30)
def test_device_cuda_measures_route_auto_unless_told(monkeypatch):
    seen = []

    def fake_run(cfg, progress=None):
        seen.append(list(cfg.routes))
        raise lib.ConfigError("stop here")

    monkeypatch.setattr(lib, "run", fake_run)
    CliRunner().invoke(bench, ["--device", "cuda", "--mq-type", "nng", "-q"])
    CliRunner().invoke(bench, ["--device", "cuda", "--mq-type", "nng", "--route", "ipc", "-q"])
    CliRunner().invoke(bench, ["--mq-type", "nng", "-q"])
    assert seen == [["auto"], ["ipc"], list(lib.NNG_ROUTES)]


# --------------------------------------------------------------------------- on a GPU
def _gpu_run(args: list[str]) -> dict:
    result = CliRunner().invoke(bench, ["--device", "cuda", "--mq-type", "nng", "--mq-type", "torchrpc:cuda",
                                        "--max-seconds", "10", "--target-seconds", "0.2", "--min-samples", "3",
                                        "--max-samples", "50", "--warmup", "2", "--no-links", "-q",
                                        "--format", "json", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(getattr(result, "stdout", result.output))


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_cuda_oneway_end_to_end():
    report = _gpu_run(["--mode", "oneway", "--sizes", "1.25KB,1.25MB"])
    rows = report["rows"]
    bound = [r for r in rows if r["kind"] == "bound"]
    assert {r["mq_type"] for r in bound} == {"d2d"} and all(r["samples"] for r in bound), bound
    for mq_type in ("nng", "torchrpc:cuda"):
        for owned in (False, True):
            mine = [r for r in rows if r["kind"] == "mq" and r["mq_type"] == mq_type and r["route"] == "auto"
                    and r["owned"] is owned]
            assert len(mine) == 2, mine
            for r in mine:
                assert r["samples"] >= 1 and r["device"] == "cuda", r
                assert r["arrived_on"] == "cuda:0", r  # not staged: B got it on the GPU
                assert r["bound_kind"] == "d2d" and r["ratio_bound"] > 0
                assert r["rpc_cuda_ratio"] > 0 and 0 < r["arrival_p50_ms"] <= r["p50_ms"]
    raw = [r for r in rows if r["mq_type"] == "raw:rpc-cuda"]
    assert raw and all(r["samples"] and r["arrived_on"] == "cuda:0" for r in raw), raw
    pynng = [r for r in rows if r["mq_type"] == "raw:pynng"]  # bytes: staged, and the note says so
    assert pynng and all(r["arrived_on"] == "cpu" and "staged" in lib.row_note(r) for r in pynng), pynng
    assert [c["name"] for c in report["checks"]] == ["nng/auto 1.25 KB one way p50 <= 0.5 ms",
                                                     "torchrpc:cuda 1.25 KB one way p50 <= 0.5 ms"]


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_cuda_roundtrip_end_to_end():
    rows = _gpu_run(["--mode", "roundtrip", "--sizes", "20KB"])["rows"]
    mq = [r for r in rows if r["kind"] == "mq"]
    assert len(mq) == 4 and all(r["samples"] >= 1 and r["bound_copies"] == 2 for r in mq), mq
    assert all(r["arrived_on"] == "cuda:0" for r in mq + [r for r in rows if r["mq_type"] == "raw:rpc-cuda"])
