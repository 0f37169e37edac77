"""The `mq` command group. Commands stay thin: they parse options and call library code."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

# command name -> module under mq.cli holding a click command of that name
_COMMANDS = {"run": "run", "bench": "bench", "doctor": "doctor", "top": "top"}


class _LazyGroup(click.Group):
    """Imports a command's module only when it is used, so `mq --help` stays fast."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module = importlib.import_module(f"mq.cli.{_COMMANDS[name]}")
        return getattr(module, name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Bad input exits 2 with one line saying what was wrong (no usage dump)."""
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("mq: aborted", err=True)
            sys.exit(130)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            prefix = f"mq {ctx.info_name}" if ctx is not None and ctx.parent is not None else "mq"
            click.echo(f"{prefix}: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="mq")
def cli() -> None:
    """mq: point-to-point messaging for distributed RL (NNG and torch RPC backends)."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
