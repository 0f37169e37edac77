"""Installable package for mq. Pins that make CI fast live in constraints.txt, not here."""

import pathlib
import re

from setuptools import find_packages, setup

# One version source: mq/__init__.py's __version__ (read, not imported: no dependency at build time).
VERSION = re.search(r'^__version__ = "([^"]+)"', (pathlib.Path(__file__).parent / "mq" / "__init__.py").read_text(),
                    re.M).group(1)

# The coverage-guided fuzzer (scripts/fuzz). Its wheels exist for CPython <= 3.11 on x86-64 Linux
# only; elsewhere pip would try to build it with clang's libFuzzer, so it is left out there and
# scripts/fuzz falls back to a bounded hypothesis run (and says so).
ATHERIS = 'atheris>=2.3; python_version < "3.12" and sys_platform == "linux" and platform_machine == "x86_64"'

setup(
    name="mq",
    version=VERSION,
    description="Point-to-point messaging for distributed reinforcement learning (NNG and torch RPC backends)",
    python_requires=">=3.10",
    # cli/ sits at the top of the repo but installs as mq.cli: no top-level `cli` in site-packages.
    # Every package under mq/ (found, not listed: a new one can never be left out of the wheel).
    packages=[*find_packages(include=["mq", "mq.*"]), "mq.cli"],
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
        "msgspec>=0.18",  # the handshake schemas (mq.handshake)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90", ATHERIS],
        "bench": ["matplotlib>=3.7", "pyzmq>=25"],
        "gpu": ["nvidia-ml-py>=12"],
        # The rdma data path's engine (mq/rdma.py): NIXL with its UCX backend; the CUDA 13 build
        # also runs on CPU-only hosts (UCX's tcp transport).
        "rdma": ["nixl-cu13>=1.5"],
        "atari": ["gymnasium>=1.0", "ale-py>=0.12"],
        # mq.integrations.torchrl (TorchRL's weight-sync backend "mq"), TensorDict payloads, and
        # examples/torchrl_ppo (CartPole through TorchRL's GymEnv).
        "torchrl": ["torchrl>=0.14", "tensordict>=0.14", "gymnasium>=1.0"],
        # mq on Ray (mq.integrations.ray: init_method="ray://GROUP"; mq run --platform ray).
        "ray": ["ray>=2.60"],
        # The docs site (mkdocs.yml, docs/): tests/test_docs.py builds it with --strict.
        "docs": ["mkdocs-material>=9.5", "mkdocstrings[python]>=1.0"],
        "dev": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90", ATHERIS, "matplotlib>=3.7", "pyzmq>=25",
                "mkdocs-material>=9.5", "mkdocstrings[python]>=1.0", "ruff"],
    },
    entry_points={"console_scripts": ["mq=mq.cli.main:main"]},
)
