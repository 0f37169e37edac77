"""Run `mq bench ARGS` with the mq of ROOT: python /tmp/benchmain.py ROOT ARGS... (cwd ROOT)."""
import datetime
import sys

import os
root = os.environ["BENCH_ROOT"]
sys.path.insert(0, root)
import mq  # noqa: E402

assert mq.__file__.startswith(root), mq.__file__
if __name__ == "__main__":
    print(f"# cwd {root}, mq from {mq.__file__}, {datetime.datetime.utcnow():%Y-%m-%dT%H:%M:%SZ}", flush=True)
    print("# mq bench " + " ".join(sys.argv[1:]), flush=True)
    from mq.cli.main import main
    sys.argv = ["mq", "bench", *sys.argv[1:]]
    try:
        main()
    except SystemExit as e:
        print("# exit", e.code)
