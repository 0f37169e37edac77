#!/bin/bash
root=$1; out=$2; shift 2
cd "$root" && BENCH_ROOT="$root" /work/main/.venv/bin/python /tmp/benchmain.py "$@" > "$out" 2> "$out.err"
