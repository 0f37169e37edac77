"""DI-engine's own Parallel scenarios (ding/framework/tests/test_parallel.py of DI-engine 0.5.3),
run through ``Parallel.runner(..., mq_type="mq:...")``: ``python -m tests.ding_jobs.scenarios
<scenario> <mq type>`` prints ``OK <scenario> <mq type> <seconds>`` or fails."""

import os
import sys
import time
from collections import defaultdict

import mq.integrations.ding  # noqa: F401  (registers mq:nng, mq:torchrpc:cpu, mq:torchrpc:cuda)
from ding.framework import Parallel
from mq.launch import free_port


def parallel_main():
    msg = defaultdict(bool)

    def test_callback(key):
        msg[key] = True

    router = Parallel()
    router.on("test_callback", test_callback)
    time.sleep(0.7)  # Wait for nodes to bind
    for _ in range(30):
        router.emit("test_callback", "ping")
        if msg["ping"]:
            break
        time.sleep(0.03)
    assert msg["ping"]
    time.sleep(0.7)  # Avoid can not receiving messages from each other after exit parallel


def uncaught_exception_main():
    router = Parallel()
    if router.node_id == 0:
        time.sleep(0.1)
        raise Exception("uncaught exception")
    else:
        time.sleep(0.2)


def disconnected_main():
    router = Parallel()
    if router.node_id == 0:
        time.sleep(0.1)
        greets = []  # Receive two messages then exit
        router.on("greeting", lambda: greets.append("."))
        for _ in range(10):
            if len(greets) == 1:
                break
            else:
                time.sleep(0.1)
        assert len(greets) > 0
    else:
        for i in range(10):  # Send 10 greetings even if the target process is exited
            router.emit("greeting")
            time.sleep(0.1)
        assert i == 9


class AutoRecover:

    @classmethod
    def main_p0(cls):
        greets = []  # Wait for p1's message and recovered message from p1
        router = Parallel()
        router.on("greeting_0", lambda msg: greets.append(msg))
        for _ in range(50):
            if greets and greets[-1] == "recovered_p1":
                break
            time.sleep(0.1)
        assert greets and greets[-1] == "recovered_p1"

    @classmethod
    def main_p1(cls):
        greets = []
        router = Parallel()
        router.on("greeting_1", lambda msg: greets.append(msg))
        if router._retries == 0:
            for _ in range(10):
                router.emit("greeting_0", "")
                time.sleep(0.1)
            raise Exception("P1 Error")
        elif router._retries == 1:
            for _ in range(10):
                router.emit("greeting_0", "recovered_p1")
                time.sleep(0.1)
        else:
            raise Exception("Failed too many times")
        for _ in range(20):
            if greets:
                break
            time.sleep(0.1)
        assert len(greets) > 0

    @classmethod
    def main_p2(cls):
        router = Parallel()
        for _ in range(20):
            router.emit("greeting_1", "")
            time.sleep(0.1)

    @classmethod
    def main(cls):
        router = Parallel()
        if router.node_id == 0:
            cls.main_p0()
        elif router.node_id == 1:
            cls.main_p1()
        elif router.node_id == 2:
            cls.main_p2()
        else:
            raise Exception("Invalid node id")


def raises(fn, text):
    try:
        fn()
    except Exception as e:  # mpire re-raises the worker's exception in the parent
        assert text in str(e), f"expected {text!r} in {e!r}"
        return
    raise AssertionError(f"expected an exception with {text!r}")


def run(scenario, mq_type):
    if scenario == "run":
        Parallel.runner(n_parallel_workers=2, mq_type=mq_type, startup_interval=0.1)(parallel_main)
        Parallel.runner(n_parallel_workers=2, mq_type=mq_type, protocol="tcp", ports=[free_port(), free_port()],
                        startup_interval=0.1)(parallel_main)
    elif scenario == "uncaught_exception":
        raises(lambda: Parallel.runner(n_parallel_workers=2, mq_type=mq_type, topology="mesh",
                                       startup_interval=0.1)(uncaught_exception_main), "uncaught exception")
    elif scenario == "disconnected":
        Parallel.runner(n_parallel_workers=2, mq_type=mq_type, topology="mesh",
                        startup_interval=0.1)(disconnected_main)
    elif scenario == "auto_recover":
        Parallel.runner(n_parallel_workers=3, mq_type=mq_type, topology="mesh", auto_recover=True,
                        max_retries=1, startup_interval=0.1)(AutoRecover.main)
        raises(lambda: Parallel.runner(n_parallel_workers=3, mq_type=mq_type, topology="mesh",
                                       auto_recover=True, max_retries=0, startup_interval=0.1)(AutoRecover.main),
               "P1 Error")
    elif scenario == "late_start":  # not DI-engine's: its second worker starts 2.5 s late (late_start.py)
        import tempfile

        from tests.ding_jobs.late_start import late_main

        with tempfile.TemporaryDirectory() as marker_dir:
            os.environ["MQ_TEST_LATE_START"] = marker_dir  # the spawned workers inherit it
            Parallel.runner(n_parallel_workers=2, mq_type=mq_type, startup_interval=0.1)(late_main)
    elif scenario in DISTRIBUTER:
        # DI-engine's own ding/framework/middleware/tests/test_distributer.py mains, unchanged
        from ding.framework.middleware.tests import test_distributer

        main = getattr(test_distributer, f"{scenario}_main")
        Parallel.runner(n_parallel_workers=2, mq_type=mq_type, startup_interval=0.1)(main)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


DISTRIBUTER = ("context_exchanger", "context_exchanger_with_storage_loader")


if __name__ == "__main__":
    t = time.monotonic()
    run(sys.argv[1], sys.argv[2])
    print(f"OK {sys.argv[1]} {sys.argv[2]} {time.monotonic() - t:.1f}s", flush=True)
