"""``megascope diagnose``: self-tests that find the bad GPU or link."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import not_built, out_run_option


@click.command()
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Spawn this many local ranks (else run under torchrun or alone).")
@out_run_option
def diagnose(nproc: int | None, out: Path) -> None:
    """GEMM, memory bandwidth, device copies and all-reduce per group; outliers named."""
    not_built("diagnose")


def register(group: click.Group) -> None:
    group.add_command(diagnose)
