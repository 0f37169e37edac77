"""Plot return vs env steps from one or more --log-dir runs.

    python -m examples.atari_dqn.plot runs/cartpole-s1 runs/cartpole-s2 --out cartpole.png --title "..."

Training episodes (epsilon-greedy, as the collectors played them): a dot each and the mean of
the last 10 as a line; greedy evaluations (--evaluator) as crosses.
"""

from __future__ import annotations

import argparse
import csv
import os

import numpy as np


def read_csv(path: str) -> dict[str, np.ndarray]:
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {}
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.atari_dqn.plot", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="--log-dir directories")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    p.add_argument("--window", type=int, default=10, help="episodes in the rolling mean")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
    a = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = a.labels.split(",") if a.labels else [os.path.basename(os.path.normpath(r)) for r in a.runs]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, (run, label) in enumerate(zip(a.runs, labels)):
        color = f"C{i}"
        ep = read_csv(os.path.join(run, "episodes.csv"))
        if ep:
            x, y = ep["env_steps"], ep["return"]
            ax.scatter(x, y, s=4, alpha=0.3, color=color, linewidths=0)
            w = min(a.window, len(y))
            mean = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(x[w - 1:], mean, color=color, lw=1.6, label=f"{label}: training, mean of last {w} episodes")
        ev = read_csv(os.path.join(run, "evals.csv"))
        if ev:
            ax.scatter(ev["env_steps"], ev["return"], marker="x", s=28, color=color, lw=1.2,
                       label=f"{label}: greedy evaluation episode")
    ax.set_xlabel("env steps (all collectors)")
    ax.set_ylabel("episode return")
    ax.set_title(a.title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
