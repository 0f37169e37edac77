"""Every input in tests/fuzz/corpus/<target>/ (seeds, and the crashers the fuzzer found) replayed
through its target: a parser of network input returns or raises ProtocolError, nothing else
(tests/fuzz/targets.py says what each target checks). Plus one input too big to store: a
header listing 2,000,000 buffer sizes, refused without a memory spike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fuzz import NAMES, targets

pytestmark = pytest.mark.timeout(120)

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz", "corpus")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_files() -> list[tuple[str, str]]:
    return [(target, name) for target in NAMES
            for name in sorted(os.listdir(os.path.join(CORPUS, target)))]


@pytest.fixture(scope="module", autouse=True)
def unmap_targets():
    yield
    targets.close()  # the shm target's pool


def test_every_target_has_a_corpus():
    assert {target for target, _ in corpus_files()} == set(NAMES)


@pytest.mark.parametrize("target, name", corpus_files(), ids=lambda v: v)
def test_corpus_input(target, name):
    with open(os.path.join(CORPUS, target, name), "rb") as f:
        targets.TARGETS[target](f.read())


def test_runtime_seeds_of_the_shm_target():
    seeds = targets.shm_seeds()
    assert targets.shm_peer().why_not is None, targets.shm_peer().why_not  # real descriptors open
    for seed in seeds:
        targets.shm_target(seed)


def test_runtime_seeds_of_the_rdma_target():
    # What a real sender's rdma path sends (its signed offer, the descriptor it placed) loads on
    # the target's receiver and reads: the target's stand-ins and signing match the path's.
    for offer, desc in targets.rdma_runtime_offers():
        node = targets.RdmaNode()
        try:
            node.view(node.accept(offer), desc)
        finally:
            node.close()
    for seed in targets.DYNAMIC_SEEDS["rdma"]():
        targets.rdma_target(seed)
    # and the stored good offer loads while the forged one does not (the target's premise)
    import msgpack

    from mq.errors import ProtocolError

    for name, loads in (("seed-offer-good", True), ("seed-offer-forged-segments", False)):
        with open(os.path.join(CORPUS, "rdma", name), "rb") as f:
            offer = msgpack.unpackb(f.read())
        node = targets.RdmaNode()
        try:
            node.accept(offer)
        except ProtocolError:
            assert not loads, name
        else:
            assert loads, name
        finally:
            node.close()


# A header listing 2,000,000 buffer sizes (zero bytes each, so every one "fits"): before buffer
# lists were bounded, the receiver made a view per entry, ~400 MB for a 2 MB frame. Measured in
# a fresh process, whose peak RSS (VmHWM) is not already raised by the tests before.
BIG_HEADER = """
import msgpack, struct
from mq.wire.codec import MSG, VERSION, Codec, split_batch
from mq.errors import ProtocolError

def peak_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024

header = msgpack.packb([VERSION, MSG, "t", 1, 0, 0, b"\\x90", [0] * 2_000_000, None, 0.0])
frame = struct.pack("<I", len(header)) + header
before = peak_mb()
for decode in (Codec().decode_frame, lambda f: list(split_batch(f))):
    try:
        decode(frame)
    except ProtocolError as exc:
        print("refused:", str(exc)[:100])
    else:
        raise SystemExit("decoded a frame listing 2,000,000 buffers")
print(f"peak grew {peak_mb() - before:.1f} MB")
"""


def test_a_header_listing_two_million_buffers_is_refused_without_a_memory_spike():
    out = subprocess.run([sys.executable, "-c", BIG_HEADER], cwd=REPO, capture_output=True, text=True,
                         timeout=100)
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0, out.stderr[-2000:] or out.stdout
    grew = float(out.stdout.rsplit("peak grew", 1)[1].split()[0])
    assert grew < 100, f"decoding it raised the peak RSS by {grew:.0f} MB"
