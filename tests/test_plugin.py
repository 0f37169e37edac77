"""An out-of-tree backend (tests/data/mqtoy, installed here as a distribution with an
``mq.backends`` entry point) is found by the registry, made by ``mq.create``, launched by
``mq run`` with a flag of its own, shown by ``mq doctor`` and passes the conformance suite, with
no line of mq naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mq
from mq import conformance, registry, testing
from mq.errors import ConfigError

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "tests" / "data" / "mqtoy"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder that holds the toy package and its distribution metadata, as pip leaves them."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(TOY, site / "mqtoy")
    info = site / "mqtoy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mqtoy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mq.backends]\ntoy = mqtoy:BACKEND\n")
    return site


@pytest.fixture
def installed(site, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(site))
    registry.rediscover()
    yield site
    registry.rediscover()


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "mq.cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)


def test_the_registry_finds_it_and_create_makes_its_nodes(installed):
    assert "toy" in mq.MQ_TYPES and registry.backend_for("toy").summary.startswith("a test's backend")
    assert "toy" in registry.launchable_mq_types()
    q = mq.create("toy", 0, motto="loud")
    try:
        assert type(q.transport).__name__ == "ToyTransport" and q.transport.motto == "loud"
        assert q.transport.routes == {"inproc", "tcp"}
    finally:
        q.stop()
    with pytest.raises(ConfigError, match="unexpected keyword argument 'colour'"):
        mq.create("toy", 0, colour="red")


def test_without_its_distribution_it_is_an_unknown_type():
    registry.rediscover()
    with pytest.raises(ConfigError, match="unknown mq type 'toy'"):
        mq.create("toy", 0)


def test_it_passes_the_conformance_suite(installed):
    # its own case, declared in its BACKEND and found through the registry, as the suite finds them
    (case,) = [c for c in testing.conformance_cases() if c.id.startswith("toy")]
    conformance.check_send_recv(case.group)
    conformance.check_call(case.group)
    conformance.check_publish_filtering(case.group)
    conformance.check_peers_and_routes(case.group, route=case.route)


def test_mq_run_launches_it_with_its_own_flag(site):
    r = _cli(site, "run", "--help")
    assert "--motto plain|loud" in r.stdout and "toy: how the toy's nodes greet" in " ".join(r.stdout.split())
    r = _cli(site, "run", "--main", "tests.jobs.roles:ok", "-n", "2", "--mq-type", "toy", "--motto", "loud")
    assert r.returncode == 0, r.stderr
    assert sorted(line.split(" labels")[0] for line in r.stdout.splitlines()) == ["node 0", "node 1"], r.stdout
    r = _cli(site, "run", "--main", "tests.jobs.roles:ok", "--mq-type", "toy", "--motto", "whisper")
    assert r.returncode == 2 and "motto must be plain or loud, got 'whisper'" in r.stderr, r.stderr
    r = _cli(site, "run", "--main", "tests.jobs.roles:ok", "--motto", "loud")  # nng has no motto
    assert r.returncode == 2 and "motto (--motto) is an option of toy, not of mq type 'nng'" in r.stderr, r.stderr


def test_mq_doctor_shows_it(site):
    rep = json.loads(_cli(site, "doctor", "--json").stdout)
    toy = rep["backends"]["toy"]
    assert toy["mq_types"] == ["toy"] and toy["toy"] == {"ready": True} and toy["launchable"]
    assert rep["routes"]["toy"]["local"]["kind"] == "tcp"  # held to TCP even on this host
    assert rep["trust"]["toy"]["summary"].startswith("toy: trusts nobody")
    out = " ".join(_cli(site, "doctor").stdout.split())
    assert "backend toy" in out and "ready (a test's backend)" in out


def test_mq_itself_names_an_option_it_does_not_have():
    transport = registry.backend_class("inproc")[0]
    with pytest.raises(ConfigError, match="unexpected keyword argument 'queue_sz'; node options are .*queue_size"):
        mq.MQ(0, transport=transport(0, transport.Options()), queue_sz=8)


def test_a_broken_plug_in_is_skipped_with_a_warning_and_the_rest_still_work(tmp_path, monkeypatch, caplog):
    info = tmp_path / "mqbroken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mqbroken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mq.backends]\nbroken = mqbroken_missing:BACKEND\n"
                                           "notabackend = json:dumps\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.rediscover()
    try:
        with caplog.at_level("WARNING", logger="mq"):
            found = registry.backends()
        assert {"nng", "torchrpc", "inproc"} <= set(found) and "broken" not in found
        text = caplog.text
        assert "backend entry point 'broken' (mqbroken_missing:BACKEND) does not load" in text
        assert "backend entry point 'notabackend' (json:dumps) is not an mq.backend.Backend" in text
    finally:
        registry.rediscover()


def test_a_backend_whose_conformance_cases_cannot_run_is_refused_when_declared():
    """A plug-in author learns at import, with the fix, not from a suite that cannot start."""
    from mq.backend import Backend, ConformanceCase

    common = dict(name="toy2", mq_types={"toy2": {}}, transport="m:T", options="m:O", routes=frozenset({"tcp"}),
                  summary="s")
    with pytest.raises(ValueError, match=r"conformance cases name mq types it lacks: \['nng'\]"):
        Backend(**common, conformance=(ConformanceCase("x", "nng", "tcp"),), nodes="m:f")
    with pytest.raises(ValueError, match="cannot be launched: its conformance cases need nodes='module:function'"):
        Backend(**common, conformance=(ConformanceCase("x", "toy2", "tcp"),))
    assert Backend(**common, conformance=(ConformanceCase("x", "toy2", "tcp"),), nodes="m:f").nodes == "m:f"
