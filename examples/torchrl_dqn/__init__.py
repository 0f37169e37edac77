"""DQN on CartPole with TorchRL, its collectors and learner as mq roles (see README.md)."""
