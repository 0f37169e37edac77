"""Fuzzing (hypothesis, bounded for CI): the frame decoder only ever raises ProtocolError, and
the join handshake fed arbitrary frames never crashes a node and never admits a peer. The
fuzz targets of tests/fuzz/ run here too, on mutations of their seeds: where atheris is not
installed, this is what fuzzes them in the test suite (scripts/fuzz runs them longer)."""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mq
from mq.wire.codec import HELLO, HELLO_ACK, LINK, VERSION, Codec, Frame
from mq.errors import ProtocolError
from tests.fuzz import NAMES, targets
from tests.fuzz.run import hypothesis_inputs, read_corpus

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=20),
                 st.binary(max_size=40))
tree = st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                 st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-2**63, 2**63)),
                                                                 kids, max_size=5)), max_leaves=20)


def _decode_or_protocol_error(data: bytes) -> None:
    try:
        Codec().decode_frame(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_are_protocol_errors(data):
    _decode_or_protocol_error(data)


@FUZZ
@given(head=st.lists(tree, min_size=0, max_size=11), tail=st.binary(max_size=200))
def test_random_envelopes_are_protocol_errors(head, tail):
    packed = msgpack.packb(head, use_bin_type=True)
    _decode_or_protocol_error(len(packed).to_bytes(4, "little") + packed + tail)


@FUZZ
@given(kind=st.integers(0, 20), sender=tree, sizes=tree, descs=tree, tree_=st.binary(max_size=60))
def test_mutated_fields_of_a_real_frame_are_protocol_errors(kind, sender, sizes, descs, tree_):
    head = [VERSION, kind, "t", sender, 0, 0, tree_, sizes, descs, 0.0]
    _decode_or_protocol_error(bytes(Frame(kind, head, [], []).to_bytes()))


@pytest.fixture(scope="module")
def node():
    q = mq.create("inproc", 0, listen_to="inproc://fuzz-target", timeout=2)
    with q:
        yield q


@FUZZ
@given(kind=st.sampled_from([HELLO, HELLO_ACK, LINK]), sender=st.integers(0, 5),
       payload=st.one_of(tree, st.fixed_dictionaries(
           {"node_id": st.integers(0, 5), "incarnation": st.text(max_size=8), "nonce": st.binary(max_size=20)},
           optional={"token": st.text(max_size=8), "proof": st.binary(max_size=40), "read_ok": tree,
                     "locality": tree, "shm": tree, "addresses": tree, "max_frame_bytes": tree})))
def test_arbitrary_handshake_frames_never_crash_or_admit(node, kind, sender, payload):
    frame = Codec().encode(kind, "", sender, 0, 0, payload)
    node._dispatch.on_frame(frame.header, [memoryview(bytes(b)) for b in frame.buffers], ("inproc", "stranger"))
    assert node.peers() == [] and node.running


@pytest.mark.parametrize("name", NAMES)
def test_mutated_seeds_of_each_fuzz_target_raise_only_protocol_errors(name):
    corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz", "corpus", name)
    seeds = read_corpus(corpus, "seed-") + [seed for make in [targets.DYNAMIC_SEEDS.get(name)] if make
                                             for seed in make()]

    @FUZZ
    @given(hypothesis_inputs(name, seeds))
    def run(data: bytes) -> None:
        targets.TARGETS[name](data)

    try:
        run()
    finally:
        targets.close()


def test_the_structure_aware_mutator_stays_small():
    # CI's fuzz run once died of libFuzzer's 2 GB rss limit inside the harness, not in mq: this
    # mutation nested repeated extension values into ~1 GB of packed bytes.
    import tracemalloc

    from tests.fuzz.mutate import mutate

    frame = bytes.fromhex(
        "2a0000009a0200ab7472616e736974696f6e73010000c409cbfff0000000000000924010c0cb3ff0000000"
        "000000000000000000000000000000000000000000000000000000803f0000004000004040000080400000"
        "a0400000c0400000e040000000410000104100002041000030410000404100005041000060410000704136"
        "bb85a8ffff19959d83e62ac5df9d1c")
    tracemalloc.start()
    try:
        for seed in range(50_600, 50_700):
            mutate(frame, 8192, seed, lambda data, _max: data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"the mutator used {peak >> 20} MiB"
