"""One machine, one command: ``python -m examples.torchrl_dqn --collectors 2 --mq-type nng``.

Starts 1 learner + N collectors with ``mq.launch`` (one process each) and prints the learner's
report as the last line: one JSON object. Exit code 0 when the target return was reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import mq
from examples.torchrl_dqn.roles import DEFAULTS


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.torchrl_dqn", description=__doc__.splitlines()[0])
    p.add_argument("--collectors", type=int, default=2)
    p.add_argument("--mq-type", default="nng", help="nng, torchrpc:cpu, ...")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = {k: getattr(args, k) for k in DEFAULTS}
    roles = ["learner"] + ["collector"] * args.collectors
    # Collectors step environments next to the learner: no core spent spinning (torch RPC's shm).
    options = {"busy_poll": False} if args.mq_type.startswith("torchrpc") else {}
    with tempfile.TemporaryDirectory(prefix="torchrl_dqn-") as tmp:
        config["report"] = os.path.join(tmp, "report.json")
        try:
            mq.launch("examples.torchrl_dqn.roles:main", n_workers=len(roles), mq_type=args.mq_type, labels=roles,
                      args={"config": config}, **options)
        except mq.LaunchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if not os.path.exists(config["report"]):
            print("error: the learner ended without a report", file=sys.stderr)
            return 1
        with open(config["report"]) as f:
            report = json.load(f)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
