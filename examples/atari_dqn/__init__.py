"""Distributed DQN on mq: one learner, N collectors, an optional evaluator, on every mq type.

    python -m examples.atari_dqn --env CartPole-v1 --collectors 2 --mq-type nng
    mq run --main examples.atari_dqn.roles:main --labels learner ...

See README.md in this directory.
"""
