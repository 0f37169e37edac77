"""The trust boundary, input by input (issue: "nothing a stranger or a faulty peer sends can
crash, silence or bloat a node"). Each input here once stopped, crashed or bloated a node.

The node under attack runs in a child process (tests/jobs/nng_peer.py), so a crash fails the
test instead of killing pytest; the test process is its legitimate peer (node 0) and checks,
after each attack, that the victim still answers calls, still takes new peers, and counted
what it refused.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import msgpack
import pytest

import mq
from mq.wire import handshake
from mq.wire.codec import HELLO, HELLO_ACK, MSG, VERSION, Codec, Frame
from mq.testing import wait_until
from tests.strangers import SURFACES, closed_by_node, raw_frame, send_as_strangers, stranger

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A header list of 8 fields instead of 10: the I/O thread read header[8] and died.
EIGHT_FIELDS = bytes.fromhex("0c000000980200a174090000c401c090")


def nested_tuples(depth: int) -> bytes:
    """A payload tree of ``depth`` tuples inside each other (~4 bytes a level): decoding it
    the recursive way overflowed the C stack (SIGSEGV) long before Python's recursion limit."""
    tree = msgpack.packb(None)
    for _ in range(depth):
        tree = msgpack.packb(msgpack.ExtType(1, msgpack.packb([msgpack.ExtType(1, tree)])))
    return tree


@pytest.fixture
def victim():
    """(node 0 in this process, the victim's process, the victim's addresses)."""
    q = mq.create("nng", 0, "learner", timeout=5)
    with q:
        proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.nng_peer", "1", q.addresses["tcp"], "small"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
            q.wait_for_peers(ids=[1], timeout=10)
            yield q, proc, q._peers.by_id[1].info["addresses"]
        finally:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            proc.stderr.close()
            # The victim was SIGKILLed: requests it answered but had not yet acknowledged are
            # reported by stop(), rightly, and are not what these tests check.
            q.stop(raise_undelivered=False)


def still_serving(q: mq.MQ, proc: subprocess.Popen, addresses: dict[str, str]) -> dict:
    """The victim is alive, answers its peer, takes a new peer; returns its counters."""
    assert proc.poll() is None, f"the victim died (exit {proc.returncode}): {proc.stderr.read()[-3000:]}"
    assert q.call(1, "echo", "still here", timeout=10) == "still here"
    with mq.create("nng", 2, attach_to=[addresses["tcp"]], timeout=5) as newcomer:
        newcomer.wait_for_peers(ids=[1], timeout=10)  # its I/O thread still reads the join port
    return q.call(1, "stats", None, timeout=10)


def refusals(stats: dict) -> int:
    return sum(stats["rejected"].values()) + stats["dropped_malformed"] + stats["dropped_oversized"]


@pytest.mark.parametrize("surface", SURFACES)
def test_an_eight_field_header_from_a_stranger_is_refused_on_every_surface(victim, surface):
    q, proc, addresses = victim
    send_as_strangers(addresses, surface, [EIGHT_FIELDS] * 3)
    assert wait_until(lambda: q.call(1, "stats", None, timeout=10)["rejected"].get("handshake_malformed", 0) >= 3)
    still_serving(q, proc, addresses)


def test_an_eight_field_header_from_a_peer_is_dropped_and_counted(victim):
    q, proc, addresses = victim
    q.transport.send(1, Frame(MSG, [VERSION, MSG, "work", 0, 0, 0, b"\xc0", []], [], []), 5)
    assert wait_until(lambda: q.call(1, "stats", None, timeout=10)["dropped_malformed"] >= 1)
    still_serving(q, proc, addresses)


@pytest.mark.parametrize("surface", SURFACES)
def test_deeply_nested_tuples_from_a_stranger_are_never_decoded(victim, surface):
    q, proc, addresses = victim
    frame = bytes(Frame.build(MSG, "work", 0, 0, 0, nested_tuples(250), []).to_bytes())
    send_as_strangers(addresses, surface, [frame])
    assert wait_until(lambda: q.call(1, "stats", None, timeout=10)["rejected"].get("unauthenticated", 0) >= 1)
    still_serving(q, proc, addresses)


def test_deeply_nested_tuples_from_a_peer_are_dropped_and_counted(victim):
    q, proc, addresses = victim
    q.transport.send(1, Frame.build(MSG, "work", 0, 0, 0, nested_tuples(250), []), 5)
    assert wait_until(lambda: q.call(1, "stats", None, timeout=10)["dropped_malformed"] >= 1)
    still_serving(q, proc, addresses)


def test_a_sender_is_told_before_sending_tuples_nested_too_deep():
    payload: object = 1
    for _ in range(40):
        payload = (payload,)
    with pytest.raises(mq.EncodeError, match="nested more than 32 deep"):
        Codec().encode(MSG, "t", 0, 0, 0, payload)


def test_a_sender_is_told_before_sending_what_a_receiver_refuses():
    """Each bound the receiver enforces on a member is an EncodeError at the sender, naming the fix."""
    import numpy as np

    with pytest.raises(mq.EncodeError, match=r"items have no bytes \(give the string or void type a length"):
        Codec().encode(MSG, "t", 0, 0, 0, np.zeros(3, dtype=[]))  # (numpy makes "S0" "S1")
    with pytest.raises(mq.EncodeError, match=r"cannot send 65537 arrays.*at most 65536\): split it, or stack them"):
        Codec().encode(MSG, "t", 0, 0, 0, [np.zeros(1, np.uint8)] * 65537)


@pytest.mark.parametrize("surface", SURFACES)
def test_oversized_frames_are_counted_on_every_surface(victim, surface):
    """The victim accepts frames of at most 1 MiB, and at most handshake.MAX_FRAME before a
    link authenticated: a link refuses a larger one from its announced length, NNG's port once
    NNG handed it over. (Above max_frame_bytes, NNG drops a message itself and closes the pipe,
    uncounted by mq: NNG counts it with ordinary disconnects.)"""
    q, proc, addresses = victim
    for size in (handshake.MAX_FRAME + 100, 512 << 10):
        s = stranger(addresses, surface)
        try:
            if surface in ("tcp", "ipc"):  # a frame whose header length makes it that large
                s.send(struct.pack("<I", size - 4) + bytes(size - 4))
            else:
                s.announce(size)
        except OSError:
            pass  # the victim closed the link on reading the length, before the rest went
        try:
            closed_by_node(s)
        finally:
            s.close()
    assert wait_until(lambda: q.call(1, "stats", None, timeout=10)["dropped_oversized"] >= 2)
    still_serving(q, proc, addresses)


def test_a_flood_of_hostile_frames_logs_a_few_lines_and_summaries(victim):
    q, proc, addresses = victim
    send_as_strangers(addresses, "unix", [EIGHT_FIELDS, raw_frame(MSG, 0, "x"), b"\xff" * 40] * 100)
    assert wait_until(lambda: refusals(q.call(1, "stats", None, timeout=10)) >= 300, 30)
    proc.kill()
    proc.wait(10)
    lines = [line for line in proc.stderr.read().splitlines() if "refused" in line or "dropped" in line]
    assert 1 <= len(lines) <= 10, lines  # 5 as they came, then one summary per 10 s


def test_a_duplicate_node_id_is_a_config_error_naming_it():
    """A second process taking a live node's id learns it at its first wait, from the live
    node's signed refusal (it used to time out with 'is a node listening there?')."""
    with mq.create("inproc", 5, listen_to="inproc://dup-holder") as holder:
        with mq.create("inproc", 5, attach_to=["inproc://dup-holder"], timeout=3) as twin:
            with pytest.raises(mq.ConfigError, match=r"node id 5 is taken by a live process .*unique node id"):
                twin.wait_for_peers(1, timeout=5)
        assert holder.stats().rejected.get("duplicate_id", 0) >= 1
        assert holder.peers() == []


def test_a_refusal_from_a_stranger_is_not_believed(caplog):
    """A HELLO_ACK carrying an error, but no valid proof, changes nothing: anyone could send it."""
    with mq.create("nng", 0, timeout=3) as q:
        forged = {**_hello_of(q), "error": "node id 0 is taken", "proof": b"\0" * 32, "read_ok": False}
        with q._join.lock:  # a greeting of ours it could claim to answer
            q._join.greetings[forged["token"]] = (os.urandom(16), "tcp://127.0.0.1:9", 0.0)
        send_as_strangers(q.addresses, "tcp", [raw_frame(HELLO_ACK, 7, dict(forged, node_id=7), topic="")])
        assert wait_until(lambda: q.stats().rejected.get("bad_proof", 0) >= 1)
        assert q.wait_for_peers(0, timeout=0.5) == []  # no ConfigError


def _hello_of(q: mq.MQ) -> dict:
    return q._join.hello_payload("t-forged", os.urandom(16))


def test_handshake_frames_are_small_and_typed():
    """The boundary's own rules, without a network: too large, trailing buffers, a payload of
    the wrong shape, an extension type where a string goes: all refused with their cause."""
    good = raw_frame(HELLO, 3, _hello_of(mq.create("inproc", 3)), topic="")
    assert handshake.parse(good).sender == 3
    with pytest.raises(mq.errors.Oversized):
        handshake.parse(good + b"\0" * handshake.MAX_FRAME)
    with pytest.raises(handshake.Refused, match="header length"):
        handshake.parse(good + b"\0" * 64)  # a handshake frame carries no buffers
    bad = msgpack.packb({"node_id": 3, "labels": [msgpack.ExtType(1, b"\x90")]})
    with pytest.raises(handshake.Refused) as info:
        handshake.parse(bytes(Frame.build(HELLO, "", 3, 0, 0, bad, []).to_bytes()))
    assert info.value.cause == "handshake_malformed"
    with pytest.raises(handshake.Refused) as info:
        handshake.parse(raw_frame(MSG, 3, "hi"))
    assert info.value.cause == "unauthenticated"


@pytest.mark.parametrize("window", [0, -1, 1 << 25, "64", 1.5, None])
def test_a_hello_window_out_of_bounds_or_of_the_wrong_type_is_refused(window):
    """The flow-control window a HELLO states (frames a sender may keep unconfirmed) is a
    bounded int: a peer cannot make others buffer without limit, nor stall them with 0."""
    hello = _hello_of(mq.create("inproc", 3))
    assert handshake.parse(raw_frame(HELLO, 3, hello, topic="")).payload["window"] == 1024
    if window is None:  # optional: an older peer's HELLO without it is accepted
        hello.pop("window")
        assert handshake.parse(raw_frame(HELLO, 3, hello, topic="")).sender == 3
        return
    with pytest.raises(handshake.Refused) as info:
        handshake.parse(raw_frame(HELLO, 3, dict(hello, window=window), topic=""))
    assert info.value.cause == "handshake_malformed"
