"""``megascope ingest``: foreign traces (Kineto JSON, NCCL flight-recorder dumps) into run directories."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import not_built, out_run_option


@click.group()
def ingest() -> None:
    """Turn traces you already have into megascope runs."""


@ingest.command()
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@out_run_option
def kineto(src: Path, out: Path) -> None:
    """torch.profiler (Kineto) JSON traces, one file per rank (.json or .json.gz)."""
    not_built("ingest kineto")


@ingest.command("flight-recorder")
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@out_run_option
def flight_recorder(src: Path, out: Path) -> None:
    """NCCL flight-recorder dumps (one pickled file per rank)."""
    not_built("ingest flight-recorder")


def register(group: click.Group) -> None:
    group.add_command(ingest)
