"""``megascope serve`` and ``megascope demo``: the Dash dashboard."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import not_built


@click.command()
@click.argument("run_dirs", metavar="[RUN]...", nargs=-1, type=click.Path(path_type=Path, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8050, show_default=True)
@click.option("--token", default=None, help="Required when --host is not loopback.")
def serve(run_dirs: tuple[Path, ...], host: str, port: int, token: str | None) -> None:
    """Serve the dashboard for RUN directories (the bundled samples when none is given)."""
    not_built("serve")


@click.command()
def demo() -> None:
    """Train on CPU with a planted straggler while the dashboard shows it live."""
    not_built("demo")


def register(group: click.Group) -> None:
    group.add_command(serve)
    group.add_command(demo)
