"""mq as TorchRL's weight-sync backend (mq/integrations/torchrl.py), against the pinned
TorchRL: TorchRL's own update pattern with MultiSync and MultiAsync collectors (3 workers) and
the scheme from TorchRL's registry; bad input (a scheme used before its collector starts, a
worker that dies mid-update, a worker whose policy differs) as mq errors within bounded time;
and a cross-host update to receivers on two namespace hosts (netns)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl", reason="TorchRL is not installed: pip install '.[torchrl]' (scripts/install does)")
pytest.importorskip("gymnasium", reason="gymnasium is not installed: pip install '.[torchrl]'")

from tensordict.nn import TensorDictModule  # noqa: E402
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme  # noqa: E402

import mq.integrations.torchrl  # noqa: E402,F401  (registers backend "mq")
from mq.errors import ConfigError, PeerLost  # noqa: E402
from mq.integrations.torchrl import MQWeightSyncScheme  # noqa: E402

pytestmark = pytest.mark.timeout(240)
HERE = os.path.dirname(os.path.abspath(__file__))


def make_env():
    return GymEnv("Pendulum-v1")


def make_policy(hidden: int = 16) -> TensorDictModule:
    net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


def other_policy() -> TensorDictModule:
    return make_policy(hidden=5)


def assert_workers_act_with(collector, policy, workers: int = 3) -> None:
    state = collector.state_dict()
    mine = policy.state_dict()
    for w in range(workers):
        theirs = state[f"worker{w}"]["policy_state_dict"]
        assert set(theirs) == set(mine)
        for key in mine:
            torch.testing.assert_close(theirs[key].cpu(), mine[key].cpu())


@pytest.fixture
def reap():
    """Processes a failed collector left: killed at the end (the suite fails a leaked child)."""
    yield
    for p in multiprocessing.active_children():
        p.kill()
        p.join(5)


# ---------------------------------------------------------------------- in one process (inproc nodes)
def mlp(hidden: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


class InProcess:
    """A trainer's scheme and ``len(models)`` receivers in threads of this process, as TorchRL
    would set them up in its workers (each receiver a copy of the scheme, unpickled)."""

    def __init__(self, trainer: torch.nn.Module, models: list, **options):
        self.scheme = MQWeightSyncScheme(**{"mq_type": "inproc", "timeout": 10, **options})
        self.scheme.init_on_sender(model=trainer, num_workers=len(models), model_id="policy")
        blob, self.models, self.receivers, self.errors = pickle.dumps(self.scheme), models, [], []

        def worker(i):
            try:
                r = pickle.loads(blob)
                self.receivers.append(r)
                r.init_on_receiver(model_id="policy", model=models[i], worker_idx=i)
                r.connect(worker_idx=i)
            except Exception as exc:
                self.errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(models))]
        for t in threads:
            t.start()
        try:
            self.scheme.connect()
        except BaseException:
            self.close()
            raise
        finally:
            for t in threads:
                t.join(20)

    def close(self):
        for r in self.receivers:
            r.shutdown()
        self.scheme.shutdown()


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_an_update_is_applied_in_place_in_buckets_and_reports_versions_and_lag():
    trainer, models = mlp(1024), [mlp(1024), mlp(1024)]  # 4 bytes x ~7k: several 64 KiB buckets
    where = [[p.data_ptr() for p in m.parameters()] for m in models]
    job = InProcess(trainer, models, bucket_bytes=1 << 16)
    try:
        assert not job.errors and all(same(trainer, m) for m in models)
        with torch.no_grad():
            for p in trainer.parameters():
                p += 1
        job.scheme.send()
        assert all(same(trainer, m) for m in models)
        assert [[p.data_ptr() for p in m.parameters()] for m in models] == where  # in place
        metrics = job.scheme.metrics()
        assert metrics["policy_lag"]["torchrl.policy"] == {1: 0, 2: 0}
        assert metrics["weight_sync"]["torchrl.policy"]["version"] == 1
        assert all(r.receive() is not None and r.receive() is None for r in job.receivers)
    finally:
        job.close()


def test_a_mesh_links_the_receivers_with_each_other():
    """mesh=True (nng nodes meeting in the trainer's rendezvous): receivers are peers of each
    other, so mq's relays can carry a publish to a host once."""
    trainer = mlp()
    job = InProcess(trainer, [mlp(), mlp()], mq_type="nng", mesh=True)
    try:
        assert not job.errors and sorted(sorted(r.q.peers()) for r in job.receivers) == [[0, 1], [0, 2]]
        with torch.no_grad():
            trainer[0].weight += 1
        job.scheme.send()
        assert all(same(trainer, m) for m in job.models)
    finally:
        job.close()


def test_a_policy_on_the_meta_device_gets_its_memory_once():
    trainer = mlp()
    with torch.device("meta"):
        meta = mlp()
    job = InProcess(trainer, [meta])
    try:
        assert not job.errors and same(trainer, meta) and not any(p.is_meta for p in meta.parameters())
    finally:
        job.close()


def test_a_receiver_with_other_parameters_is_a_config_error_naming_the_keys():
    trainer, other = mlp(8), mlp(5)
    with pytest.raises(ConfigError, match=r"0\.weight is float32 \[5, 4\] here, float32 \[8, 4\] at the trainer"):
        InProcess(trainer, [other])


def test_a_policy_gone_at_the_trainer_is_a_config_error():
    job = InProcess(mlp(), [mlp()])
    try:
        with pytest.raises(ConfigError, match="garbage-collected"):
            job.scheme.send()
    finally:
        job.close()


def test_a_receiver_gone_before_an_update_is_peer_lost_naming_it():
    trainer = mlp()
    job = InProcess(trainer, [mlp(), mlp()])
    try:
        next(r for r in job.receivers if r.worker_idx == 1).shutdown()
        started = time.monotonic()
        with pytest.raises(PeerLost, match=r"worker 1 \(mq node 2\) lost during the update to version 1"):
            job.scheme.send()
        assert time.monotonic() - started < 5
    finally:
        job.close()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector], ids=["sync", "async"])
def test_torchrl_update_pattern_with_the_scheme_from_torchrls_registry(collector_class, reap):
    scheme = WeightSyncScheme.from_backend("mq")
    assert isinstance(scheme, MQWeightSyncScheme)
    policy = make_policy()
    collector = collector_class([make_env] * 3, policy=policy, frames_per_batch=30, total_frames=-1,
                                cat_results="stack", weight_sync_schemes={"policy": scheme})
    try:
        assert_workers_act_with(collector, policy)
        with torch.no_grad():
            for p in policy.parameters():
                p += torch.randn_like(p)
        with pytest.raises(AssertionError):
            assert_workers_act_with(collector, policy)
        started = time.monotonic()
        collector.update_policy_weights_()
        assert time.monotonic() - started < 10
        assert_workers_act_with(collector, policy)
        metrics = scheme.metrics()
        assert metrics["policy_lag"]["torchrl.policy"] == {1: 0, 2: 0, 3: 0}
        assert metrics["weight_sync"]["torchrl.policy"]["version"] == 1
        assert set(metrics["routes"].values()) == {"shm"}
        for i, batch in enumerate(collector):  # collection goes on with the new weights
            assert batch.numel() > 0
            if i == 2:
                break
        collector.update_policy_weights_()
        assert_workers_act_with(collector, policy)
    finally:
        collector.shutdown()
        scheme.shutdown()  # (TorchRL's collectors do not shut their sender's scheme down)


@pytest.mark.timeout(240)
def test_rpc_collector_workers_act_with_every_update():
    """TorchRL's RPCCollector sends the scheme to each remote collector twice and replaces the
    first copy with the second: the worker's node carries on (it used to leave and join again,
    and every worker was lost a few updates later). 4 remote collectors, 12 updates, each
    checked over TorchRL's own RPC; in a process of its own (torch RPC is one agent per process)."""
    job = subprocess.run([sys.executable, "-m", "tests.jobs.torchrl_rpc", "12"], capture_output=True, text=True,
                         timeout=200, env={**os.environ, "WORKERS": "4"})
    assert job.returncode == 0 and "ok 12" in job.stdout, job.stderr[-3000:]


def test_a_scheme_used_before_its_collector_started_is_a_config_error():
    scheme = WeightSyncScheme.from_backend("mq")
    with pytest.raises(ConfigError, match="before a collector set the scheme up"):
        scheme.send()
    with pytest.raises(ConfigError, match="before a collector set the scheme up"):
        scheme.metrics()
    with pytest.raises(ConfigError, match="bucket_bytes"):
        MQWeightSyncScheme(bucket_bytes=10)


@pytest.mark.parametrize("mq_type, says", [
    ("torchrpc:cpu", r"torchrpc allows one per process .* use 'nng'"),  # the backend's one_per_process
    ("bogus", "unknown mq type 'bogus'"),
    (3, "unknown mq type 3"),
])
def test_a_scheme_on_an_mq_type_it_cannot_use_is_a_config_error_saying_which(mq_type, says):
    with pytest.raises(ConfigError, match=says):
        MQWeightSyncScheme(mq_type=mq_type)


def test_a_worker_whose_policy_differs_is_a_config_error_naming_the_keys(reap):
    scheme = MQWeightSyncScheme(timeout=30)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"differs from the trainer's: .*module\.0\.weight is float32 \[5, 3\] here"):
        MultiSyncCollector([make_env] * 2, policy=make_policy(), policy_factory=[other_policy] * 2,
                           frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme})
    assert time.monotonic() - started < 60
    scheme.shutdown()


def test_a_worker_that_dies_mid_update_is_peer_lost_naming_it(reap):
    scheme = MQWeightSyncScheme(bucket_bytes=1 << 20, timeout=30)
    policy = make_policy(hidden=1 << 20)  # 20 MB: 20 buckets of 1 MiB
    collector = MultiAsyncCollector([make_env] * 2, policy=policy, frames_per_batch=20, total_frames=-1,
                                    weight_sync_schemes={"policy": scheme})
    try:
        victim = collector.procs[1]
        threading.Timer(0.05, victim.kill).start()
        started = time.monotonic()
        with pytest.raises(PeerLost, match="worker 1"):
            for _ in range(50):  # the kill lands during one of these updates (or before the next)
                collector.update_policy_weights_()
        assert time.monotonic() - started < 30
    finally:
        victim.join(10)
        for p in collector.procs:
            p.kill()
        collector.shutdown(timeout=10, raise_on_error=False)  # (its worker was killed)
        scheme.shutdown()


def test_a_receiver_holds_its_model_plus_one_bucket(tmp_path):
    """A 512 MiB policy in 32 MiB buckets to a receiver process over a socket (shm off, so the
    bytes land in the receiver's own memory): its peak memory grows by at most a few buckets
    past the model while versions 0 and 1 arrive (the model's memory is in place before)."""
    model_mib, bucket = 512, 32 << 20
    sys.path.insert(0, HERE)
    try:
        import torchrl_peer
    finally:
        sys.path.remove(HERE)
    model = torchrl_peer.big_policy(model_mib)
    scheme = MQWeightSyncScheme(bucket_bytes=bucket, timeout=60, options={"shm": False})
    scheme.init_on_sender(model=model, num_workers=1, model_id="policy")
    path = tmp_path / "scheme.pkl"
    path.write_bytes(pickle.dumps(scheme))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "torchrl_peer.py"), str(path), "0", str(model_mib)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        scheme.connect()
        with torch.no_grad():
            model.table += 1
        scheme.send()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait(10)
        scheme.shutdown()
    grew = [int(line.split()[1]) for line in out.splitlines() if line.startswith("grew ")]
    assert grew, f"{out}\n{err[-3000:]}"
    assert grew[0] * 1024 <= 3 * bucket + (48 << 20), f"the receiver grew {grew[0] >> 10} MiB past its model"


# ---------------------------------------------------------------------- across hosts
def _peer_policy() -> torch.nn.Module:
    sys.path.insert(0, HERE)
    try:
        import torchrl_peer
    finally:
        sys.path.remove(HERE)
    return torchrl_peer.policy(), torchrl_peer.checksum


@pytest.mark.netns
def test_an_update_reaches_receivers_on_two_namespace_hosts(two_hosts, tmp_path):
    """Four receivers, two per namespace host (own network, PID and IPC namespaces: tcp to the
    trainer), of a 4 MB policy in 1 MiB buckets, on a mesh: every receiver applies versions 0 and
    1, the receivers of a host share memory, and version 1's large buckets cross to each host once
    (relays: version 0 may go while the mesh still forms)."""
    model, checksum = _peer_policy()
    scheme = MQWeightSyncScheme(listen_to=f"tcp://{two_hosts.root_addr}:0", bucket_bytes=1 << 20, timeout=60, mesh=True)
    scheme.init_on_sender(model=model, num_workers=4, model_id="policy")
    path = tmp_path / "scheme.pkl"
    path.write_bytes(pickle.dumps(scheme))
    path.chmod(0o600)
    peer = os.path.join(HERE, "torchrl_peer.py")
    done = tmp_path / "done"  # the receivers stay until the update returned (relays among them)
    procs = [subprocess.Popen(two_hosts.command(w // 2, [sys.executable, peer, str(path), str(w), "0", str(done)]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(4)]
    try:
        scheme.connect()
        v0 = checksum(model)
        # Each receiver says what it holds before version 1 goes (else its sum may be taken
        # while version 1's buckets land), and the mesh is whole by then.
        firsts = [p.stdout.readline() for p in procs]
        before = dict(scheme.q.stats().relay)
        with torch.no_grad():
            for p in model.parameters():
                p += 1.0
        scheme.send()
        v1 = checksum(model)
        relay = {k: v - before.get(k, 0) for k, v in scheme.q.stats().relay.items()}
        done.write_text("")
        outs = [(first + out, err) for first, (out, err) in zip(firsts, (p.communicate(timeout=90) for p in procs))]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        scheme.shutdown()
    for w, (out, err) in enumerate(outs):
        lines = out.splitlines()
        assert len(lines) >= 2, f"worker {w}: {out}\n{err[-3000:]}"
        assert lines[0].startswith(f"version 0 sum {v0!r}") and "tcp" in lines[0] and "shm" in lines[0], lines[0]
        assert lines[1] == f"version 1 sum {v1!r}", (lines, v1)
    assert relay.get("relayed", 0) >= 2 and not relay.get("fallback_direct"), relay  # version 1's 2 large buckets


# ---------------------------------------------------------------------- the example learns
ROOT = os.path.dirname(HERE)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mq_type", ["nng", "torchrpc:cpu"])
def test_the_dqn_example_learns_cartpole(mq_type):
    """examples/torchrl_dqn: 1 learner + 2 TorchRL collectors as mq roles, batches over an
    mq.Stream into a TorchRL ReplayBuffer, weights through the mq scheme over the job's queue:
    the mean return of the last 10 episodes reaches 100 (CartPole) within its frame budget."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, "-m", "examples.torchrl_dqn", "--collectors", "2", "--mq-type", mq_type],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    lines = p.stdout.strip().splitlines()
    assert lines, f"exit {p.returncode}; stderr:\n{p.stderr[-4000:]}"
    import json

    report = json.loads(lines[-1])
    assert p.returncode == 0 and report["ok"], f"{report}\nstderr:\n{p.stderr[-3000:]}"
    assert report["mean_return_last_10"] >= 100 and report["updates"] > 0
    assert report["weights"]["torchrl.policy"]["updates"] >= 2  # version 0 and at least one more
    counts = report["stream"]["counts"]
    assert sorted(counts) == ["1", "2"] and all(c["received"] == c["sent"] > 0 for c in counts.values()), report


@pytest.mark.netns
@pytest.mark.timeout(420)
def test_the_dqn_example_learns_with_collectors_on_two_namespace_hosts(two_hosts):
    """The example as a cluster user runs it: one `mq run` per node, the learner on this host and
    a collector on each of two namespace hosts (own network, PID and IPC namespaces: tcp), meeting
    in a rendezvous; batches stream over tcp, weights come through the scheme; it learns."""
    import json
    import socket as socket_

    with socket_.socket() as s:
        s.bind((two_hosts.root_addr, 0))
        init = f"tcp://{two_hosts.root_addr}:{s.getsockname()[1]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}

    def node(node_id: int, label: str, address: str) -> list[str]:
        return [sys.executable, "-m", "mq.cli.main", "run", "--main", "examples.torchrl_dqn.roles:main",
                "--labels", label, "--node-ids", str(node_id), "--world-size", "3", "--init-method", init,
                "--mq-type", "nng", "--address", address]

    commands = [node(0, "learner", two_hosts.root_addr)] + [
        two_hosts.command(h, node(h + 1, "collector", two_hosts.addrs[h])) for h in (0, 1)]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    try:
        outs = [p.communicate(timeout=380) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    lines = [re.sub(r"^\[node \d+\] ", "", line) for line in outs[0][0].splitlines()]  # mq run's prefix
    report = json.loads([line for line in lines if line.startswith("{")][-1])
    print(json.dumps({k: report[k] for k in ("mean_return_last_10", "frames", "updates", "seconds", "routes")}))
    assert report["ok"] and report["mean_return_last_10"] >= 100, report
    assert report["weights"]["torchrl.policy"]["updates"] >= 2
    counts = report["stream"]["counts"]
    assert sorted(counts) == ["1", "2"] and all(c["received"] == c["sent"] > 0 for c in counts.values()), report
    assert set(report["routes"].values()) == {"tcp"}, report["routes"]  # the collectors are on other hosts

