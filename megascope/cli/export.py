"""``megascope export``: Perfetto (protobuf) and Chrome JSON traces of a run."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import not_built, run_dir_argument


@click.group()
def export() -> None:
    """Write a run as a trace for Perfetto UI or chrome://tracing."""


@export.command()
@run_dir_argument
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False))
def perfetto(run_dir: Path, out: Path) -> None:
    """Perfetto protobuf trace: a process per rank, flows across ranks."""
    not_built("export perfetto")


@export.command()
@run_dir_argument
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False))
def chrome(run_dir: Path, out: Path) -> None:
    """Chrome trace-event JSON (for HTA and chrome://tracing)."""
    not_built("export chrome")


def register(group: click.Group) -> None:
    group.add_command(export)
