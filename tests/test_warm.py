"""Warm receive buffers (mq/backends/nng/links/warm.py): a slab is lent while any view of the frame
lives and reused after, and the bound is kept."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from mq.backends.nng.links.warm import WarmBuffers, capacity
from mq.wire.codec import Codec, split

pytestmark = pytest.mark.timeout(60)

MB = 1 << 20


def test_small_frames_take_no_slab_and_sizes_round_to_a_class():
    w = WarmBuffers(max_bytes=64 * MB)
    assert w.take(MB - 1) is None
    assert capacity(MB) == MB and MB < capacity(MB + 1) <= MB + MB // 8


def test_a_slab_is_reused_only_after_every_view_of_its_frame_is_gone():
    w = WarmBuffers(max_bytes=64 * MB)
    buf = w.take(4 * MB)
    arr = np.frombuffer(buf, np.uint8)[100:200]  # a view outliving the buffer object
    arr[:] = 7
    del buf
    gc.collect()
    second = w.take(4 * MB)  # the first slab is still lent: a new one
    assert w.mapped == 2 * capacity(4 * MB) and w.stats["reused"] == 0
    del second
    gc.collect()
    third = w.take(4 * MB)
    assert w.stats["reused"] == 1 and w.mapped == 2 * capacity(4 * MB)
    assert arr.sum() == 700  # never overwritten while lent
    del third, arr


def test_past_the_bound_frames_get_fresh_buffers_and_idle_slabs_make_room():
    w = WarmBuffers(max_bytes=10 * MB)
    a = w.take(8 * MB)
    assert a is not None and w.take(8 * MB) is None and w.stats["fresh"] == 1
    del a
    gc.collect()
    b = w.take(3 * MB)  # 8 + 3 MiB is over the bound: the idle 8 MiB slab is unmapped
    assert b is not None and w.mapped == capacity(3 * MB)
    del b


def test_a_frame_decoded_from_a_slab_is_intact_and_writable():
    w = WarmBuffers(max_bytes=64 * MB)
    payload = {"w": np.arange(MB, dtype=np.float32), "n": 3}
    frame = Codec().encode(0, "t", 1, 0, 0, payload)
    buf = w.take(frame.size)
    frame.write_into(buf)
    env = Codec().decode(*split(buf))
    del buf
    got = env.payload["w"]
    assert np.array_equal(got, payload["w"]) and got.flags.writeable
    gc.collect()
    assert w.idle_bytes() == 0  # the array still holds the slab
    del env, got
    gc.collect()
    assert w.idle_bytes() == capacity(frame.size)
