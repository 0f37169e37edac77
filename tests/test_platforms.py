"""Launch platforms: hostlist expansion and plans from recorded Slurm / k8s environments."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mq.errors import ConfigError
from mq.platforms import (
    PlatformPlan,
    assign_roles,
    attach_lists,
    expand_hostlist,
    from_k8s,
    from_local,
    from_slurm,
    parse_tasks_per_node,
    plan_for,
    resolve_hosts,
)

pytestmark = pytest.mark.timeout(30)


# --------------------------------------------------------------------------------------------
# expand_hostlist

VALID_HOSTLISTS = [
    ("login1", ["login1"]),
    ("  login1  ", ["login1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[09-10]", ["n09", "n10"]),
    ("n[7]", ["n7"]),
    ("n[5-5]", ["n5"]),
    ("gpu-a[1-2]-ib", ["gpu-a1-ib", "gpu-a2-ib"]),
    (
        "node[01-03,07],gpu-a[1-2]-ib,login1",
        ["node01", "node02", "node03", "node07", "gpu-a1-ib", "gpu-a2-ib", "login1"],
    ),
    ("gpu[01-02],cpu007", ["gpu01", "gpu02", "cpu007"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("r[1-2]c[3,5]s[0-1]", ["r1c3s0", "r1c3s1", "r1c5s0", "r1c5s1", "r2c3s0", "r2c3s1", "r2c5s0", "r2c5s1"]),
    ("[1-2]x", ["1x", "2x"]),
    ("n[1-2,4-5,9]", ["n1", "n2", "n4", "n5", "n9"]),
    ("a, b", ["a", "b"]),
    ("node1.cluster.local,node[2-3].cluster.local", ["node1.cluster.local", "node2.cluster.local", "node3.cluster.local"]),
    ("pod-[0-1].svc:6000", ["pod-0.svc:6000", "pod-1.svc:6000"]),
    ("n1,n1", ["n1", "n1"]),
]


@pytest.mark.parametrize(("text", "expected"), VALID_HOSTLISTS, ids=[t for t, _ in VALID_HOSTLISTS])
def test_expand_hostlist_valid(text, expected):
    assert expand_hostlist(text) == expected


INVALID_HOSTLISTS = [
    ("", r"is empty"),
    ("   ", r"is empty"),
    ("node[1-3", r"malformed: unbalanced brackets"),
    ("node1-3]", r"malformed: unbalanced brackets"),
    ("n[1-[2]]", r"malformed: nested brackets"),
    ("n[5-3]", r"malformed: start > stop"),
    ("n[]", r"malformed: bad range"),
    ("n[a-b]", r"malformed: bad range"),
    ("n[1-2-3]", r"malformed: bad range"),
    ("n[1,,2]", r"empty entry"),
    ("a,,b", r"empty entry"),
    ("a,b,", r"empty entry"),
    ("node 1", r"contains whitespace"),
    ("n[ 1-2]", r"contains whitespace"),
    ("n[1-1000000000]", r"range too large"),
    ("a[1-1000]b[1-1000]", r"results too large"),
]


@pytest.mark.parametrize(("text", "match"), INVALID_HOSTLISTS, ids=[repr(t) for t, _ in INVALID_HOSTLISTS])
def test_expand_hostlist_invalid(text, match):
    with pytest.raises(ConfigError, match=match) as info:
        expand_hostlist(text)
    # Every message quotes the offending text so the user can find it in their job script.
    assert repr(text) in str(info.value)


def test_expand_hostlist_rejects_non_string():
    with pytest.raises(ConfigError, match="must be a string"):
        expand_hostlist(None)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(alphabet="abcxyz-.", min_size=0, max_size=6),
    lo=st.integers(min_value=0, max_value=5000),
    span=st.integers(min_value=0, max_value=300),
    extra_width=st.integers(min_value=0, max_value=3),
)
def test_expand_hostlist_zero_padded_range_property(prefix, lo, span, extra_width):
    hi = lo + span
    width = len(str(hi)) + extra_width
    text = f"{prefix}[{lo:0{width}d}-{hi:0{width}d}]"
    names = expand_hostlist(text)
    assert len(names) == hi - lo + 1
    assert {len(n) for n in names} == {len(prefix) + width}
    assert [int(n[len(prefix):]) for n in names] == list(range(lo, hi + 1))
    assert all(n.startswith(prefix) for n in names)


@settings(max_examples=100, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3)), min_size=1, max_size=3))
def test_expand_hostlist_cartesian_property(groups):
    text = "".join(f"g{i}[{lo}-{lo + span}]" for i, (lo, span) in enumerate(groups))
    names = expand_hostlist(text)
    expected = [
        "".join(f"g{i}{n}" for i, n in enumerate(combo))
        for combo in itertools.product(*(range(lo, lo + span + 1) for lo, span in groups))
    ]
    assert names == expected


# --------------------------------------------------------------------------------------------
# tasks per node


@pytest.mark.parametrize(
    ("text", "n_hosts", "expected"),
    [
        ("2", 3, [2, 2, 2]),
        ("2(x3)", 3, [2, 2, 2]),
        ("2(x2),1", 3, [2, 2, 1]),
        ("4,1,3", 3, [4, 1, 3]),
        ("1", 1, [1]),
    ],
)
def test_parse_tasks_per_node(text, n_hosts, expected):
    assert parse_tasks_per_node(text, n_hosts) == expected


@pytest.mark.parametrize(
    ("text", "n_hosts", "match"),
    [
        ("2(x2)", 3, r"for 2 hosts but the node list has 3"),
        ("2,2", 3, r"for 2 hosts"),
        ("two", 1, r"not a count"),
        ("2(3)", 1, r"not a count"),
        ("0", 2, r"zero count"),
        ("", 1, r"not a count"),
    ],
)
def test_parse_tasks_per_node_invalid(text, n_hosts, match):
    with pytest.raises(ConfigError, match=match):
        parse_tasks_per_node(text, n_hosts)


# --------------------------------------------------------------------------------------------
# Slurm

# Recorded under slurmd 22.05 (tests/test_slurm.py's cluster) from
# `srun -N2 --ntasks-per-node=1 mq run -n 2 ...`, task 1, with the node list renamed to
# three hosts: one launcher per host.
SLURM_PER_NODE_ENV = {
    "SLURM_JOB_ID": "81234",
    "SLURM_JOBID": "81234",
    "SLURM_JOB_NODELIST": "gpu[01-02],cpu007",
    "SLURM_NODELIST": "gpu[01-02],cpu007",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_NTASKS": "3",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x3)",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu[01-02],cpu007",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURMD_NODENAME": "cpu007",
}

# Recorded the same way from `srun -N2 -n4 mq run ...` (Slurm packed three tasks on the
# first host), task 2: one worker per task.
SLURM_PER_TASK_ENV = {
    "SLURMD_NODENAME": "mqtn1",
    "SLURM_JOBID": "4",
    "SLURM_JOB_ID": "4",
    "SLURM_JOB_NODELIST": "mqtn[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "2",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "mqtn[1-2]",
    "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "mqtn[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "3,1",
    "SLURM_TASKS_PER_NODE": "3,1",
}

# Recorded in an `sbatch -N2` batch script: no step variables.
SLURM_BATCH_ENV = {
    "SLURM_JOB_ID": "3",
    "SLURM_JOB_NODELIST": "mqtn[1-2]",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "mqtn[1-2]",
    "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURMD_NODENAME": "mqtn1",
}


def _pairs(plan: PlatformPlan) -> list[frozenset[int]]:
    """Every (dialler, listener) pair of the plan's attach lists, as unordered id pairs."""
    owner = {addr: n for n, addr in plan.listen_to.items()}
    return [frozenset((n, owner[a])) for n, addrs in plan.attach_to.items() for a in addrs]


def test_slurm_one_launcher_per_node():
    plan = from_slurm(SLURM_PER_NODE_ENV, workers_per_node=2, base_port=50515)
    assert plan.platform == "slurm"
    assert plan.source == "SLURM_STEP_NODELIST"
    assert plan.hosts == ["gpu01", "gpu02", "cpu007"]
    assert plan.host_index == 2
    assert plan.node_ids == [4, 5]
    assert plan.world_size == 6
    assert plan.addresses == {0: "gpu01", 1: "gpu01", 2: "gpu02", 3: "gpu02", 4: "cpu007", 5: "cpu007"}
    assert plan.ports == {0: 50515, 1: 50516, 2: 50515, 3: 50516, 4: 50515, 5: 50516}
    assert plan.listen_to[4] == "tcp://cpu007:50515"
    assert plan.listen_to[1] == "tcp://gpu01:50516"
    assert plan.init_method == "tcp://gpu01:50514"
    assert plan.attach_to[0] == []
    assert plan.attach_to[5] == [plan.listen_to[i] for i in range(5)]
    opts = plan.options_for(4)
    assert opts == {
        "node_id": 4,
        "world_size": 6,
        "listen_to": "tcp://cpu007:50515",
        "attach_to": [plan.listen_to[i] for i in range(4)],
        "init_method": "tcp://gpu01:50514",
    }


def test_slurm_one_worker_per_task_from_recorded_step():
    plan = from_slurm(SLURM_PER_TASK_ENV, workers_per_node=None)
    assert plan.hosts == ["mqtn1", "mqtn2"]
    assert plan.node_ids == [2] and plan.world_size == 4 and plan.host_index == 0
    assert plan.addresses == {0: "mqtn1", 1: "mqtn1", 2: "mqtn1", 3: "mqtn2"}
    assert plan.listen_to[2] == "tcp://mqtn1:50517"
    assert plan.listen_to[3] == "tcp://mqtn2:50515"


def test_slurm_per_host_rejects_several_tasks_on_a_host():
    # `srun -N2 -n4 mq run -n 2`: every task gets the same error, so none starts and waits.
    for procid, localid in [(0, 0), (2, 2)]:
        env = dict(SLURM_PER_TASK_ENV, SLURM_PROCID=str(procid), SLURM_LOCALID=str(localid))
        with pytest.raises(ConfigError, match=r"srun started 3 tasks on mqtn1 but -n/--parallel-workers 2 "
                           r"runs one launcher per host: use srun --ntasks-per-node=1 -n 2 .*, or drop -n"):
            from_slurm(env, workers_per_node=2)


def test_slurm_batch_script_without_srun_on_two_hosts_is_explained():
    with pytest.raises(ConfigError, match=r"outside a job step .* allocation of 2 hosts \(mqtn1, mqtn2\).*srun"):
        from_slurm(SLURM_BATCH_ENV, workers_per_node=None)
    with pytest.raises(ConfigError, match=r"outside a job step"):
        from_slurm(SLURM_BATCH_ENV, workers_per_node=2)


def test_slurm_batch_script_on_one_host_runs_there():
    env = dict(SLURM_BATCH_ENV, SLURM_JOB_NODELIST="mqtn1", SLURM_NODELIST="mqtn1", SLURM_TASKS_PER_NODE="3")
    plan = from_slurm(env, workers_per_node=None)
    assert plan.node_ids == [0, 1, 2] and plan.world_size == 3  # the allocation's tasks
    assert from_slurm(env, workers_per_node=2).node_ids == [0, 1]


def test_slurm_salloc_shell_on_the_submit_host_is_explained():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "mqtn1", "SLURM_TASKS_PER_NODE": "1"}
    with pytest.raises(ConfigError, match=r"outside the allocation's host mqtn1.*start it with srun"):
        from_slurm(env, workers_per_node=None)


def test_slurm_outside_any_job_is_explained():
    with pytest.raises(ConfigError, match=r"not inside a Slurm job \(SLURM_JOB_ID is not set\).*srun.*--platform local"):
        from_slurm({"HOME": "/root", "SLURM_NODEID": "0"}, workers_per_node=None)


def test_slurm_nodename_disagrees_outside_a_step():
    env = dict(SLURM_BATCH_ENV, SLURM_JOB_NODELIST="gpu01", SLURM_NODELIST="gpu01", SLURMD_NODENAME="other9")
    del env["SLURM_NODEID"]
    with pytest.raises(ConfigError, match=r"SLURMD_NODENAME='other9' is not in the node list"):
        from_slurm(env, workers_per_node=1)


# Recorded from `srun --ntasks=5 --distribution=block mq run ...` on an uneven allocation:
# gpu01 and gpu02 run two tasks each, cpu007 one. This is task 3 (second task on gpu02).
SLURM_SRUN_ENV = {
    "SLURM_JOB_ID": "81235",
    "SLURM_JOB_NODELIST": "gpu[01-02],cpu007",
    "SLURM_STEP_NODELIST": "gpu[01-02],cpu007",
    "SLURM_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_NTASKS": "5",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu02",
    "SLURM_STEP_ID": "0",
}


def test_slurm_srun_one_process_per_task():
    plan = from_slurm(SLURM_SRUN_ENV, workers_per_node=None, base_port=6000, topology="star")
    assert plan.node_ids == [3]
    assert plan.world_size == 5
    assert plan.host_index == 1
    assert plan.addresses == {0: "gpu01", 1: "gpu01", 2: "gpu02", 3: "gpu02", 4: "cpu007"}
    assert plan.ports == {0: 6000, 1: 6001, 2: 6000, 3: 6001, 4: 6000}
    assert plan.listen_to[3] == "tcp://gpu02:6001"
    assert plan.init_method == "tcp://gpu01:5999"
    assert plan.attach_to == {0: [], **{n: ["tcp://gpu01:6000"] for n in range(1, 5)}}


def test_slurm_srun_each_task_gets_its_own_id():
    seen = []
    for procid, (nodeid, localid, name) in enumerate(
        [(0, 0, "gpu01"), (0, 1, "gpu01"), (1, 0, "gpu02"), (1, 1, "gpu02"), (2, 0, "cpu007")]
    ):
        env = dict(
            SLURM_SRUN_ENV,
            SLURM_PROCID=str(procid),
            SLURM_LOCALID=str(localid),
            SLURM_NODEID=str(nodeid),
            SLURMD_NODENAME=name,
        )
        plan = from_slurm(env, workers_per_node=None)
        assert plan.addresses[procid] == name
        seen.extend(plan.node_ids)
    assert seen == [0, 1, 2, 3, 4]


def test_slurm_step_nodelist_wins_over_job_nodelist():
    # A step that uses only the last two nodes of a bigger allocation: ids are step-relative.
    env = dict(
        SLURM_SRUN_ENV,
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_STEP_NODELIST="gpu[03-04]",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURM_PROCID="1",
        SLURM_LOCALID="0",
        SLURM_NODEID="1",
        SLURMD_NODENAME="gpu04",
    )
    plan = from_slurm(env, workers_per_node=None)
    assert plan.hosts == ["gpu03", "gpu04"]
    assert plan.node_ids == [1]
    assert plan.init_method == "tcp://gpu03:50514"


def test_slurm_srun_uses_ntasks_per_node_when_it_is_the_only_count():
    env = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_ID": "0",
        "SLURM_NODELIST": "n[008-010]",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
    }
    plan = from_slurm(env, workers_per_node=None)
    assert plan.hosts == ["n008", "n009", "n010"]
    assert plan.world_size == 6
    assert plan.node_ids == [5]
    assert plan.listen_to[5] == "tcp://n010:50516"


def test_slurm_srun_cyclic_distribution_is_reported():
    # Under --distribution=cyclic, task 1 is the first task on gpu02: local id 0, not 1.
    env = dict(SLURM_SRUN_ENV, SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_NODEID="1", SLURMD_NODENAME="gpu02")
    with pytest.raises(ConfigError, match=r"does not match block distribution.*--distribution=block"):
        from_slurm(env, workers_per_node=None)


def test_slurm_srun_nodeid_cross_check():
    env = dict(SLURM_SRUN_ENV, SLURM_NODEID="2")
    with pytest.raises(ConfigError, match=r"SLURM_NODEID=2 but SLURM_PROCID=3 belongs to host 1"):
        from_slurm(env, workers_per_node=None)


def test_slurm_srun_procid_out_of_range():
    env = dict(SLURM_SRUN_ENV, SLURM_PROCID="9")
    with pytest.raises(ConfigError, match=r"SLURM_PROCID=9 is outside the 5 tasks"):
        from_slurm(env, workers_per_node=None)


def test_slurm_missing_step_variables_are_listed():
    with pytest.raises(ConfigError) as info:
        from_slurm({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}, workers_per_node=None)
    msg = str(info.value)
    for name in ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"):
        assert name in msg
    assert "srun" in msg and "--platform local" in msg


def test_slurm_bad_values():
    step = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1",
            "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST: hostlist 'gpu\[02-01\]' is malformed"):
        from_slurm(dict(step, SLURM_STEP_NODELIST="gpu[02-01]"), workers_per_node=1)
    with pytest.raises(ConfigError, match=r"SLURM_PROCID='x' is not a non-negative integer"):
        from_slurm(dict(step, SLURM_STEP_NODELIST="gpu01", SLURM_PROCID="x"), workers_per_node=1)
    with pytest.raises(ConfigError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x2\)' gives task counts for 2 hosts"):
        from_slurm(dict(SLURM_SRUN_ENV, SLURM_STEP_TASKS_PER_NODE="2(x2)"), workers_per_node=None)
    with pytest.raises(ConfigError, match=r"workers_per_node must be a positive integer"):
        from_slurm(SLURM_PER_NODE_ENV, workers_per_node=0)


def test_slurm_port_overflow():
    with pytest.raises(ConfigError, match=r"not a TCP port"):
        from_slurm(SLURM_PER_NODE_ENV, workers_per_node=4, base_port=65534)


# --------------------------------------------------------------------------------------------
# Kubernetes


def test_k8s_plain_hosts():
    env = {"DI_NODES": "10.0.0.1,10.0.0.2,10.0.0.3", "DI_RANK": "1"}
    plan = from_k8s(env, workers_per_node=None, base_port=50515)
    assert plan.platform == "k8s"
    assert plan.node_ids == [1]
    assert plan.world_size == 3
    assert plan.listen_to == {0: "tcp://10.0.0.1:50515", 1: "tcp://10.0.0.2:50515", 2: "tcp://10.0.0.3:50515"}
    assert plan.attach_to[1] == ["tcp://10.0.0.1:50515"]
    assert plan.init_method == "tcp://10.0.0.1:50514"


def test_k8s_host_port_entries_and_workers_per_pod():
    env = {"DI_NODES": "learner-0.mq:6000,actor-[0-1].mq:7000,127.0.0.1", "DI_RANK": "2"}
    plan = from_k8s(env, workers_per_node=2, base_port=50515, topology="star")
    assert plan.hosts == ["learner-0.mq", "actor-0.mq", "actor-1.mq", "127.0.0.1"]
    assert plan.node_ids == [4, 5]
    assert plan.world_size == 8
    assert plan.ports == {0: 6000, 1: 6001, 2: 7000, 3: 7001, 4: 7000, 5: 7001, 6: 50515, 7: 50516}
    assert plan.listen_to[5] == "tcp://actor-1.mq:7001"
    assert plan.init_method == "tcp://learner-0.mq:5999"
    assert plan.attach_to[5] == ["tcp://learner-0.mq:6000"]


def test_k8s_same_host_distinct_ports():
    env = {"DI_NODES": "127.0.0.1:50515,127.0.0.1:50516", "DI_RANK": "0"}
    plan = from_k8s(env, workers_per_node=None)
    assert plan.listen_to == {0: "tcp://127.0.0.1:50515", 1: "tcp://127.0.0.1:50516"}


def test_k8s_rank_from_hostname():
    env = {"DI_NODES": "mq-[0-2].mq-headless.default.svc.cluster.local", "HOSTNAME": "mq-2"}
    plan = from_k8s(env, workers_per_node=1, rendezvous_port=29500)
    assert plan.host_index == 2
    assert plan.node_ids == [2]
    assert plan.init_method == "tcp://mq-0.mq-headless.default.svc.cluster.local:29500"


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, r"not set: DI_NODES \(or MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK\), DI_RANK;.*--platform local"),
        ({"DI_RANK": "0"}, r"not set: DI_NODES \(or MASTER_ADDR"),
        ({"DI_NODES": "a,b"}, r"not set: DI_RANK;"),
        ({"DI_NODES": "a,b", "DI_RANK": "2"}, r"DI_RANK=2 is outside DI_NODES, which lists 2 pods"),
        ({"DI_NODES": "a,b", "DI_RANK": "-1"}, r"DI_RANK='-1' is not a non-negative integer"),
        ({"DI_NODES": "a,b", "HOSTNAME": "c"}, r"HOSTNAME='c' matches no entries"),
        ({"DI_NODES": "a:1,a:1", "DI_RANK": "0"}, r"nodes 0 and 1 the same address tcp://a:1"),
        ({"DI_NODES": "a:http", "DI_RANK": "0"}, r"malformed port in 'a:http'"),
        ({"DI_NODES": "a:70000", "DI_RANK": "0"}, r"not a TCP port"),
        ({"DI_NODES": "a::1", "DI_RANK": "0"}, r"malformed entry 'a::1'"),
        ({"DI_NODES": "a[1-2,b", "DI_RANK": "0"}, r"DI_NODES: hostlist 'a\[1-2,b' is malformed"),
    ],
)
def test_k8s_errors(env, match):
    with pytest.raises(ConfigError, match=match):
        from_k8s(env, workers_per_node=None)


def test_k8s_indexed_job_rank_from_completion_index():
    env = {"DI_NODES": "train-[0-2].train-svc", "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "train-1"}
    plan = from_k8s(env)
    assert plan.node_ids == [1] and plan.listen_to[1] == "tcp://train-1.train-svc:50515"


# Recorded in a Kubeflow PyTorchJob worker pod (training-operator v1, 1 master + 2 workers),
# with POD_IP added through the downward API.
PYTORCHJOB_WORKER_ENV = {
    "MASTER_ADDR": "dqn-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
    "PYTHONUNBUFFERED": "1",
    "HOSTNAME": "dqn-worker-1",
    "POD_IP": "10.244.1.17",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
}

# Recorded in pod 3 of an Indexed Job (completions 4, subdomain "train") whose pod template
# sets MASTER_ADDR=train-0.train, MASTER_PORT and WORLD_SIZE: the rank is the completion index.
INDEXED_JOB_ENV = {
    "JOB_COMPLETION_INDEX": "3",
    "HOSTNAME": "train-3",
    "MASTER_ADDR": "train-0.train",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "4",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
}


def test_k8s_pytorchjob_meets_at_master():
    plan = from_k8s(PYTORCHJOB_WORKER_ENV)
    assert plan.discovery == "rendezvous"
    assert plan.node_ids == [2] and plan.world_size == 3
    assert plan.init_method == "tcp://dqn-master-0:23456"
    assert plan.listen_to == {2: "tcp://10.244.1.17:50515"}
    assert plan.options_for(2)["attach_to"] == []


def test_k8s_pytorchjob_with_several_workers_per_pod():
    plan = from_k8s(PYTORCHJOB_WORKER_ENV, workers_per_node=2, base_port=7000)
    assert plan.node_ids == [4, 5] and plan.world_size == 6
    assert plan.listen_to == {4: "tcp://10.244.1.17:7000", 5: "tcp://10.244.1.17:7001"}


def test_k8s_torchrun_local_rank_offsets_the_port():
    env = dict(PYTORCHJOB_WORKER_ENV, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1")
    plan = from_k8s(env)
    assert plan.node_ids == [5] and plan.listen_to[5] == "tcp://10.244.1.17:50516"
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1: several processes per pod .* drop -n"):
        from_k8s(env, workers_per_node=2)


def test_k8s_indexed_job_with_master_addr():
    plan = from_k8s(INDEXED_JOB_ENV)
    assert plan.node_ids == [3] and plan.world_size == 4
    assert plan.init_method == "tcp://train-0.train:29500"
    assert plan.listen_to == {3: "tcp://train-3:50515"}  # the launcher swaps in the pod IP


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"MASTER_ADDR": "m"}, r"not set: MASTER_PORT, WORLD_SIZE, RANK \(or JOB_COMPLETION_INDEX\);"),
        (dict(PYTORCHJOB_WORKER_ENV, RANK="3"), r"RANK=3 is outside WORLD_SIZE=3"),
        (dict(PYTORCHJOB_WORKER_ENV, MASTER_PORT="x"), r"MASTER_PORT='x' is not a non-negative integer"),
        (dict(PYTORCHJOB_WORKER_ENV, MASTER_PORT="70000"), r"MASTER_PORT 70000 is not a TCP port"),
    ],
)
def test_k8s_torchrun_errors(env, match):
    with pytest.raises(ConfigError, match=match):
        from_k8s(env)


# --------------------------------------------------------------------------------------------
# Roles by rank


@pytest.mark.parametrize(
    ("spec", "n", "expected"),
    [
        ("learner:1,collector:*", 4, {0: ["learner"], 1: ["collector"], 2: ["collector"], 3: ["collector"]}),
        ("collector:*,learner:1", 3, {0: ["collector"], 1: ["collector"], 2: ["learner"]}),
        ("learner:1,evaluator:1,collector:*", 3, {0: ["learner"], 1: ["evaluator"], 2: ["collector"]}),
        (" learner : 2 , collector:2", 4, {0: ["learner"], 1: ["learner"], 2: ["collector"], 3: ["collector"]}),
        ("learner+evaluator:1,collector:*", 2, {0: ["evaluator", "learner"], 1: ["collector"]}),
        ("learner:1,collector:*", 1, {0: ["learner"]}),
    ],
)
def test_assign_roles(spec, n, expected):
    assert assign_roles(spec, range(n)) == expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", r"is empty"),
        ("learner", r"'learner' is not role:count"),
        ("learner:one", r"the count of 'learner' is 'one'; expected a positive integer or '\*'"),
        ("learner:0,collector:*", r"the count of 'learner' is '0'"),
        ("learner:1,collector:*,actor:*", r"only one role may take the rest"),
        ("learner:1,learner:1,collector:*", r"role 'learner' is given twice"),
        ("learner:5,collector:*", r"name 5 nodes but the job has 4; fix the counts$"),
        ("learner:1,collector:2", r"name 3 nodes but the job has 4; fix the counts or give one role the rest"),
        ("learner:1,,collector:*", r"'' is not role:count"),
        ("le arner:1", r"'le arner:1' is not role:count"),
    ],
)
def test_assign_roles_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        assign_roles(spec, range(4))


def test_resolve_hosts_names_the_unresolvable_host_and_its_source():
    assert resolve_hosts(["localhost", "127.0.0.1"]) == {"localhost": "127.0.0.1", "127.0.0.1": "127.0.0.1"}
    with pytest.raises(ConfigError, match=r"host name 'no-such-host\.invalid' \(from SLURM_STEP_NODELIST\) "
                       r"does not resolve .*; add it to DNS or /etc/hosts"):
        resolve_hosts(["localhost", "no-such-host.invalid"], "SLURM_STEP_NODELIST")


# --------------------------------------------------------------------------------------------
# Local and topologies


def test_local_plan():
    plan = from_local(3, base_port=40000)
    assert plan.node_ids == [0, 1, 2]
    assert plan.world_size == 3
    assert plan.listen_to == {0: "tcp://127.0.0.1:40000", 1: "tcp://127.0.0.1:40001", 2: "tcp://127.0.0.1:40002"}
    assert plan.init_method == "tcp://127.0.0.1:39999"
    assert plan.attach_to == {
        0: [],
        1: ["tcp://127.0.0.1:40000"],
        2: ["tcp://127.0.0.1:40000", "tcp://127.0.0.1:40001"],
    }


def test_local_errors():
    with pytest.raises(ConfigError, match=r"n_workers must be a positive integer"):
        from_local(0)
    with pytest.raises(ConfigError, match=r"unknown topology 'ring'"):
        from_local(2, topology="ring")
    with pytest.raises(ConfigError, match=r"rendezvous address tcp://127.0.0.1:50516 is also node 1"):
        from_local(2, rendezvous_port=50516)
    with pytest.raises(ConfigError, match=r"base port 0 is not a TCP port"):
        from_local(2, base_port=0)
    with pytest.raises(ConfigError, match=r"not a host name"):
        from_local(2, address="bad host")


def test_plan_for_dispatch():
    assert plan_for("local", workers_per_node=2).world_size == 2
    assert plan_for("slurm", environ=SLURM_SRUN_ENV).node_ids == [3]
    assert plan_for("slurm", environ=SLURM_PER_NODE_ENV, workers_per_node=2).node_ids == [4, 5]
    assert plan_for("k8s", environ={"DI_NODES": "a,b", "DI_RANK": "1"}).node_ids == [1]
    with pytest.raises(ConfigError, match=r"unknown platform 'yarn'"):
        plan_for("yarn")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_mesh_connects_every_pair_exactly_once(n):
    plan = from_local(n)
    pairs = _pairs(plan)
    assert all(len(p) == 2 for p in pairs), "no node attaches to itself"
    assert sorted(pairs, key=sorted) == sorted(
        (frozenset(p) for p in itertools.combinations(range(n), 2)), key=sorted
    )
    assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2


def test_mesh_pairs_on_a_multi_host_slurm_plan():
    plan = from_slurm(SLURM_PER_NODE_ENV, workers_per_node=2)
    pairs = _pairs(plan)
    assert len(pairs) == len(set(pairs)) == 15
    assert set(pairs) == {frozenset(p) for p in itertools.combinations(range(6), 2)}


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=1, max_value=40))
def test_mesh_pairs_property(n):
    listen = {i: f"tcp://h:{1000 + i}" for i in range(n)}
    owner = {a: i for i, a in listen.items()}
    attach = attach_lists(listen, "mesh")
    pairs = [frozenset((i, owner[a])) for i, addrs in attach.items() for a in addrs]
    assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2


def test_star_and_alone():
    star = from_local(4, topology="star")
    assert star.attach_to == {0: [], 1: [star.listen_to[0]], 2: [star.listen_to[0]], 3: [star.listen_to[0]]}
    assert set(_pairs(star)) == {frozenset((0, i)) for i in (1, 2, 3)}
    alone = from_local(4, topology="alone")
    assert alone.attach_to == {i: [] for i in range(4)}


def test_options_for_unknown_node():
    with pytest.raises(ConfigError, match=r"node id 7 is not in this local job"):
        from_local(2).options_for(7)


def test_plan_is_frozen():
    plan = from_local(1)
    with pytest.raises(AttributeError):
        plan.world_size = 2  # type: ignore[misc]
