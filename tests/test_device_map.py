"""Device-map grammar: valid specs, every rule's error message, and format/parse round trips."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mq.backends.torchrpc import device_map as dm
from mq.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


# --- valid specs --------------------------------------------------------------------------------

# (spec, node_id, local_cuda_devices, peers, peer_cuda_devices, expected)
VALID = [
    pytest.param("1_0_1", 0, None, None, None, {1: {0: 1}}, id="single"),
    pytest.param("1_0_1,2_0_2,0_0_0", 0, None, None, None, {1: {0: 1}, 2: {0: 2}}, id="design-example"),
    pytest.param("0_0_0", 0, None, None, None, {}, id="only-self-ignored"),
    pytest.param("0_5_7,1_0_0", 0, [0], None, None, {1: {0: 0}}, id="self-not-checked-against-local"),
    pytest.param("1_0_1,2_0_2,0_0_0", 1, None, None, None, {2: {0: 2}, 0: {0: 0}}, id="same-spec-other-node"),
    pytest.param(" 1_0_1 ,\t2_0_2 ", 0, None, None, None, {1: {0: 1}, 2: {0: 2}}, id="whitespace"),
    pytest.param("1 _ 0 _ 1", 0, None, None, None, {1: {0: 1}}, id="whitespace-in-parts"),
    pytest.param("1_0_1,1_1_0", 0, [0, 1], None, None, {1: {0: 1, 1: 0}}, id="swap-is-invertible"),
    pytest.param("1_0_0,1_1_1,2_0_1,2_1_0", 0, [0, 1], None, None, {1: {0: 0, 1: 1}, 2: {0: 1, 1: 0}},
                 id="multi-peer-multi-gpu"),
    pytest.param("1_0_1,1_0_1", 0, None, None, None, {1: {0: 1}}, id="identical-duplicate-once"),
    pytest.param("01_00_03", 0, None, None, None, {1: {0: 3}}, id="leading-zeros"),
    pytest.param("1_1_0", 0, [1], None, None, {1: {1: 0}}, id="local-subset"),
    pytest.param("2_0_7", 0, None, [1, 2], {2: [7]}, {2: {0: 7}}, id="peer-gpus-checked-ok"),
    pytest.param("1_3_0", 0, [3], None, None, {1: {3: 0}}, id="logical-index"),
    pytest.param("999999_0_0", 0, None, None, None, {999999: {0: 0}}, id="large-node-id"),
    pytest.param("1_0_0,2_0_0,3_0_0", 0, None, None, None, {1: {0: 0}, 2: {0: 0}, 3: {0: 0}},
                 id="same-gpu-different-peers"),
    # Default (no spec) maps.
    pytest.param(None, 0, [0, 1], None, None, {}, id="default-no-peers"),
    pytest.param("", 0, [0, 1], [1, 2], None, {1: {0: 0, 1: 1}, 2: {0: 0, 1: 1}}, id="default-identity"),
    pytest.param("   ", 0, [0], [0, 1], None, {1: {0: 0}}, id="default-blank-skips-self"),
    pytest.param(None, 0, [0, 1, 2], [1, 2], {1: [0], 2: [1, 2, 3]}, {1: {0: 0}, 2: {1: 1, 2: 2}},
                 id="default-intersection"),
    pytest.param(None, 0, [0], [1], {1: [3]}, {}, id="default-no-common-gpu"),
    pytest.param(None, 0, [], [1, 2], None, {}, id="default-no-local-gpus"),
    pytest.param(None, 7, [0, 1], range(100), None, {p: {0: 0, 1: 1} for p in range(100) if p != 7},
                 id="default-100-nodes"),
    pytest.param(None, 0, [0], range(5000), None, {p: {0: 0} for p in range(1, 5000)}, id="default-5000-nodes"),
]


@pytest.mark.parametrize("spec, node_id, local, peers, peer_devs, expected", VALID)
def test_parse_valid(spec, node_id, local, peers, peer_devs, expected):
    got = dm.parse(spec, node_id, local, peers=peers, peer_cuda_devices=peer_devs)
    assert got == expected
    # Whatever parse accepts, format renders canonically and parse reads back unchanged.
    assert dm.parse(dm.format(got), node_id) == got
    for inner in got.values():
        assert dm.invert(dm.invert(inner)) == inner


def test_explicit_spec_ignores_default():
    # An explicit spec is the whole map: peers it does not name get no device map.
    assert dm.parse("1_0_0", 0, [0], peers=[1, 2]) == {1: {0: 0}}


def test_parse_accepts_parsed_mapping():
    assert dm.parse({1: {0: 1}, 0: {0: 0}}, 0) == {1: {0: 1}}


def test_default_uses_visible_gpus_when_local_unknown():
    # On a CPU-only box torch sees no GPUs, so the default has nothing to map; with GPUs it
    # maps each visible one. Either way it must not raise.
    got = dm.parse(None, 0, None, peers=[1])
    assert got in ({}, {1: {i: i for i in range(len(got.get(1, {})))}})


@pytest.mark.parametrize(
    "mapping, text",
    [
        ({}, ""),
        ({1: {}}, ""),
        ({2: {1: 0, 0: 1}, 1: {0: 0}}, "1_0_0,2_0_1,2_1_0"),
        ({10: {0: 0}, 9: {0: 0}}, "9_0_0,10_0_0"),  # numeric, not lexicographic, order
    ],
)
def test_format_canonical(mapping, text):
    assert dm.format(mapping) == text


def test_invert():
    assert dm.invert({0: 1, 1: 0, 2: 5}) == {1: 0, 0: 1, 5: 2}


# --- invalid specs ------------------------------------------------------------------------------

# (spec, node_id, local, peers, peer_devs, offending token as quoted, key phrase of the rule)
INVALID = [
    pytest.param("1_0", 0, None, None, None, "'1_0'", "is malformed: it has 2 part", id="two-parts"),
    pytest.param("1_0_1_2", 0, None, None, None, "'1_0_1_2'", "expected 3", id="four-parts"),
    pytest.param("101", 0, None, None, None, "'101'", "is malformed", id="no-separators"),
    pytest.param("1_0_1,", 0, None, None, None, "''", "empty token '' at position 2", id="trailing-comma"),
    pytest.param(",1_0_1", 0, None, None, None, "''", "empty token '' at position 1", id="leading-comma"),
    pytest.param("1_0_1,,2_0_2", 0, None, None, None, "''", "empty token '' at position 2 of 3", id="double-comma"),
    pytest.param("1__1", 0, None, None, None, "'1__1'", "local gpu is empty", id="empty-part"),
    pytest.param("-1_0_1", 0, None, None, None, "'-1_0_1'", "negative peer node id", id="negative-node"),
    pytest.param("1_-1_0", 0, None, None, None, "'1_-1_0'", "negative local gpu", id="negative-local"),
    pytest.param("1_0_-2", 0, None, None, None, "'1_0_-2'", "negative peer gpu", id="negative-peer-gpu"),
    pytest.param("1_a_1", 0, None, None, None, "'1_a_1'", "local gpu 'a' is not a non-negative integer",
                 id="non-integer"),
    pytest.param("1_0.5_1", 0, None, None, None, "'1_0.5_1'", "not a non-negative integer", id="float"),
    pytest.param("1_+0_1", 0, None, None, None, "'1_+0_1'", "not a non-negative integer", id="plus-sign"),
    pytest.param("1_\u0663_1", 0, None, None, None, "'1_\u0663_1'", "not a non-negative integer",
                 id="non-ascii-digit"),
    pytest.param("1_0_1" + "0" * 30, 0, None, None, None, "'1_0_1" + "0" * 30 + "'", "too large", id="huge"),
    pytest.param("1:0:1", 0, None, None, None, "'1:0:1'", "is malformed", id="wrong-separator"),
    pytest.param("1_2_0", 0, [0, 1], None, None, "'1_2_0'", "unknown local GPU 2", id="unknown-local"),
    pytest.param("1_0_0", 0, [], None, None, "'1_0_0'", "unknown local GPU 0", id="no-local-gpus"),
    pytest.param("1_0_3", 0, None, None, {1: [0, 1]}, "'1_0_3'", "unknown peer GPU 3", id="unknown-peer-gpu"),
    pytest.param("5_0_0", 0, None, [1, 2], None, "'5_0_0'", "unknown peer node 5", id="unknown-peer"),
    pytest.param("1_0_1,1_0_2", 0, None, None, None, "'1_0_2'", "conflicting duplicate of '1_0_1'",
                 id="conflicting-duplicate"),
    pytest.param("1_0_0,1_1_0", 0, None, None, None, "'1_1_0'", "not invertible", id="not-invertible"),
    pytest.param("2_0_0,1_0_0,2_1_0", 0, None, None, None, "'2_1_0'", "'2_0_0' already maps",
                 id="not-invertible-names-both"),
]


@pytest.mark.parametrize("spec, node_id, local, peers, peer_devs, token, rule", INVALID)
def test_parse_invalid(spec, node_id, local, peers, peer_devs, token, rule):
    with pytest.raises(ConfigError, match=re.escape(rule)) as info:
        dm.parse(spec, node_id, local, peers=peers, peer_cuda_devices=peer_devs)
    msg = str(info.value)
    assert token in msg
    # Every message tells the user what to write instead.
    assert re.search(r"expected|use |keep |map |remove|separate|add ", msg), msg


def test_malformed_self_token_still_rejected():
    # Self entries are ignored, but a spec shared by all nodes must be well formed everywhere.
    with pytest.raises(ConfigError, match=re.escape("'0_x_0'")):
        dm.parse("0_x_0,1_0_0", 0)


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (dict(node_id=-1), "node_id -1 is not a node id"),
        (dict(node_id=True), "node_id True is not a node id"),
        (dict(node_id=0, local_cuda_devices=[0, 0]), "lists GPU 0 twice"),
        (dict(node_id=0, local_cuda_devices=[-1]), "entry -1 is not a GPU index"),
        (dict(node_id=0, peers=[-3]), "peer -3 is not a node id"),
    ],
)
def test_bad_arguments(kwargs, phrase):
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        dm.parse("1_0_0", **kwargs)


def test_non_string_spec():
    with pytest.raises(ConfigError, match="must be a string"):
        dm.parse(101, 0)


@pytest.mark.parametrize(
    "mapping, phrase",
    [
        ({1: {0: 0, 1: 0}}, "not invertible"),
        ({-1: {0: 0}}, "must be non-negative integers"),
        ({1: {"0": 0}}, "must be non-negative integers"),
        ({1: [0]}, "must be a mapping"),
    ],
)
def test_format_invalid(mapping, phrase):
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        dm.format(mapping)


def test_invert_rejects_non_invertible():
    with pytest.raises(ConfigError, match=r"'1_1_0'.*not invertible.*'1_0_0'"):
        dm.invert({0: 0, 1: 0}, peer=1)


# --- backends that cannot use a device map ------------------------------------------------------


@pytest.mark.parametrize("mq_type", ["torchrpc:cpu", "nng", "torchrpc"])
@pytest.mark.parametrize("spec", ["1_0_0", {1: {0: 0}}])
def test_reject_for_cpu(mq_type, spec):
    with pytest.raises(ConfigError, match=r"'1_0_0'.*device maps need torchrpc:cuda"):
        dm.reject_for_cpu(mq_type, spec)


@pytest.mark.parametrize(
    "mq_type, spec",
    [("torchrpc:cuda", "1_0_0"), ("torchrpc:cpu", None), ("nng", ""), ("nng", "  "), ("nng", {}), ("nng", {1: {}})],
)
def test_reject_for_cpu_allows(mq_type, spec):
    dm.reject_for_cpu(mq_type, spec)


# --- --local-cuda-devices -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("0,1", [0, 1]), (" 2 , 0 ", [2, 0]), ("3", [3]), ("", []), (None, [])],
)
def test_parse_devices(text, expected):
    assert dm.parse_devices(text) == expected


@pytest.mark.parametrize(
    "text, token, phrase",
    [
        ("0,0", "'0'", "is a duplicate"),
        ("0,a", "'a'", "not a non-negative integer"),
        ("0,-1", "'-1'", "negative GPU index"),
        ("0,", "''", "empty entry '' at position 2"),
        ("1.5", "'1.5'", "not a non-negative integer"),
    ],
)
def test_parse_devices_invalid(text, token, phrase):
    with pytest.raises(ConfigError, match=re.escape(phrase)) as info:
        dm.parse_devices(text)
    assert token in str(info.value)


# --- properties ---------------------------------------------------------------------------------


@st.composite
def device_maps(draw):
    """Random valid {peer: {local: peer_gpu}} maps, each inner map one-to-one."""
    peers = draw(st.lists(st.integers(1, 10_000), unique=True, max_size=8))
    out = {}
    for peer in peers:
        n = draw(st.integers(1, 8))
        local = draw(st.lists(st.integers(0, 63), unique=True, min_size=n, max_size=n))
        remote = draw(st.lists(st.integers(0, 63), unique=True, min_size=n, max_size=n))
        out[peer] = dict(zip(local, remote))
    return out


@settings(max_examples=200, deadline=None)
@given(device_maps())
def test_round_trip(mapping):
    text = dm.format(mapping)
    assert dm.parse(text, 0) == mapping
    assert dm.format(dm.parse(text, 0)) == text


@settings(max_examples=100, deadline=None)
@given(device_maps(), st.randoms(use_true_random=False), st.sampled_from(["", " ", "\t"]))
def test_token_order_and_spacing_do_not_matter(mapping, rnd, pad):
    tokens = [f"{pad}{p}_{l}_{r}{pad}" for p, inner in mapping.items() for l, r in inner.items()]
    rnd.shuffle(tokens)
    spec = ",".join(tokens + tokens[:1])  # plus an identical repeat
    assert dm.format(dm.parse(spec, 0)) == dm.format(mapping)
