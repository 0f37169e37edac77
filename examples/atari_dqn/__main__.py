"""One command, one machine: ``python -m examples.atari_dqn --env CartPole-v1 --collectors 2``.

Starts 1 learner + N collectors (+ an evaluator with ``--evaluator``) with ``mq.launch``, one
process each, and prints the learner's final report as the LAST line of output: one JSON object.
Exit code: 0 if the run was sound (every collector's transitions all received, updates made,
finite loss, every collector acted with trained weights), 1 if not, 2 for a bad setup.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import mq
from mq.registry import backend_class, check_mq_type
from examples.atari_dqn import config
from examples.atari_dqn.envs import SetupError, check_env
from examples.atari_dqn.roles import check_roles


def roles_of(args: config.Args) -> list[str]:
    if args.roles:
        return [r.strip() for r in args.roles.split(",") if r.strip()]
    return ["learner"] + ["collector"] * args.collectors + (["evaluator"] if args.evaluator else [])


def preflight(args: config.Args, roles: list[str]) -> None:
    """Every bad setup we can see before starting processes -> SetupError / ConfigError."""
    check_roles(roles)
    mq_type = check_mq_type(args.mq_type)
    try:
        backend_class(mq_type)
    except ImportError as exc:
        raise SetupError(f"mq type {mq_type!r} is not available here: {exc}") from None
    check_env(args.env)


def main(argv: list[str] | None = None) -> int:
    args = config.parse(argv)
    roles = roles_of(args)
    try:
        preflight(args, roles)
    except (SetupError, mq.ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Collectors step environments next to the learner: no core spent spinning in TensorPipe.
    torchrpc = {"busy_poll": False} if args.mq_type.startswith("torchrpc") else {}
    with tempfile.TemporaryDirectory(prefix="atari_dqn-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        try:
            mq.launch("examples.atari_dqn.roles:main", n_workers=len(roles), mq_type=args.mq_type,
                      labels=roles, args={"config": config.to_dict(args), "report": report_path},
                      **torchrpc)
        except mq.LaunchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        if not os.path.exists(report_path):
            print("error: the learner ended without a report", file=sys.stderr)
            return 1
        if args.report:
            shutil.copyfile(report_path, args.report)
        with open(report_path) as f:
            report = json.load(f)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
