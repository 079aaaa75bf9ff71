"""The ``megascope`` command line (click).

Commands are thin: parse, build a config, call one library function. Heavy imports (torch, duckdb,
pandas, dash) happen inside each command, so ``megascope --help`` stays fast. Each command group
lives in its own module and registers itself here.

Every :class:`~megascope.errors.MegascopeError` becomes one line on stderr and exit status 1;
usage mistakes exit 2 (click's convention).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from megascope import __version__
from megascope.errors import MegascopeError


class MegascopeGroup(click.Group):
    """A click group that turns library errors into one-line messages, never tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MegascopeError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)


@click.group(cls=MegascopeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megascope")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """megascope: find what slows or stops a distributed (TP/PP/DP) training job."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _register() -> None:
    from megascope.cli import analyze, diagnose, export, ingest, serve, synth, train

    for module in (train, synth, ingest, analyze, export, serve, diagnose):
        module.register(main)


_register()
