"""Runnable examples built on mq (``python -m examples.<name>``)."""
