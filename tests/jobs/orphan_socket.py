"""A pynng socket nobody closed, collected inside an NNG pipe callback while the main thread
closes another socket: NNG's reaper thread waited for itself and the process hung (CI, once).
Prints "ok" when nothing hung. Argument: a directory for the ipc addresses."""

import gc
import sys
import threading
import time

import pynng

import mq.backends.nng.transport  # noqa: F401  (what a user of the nng backend imports)

where = sys.argv[1]
first = pynng.Pull0(listen=f"ipc://{where}/a")
orphan = pynng.Push0(dial=f"ipc://{where}/a")  # a live pipe, never closed
time.sleep(0.2)
del orphan  # kept alive by its own reference cycle until the collector runs
far = pynng.Pull0(listen=f"ipc://{where}/c")
near = pynng.Push0()
collected = threading.Event()
near.add_post_pipe_remove_cb(lambda _pipe: (gc.collect(), collected.set()))  # on NNG's reaper
near.dial(f"ipc://{where}/c", block=True)
time.sleep(0.2)
far.close()
assert collected.wait(10), "the pipe callback never ran"
near.close()
first.close()
print("ok")
