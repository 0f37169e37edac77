"""Installable package for mq. Pins that make CI fast live in constraints.txt, not here."""

from setuptools import setup

setup(
    name="mq",
    version="0.1.0",
    description="Point-to-point messaging for distributed reinforcement learning (NNG and torch RPC backends)",
    python_requires=">=3.10",
    # cli/ sits at the top of the repo but installs as mq.cli: no top-level `cli` in site-packages.
    packages=["mq", "mq.backends", "mq.tools", "mq.cli"],
    package_dir={"mq": "mq", "mq.cli": "cli"},
    install_requires=[
        "numpy>=1.24",
        "msgpack>=1.0",
        "pynng>=0.8",
        "click>=8.1",
        "rich>=13",
        "prometheus_client>=0.17",
        "torch>=2.2",
        "python-hostlist>=1.23",  # Slurm hostlist expansion (mq.platforms)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90"],
        "bench": ["matplotlib>=3.7", "pyzmq>=25"],
        "gpu": ["nvidia-ml-py>=12"],
        "atari": ["gymnasium>=1.0", "ale-py>=0.12"],
        "dev": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90", "matplotlib>=3.7", "pyzmq>=25", "ruff"],
    },
    entry_points={"console_scripts": ["mq=mq.cli.main:main"]},
)
