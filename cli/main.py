"""The `mq` command group. Commands stay thin: they parse options and call library code."""

from __future__ import annotations

import importlib

import click

# command name -> module under mq.cli holding a click command of that name
_COMMANDS = {"run": "run", "bench": "bench", "doctor": "doctor"}


class _LazyGroup(click.Group):
    """Imports a command's module only when it is used, so `mq --help` stays fast."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module = importlib.import_module(f"mq.cli.{_COMMANDS[name]}")
        return getattr(module, name)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="mq")
def cli() -> None:
    """mq: point-to-point messaging for distributed RL (NNG and torch RPC backends)."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
