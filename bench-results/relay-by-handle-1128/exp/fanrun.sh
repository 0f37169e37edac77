#!/bin/bash
# usage: fanrun.sh ROOT OUTFILE  -- mq bench --mode fanout --subscribers 8 --hosts 4 --sizes 100MB, the mq of ROOT
root=$1; out=$2
cd "$root" || exit 1
/work/main/.venv/bin/python - > "$out" 2> "$out.err" <<PY
import sys, datetime
sys.path.insert(0, "$root")
import mq
assert mq.__file__.startswith("$root"), mq.__file__
print(f"# cwd $root, mq from {mq.__file__}, {datetime.datetime.utcnow():%Y-%m-%dT%H:%M:%SZ}", flush=True)
print("# mq bench --mode fanout --subscribers 8 --hosts 4 --sizes 100MB", flush=True)
from mq.cli.main import main
sys.argv = ["mq", "bench", "--mode", "fanout", "--subscribers", "8", "--hosts", "4", "--sizes", "100MB"]
try:
    main()
except SystemExit as e:
    print("# exit", e.code)
PY
