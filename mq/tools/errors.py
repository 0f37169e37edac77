"""Errors of the tools (``mq bench``, the namespace hosts, the soak): outside the library's
:class:`~mq.errors.MQError` tree, which is what a user of the message queue handles."""

from __future__ import annotations

__all__ = ["ToolError"]


class ToolError(Exception):
    """A tool cannot do what it was asked here (the message says why and what to do)."""
