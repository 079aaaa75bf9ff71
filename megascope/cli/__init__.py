"""The ``megascope`` command line (click).

Commands are thin: parse, build a config, call one library function. Heavy imports (torch, duckdb,
pandas, dash) happen inside each command, so ``megascope --help`` stays fast. Each command group
lives in its own module and registers itself here.

Every :class:`~megascope.errors.MegascopeError` becomes one ``Error:`` line on stderr and exit
status 1; usage mistakes exit 2 (click's convention), also on one line. So do what the machine
refuses (``OSError``: a read-only or full disk), a missing optional dependency (named with the
extra that has it), damaged Parquet data met mid-query, and, as a last resort, a bug (``internal
error``, its traceback logged with ``-vv``): never a traceback on stderr (docs/promises.md).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from megascope import __version__
from megascope.errors import MegascopeError

log = logging.getLogger(__name__)

# What a command may import beyond the core install (torch, pyarrow, click), and the extra that has it.
EXTRA_OF_MODULE = {
    "duckdb": "analysis", "pandas": "analysis", "numpy": "analysis",
    "perfetto": "perfetto",
    "dash": "dashboard", "plotly": "dashboard", "flask": "dashboard", "werkzeug": "dashboard",
    "prometheus_client": "dashboard",
    "pynvml": "health",
}


class MegascopeGroup(click.Group):
    """A click group that turns library errors into one-line messages, never tracebacks."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            # click would print the usage and a hint on lines of their own: one line says it all.
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            click.echo(f"Error: {one_line(exc.format_message())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("Error: aborted", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MegascopeError as exc:
            raise click.ClickException(one_line(str(exc))) from None
        except KeyboardInterrupt:
            click.echo("Error: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)
        except OSError as exc:
            # The machine said no (read-only or full filesystem, permissions, a busy mount point):
            # something the user can act on, named with its path.
            where = f"{exc.filename}: " if exc.filename else ""
            raise click.ClickException(one_line(f"{where}{exc.strerror or exc}")) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            extra = EXTRA_OF_MODULE.get(top)
            if extra is None:
                raise click.ClickException(one_line(f"internal error: {exc} (a bug in megascope)")) from None
            command = " ".join(filter(None, [ctx.command_path, ctx.invoked_subcommand]))
            raise click.ClickException(
                f"'{command}' needs {top}, which is not installed: pip install 'megascope[{extra}]'") from None
        except Exception as exc:
            if _is_damaged_data(exc):
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise click.ClickException(f"cannot read the run's data: {reason} (a damaged part?)") from None
            # A bug, but the user still gets one line; -vv logs the traceback for the report.
            log.debug("unexpected error", exc_info=True)
            raise click.ClickException(one_line(
                f"internal error: {type(exc).__name__}: {exc} (a bug in megascope; -vv shows where)")) from None


# What DuckDB and Arrow raise on bytes that are not what their footers promise (as opposed to a
# mistake in a query, which stays an internal error). By name: the CLI does not import them.
_DATA_ERRORS = {
    ("duckdb", "Error"), ("duckdb", "IOException"), ("duckdb", "InvalidInputException"),
    ("duckdb", "SerializationException"), ("duckdb", "ConversionException"), ("duckdb", "OutOfRangeException"),
    ("pyarrow", "ArrowInvalid"), ("pyarrow", "ArrowIOError"), ("pyarrow", "ArrowSerializationError"),
}


def _is_damaged_data(exc: Exception) -> bool:
    library = type(exc).__module__.lstrip("_").split(".")[0]
    return (library, type(exc).__name__) in _DATA_ERRORS


def one_line(message: str) -> str:
    """``message`` on one line, so that an error is always one line on stderr."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines) if lines else "unknown error"


@click.group(cls=MegascopeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megascope")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """megascope: find what slows or stops a distributed (TP/PP/DP) training job."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _register() -> None:
    from megascope.cli import analyze, compact, diagnose, export, ingest, serve, synth, train, watch

    for module in (train, synth, ingest, analyze, watch, export, serve, diagnose, compact):
        module.register(main)


_register()
