"""``megascope synth``: a realistic synthetic run directory at any scale."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import inject_option, not_built, out_run_option


@click.command()
@click.option("--ranks", type=click.IntRange(min=1), required=True)
@click.option("--steps", type=click.IntRange(min=1), required=True)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@inject_option
@out_run_option
def synth(ranks: int, steps: int, tp: int, pp: int, seed: int, injects: tuple[str, ...], out: Path) -> None:
    """Write a synthetic run (dp = ranks / (tp*pp)) with optional planted faults."""
    not_built("synth")


def register(group: click.Group) -> None:
    group.add_command(synth)
