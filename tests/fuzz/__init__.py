"""Fuzzing every parser that reads bytes from the network (docs/concepts/trust.md).

- :mod:`tests.fuzz.targets`: one function per parser, taking the fuzzer's bytes. It returns
  when the parser took the input or refused it with :class:`mq.errors.ProtocolError`; any
  other exception, and any broken invariant (:class:`~tests.fuzz.targets.Finding`), is a bug.
- :mod:`tests.fuzz.run`: runs one target under atheris (coverage-guided libFuzzer), or under
  hypothesis where atheris is not installed. ``scripts/fuzz`` runs every target, bounded.
- :mod:`tests.fuzz.seeds`: writes the seed inputs into ``corpus/<target>/``
  (``python -m tests.fuzz.seeds``). Crashers found later are copied there too, by hand.
- ``tests/test_fuzz_corpus.py`` replays every corpus file through its target: each crasher
  stays a regression test.
"""

#: The fuzz targets by name, with the modules whose coverage guides each (their functions are
#: in :mod:`tests.fuzz.targets`, which imports mq: under atheris, mq must be imported first
#: while instrumenting, so this table lives here). Instrumenting only these keeps the signal
#: on the parser and a target's start short.
INSTRUMENTED = {
    "handshake": ("mq.wire.handshake",),
    "codec": ("mq.wire.codec",),
    "unixlink": ("mq.backends.nng.links.unix", "mq.backends.nng.links.base"),
    "tcplink": ("mq.backends.nng.links.tcp", "mq.backends.nng.links.base"),
    "shm": ("mq.datapaths.shm.pool",),
    "cuda": ("mq.datapaths.nvlink.cuda_ipc",),
    "rdma": ("mq.datapaths.rdma.path",),
}
NAMES = tuple(INSTRUMENTED)
