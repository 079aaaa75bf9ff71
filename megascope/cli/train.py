"""``megascope train``: the bundled 3D-parallel trainer."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import inject_option, not_built, out_run_option


@click.command()
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Spawn this many local ranks (else run under torchrun).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--dp", type=click.IntRange(min=1), default=None, help="Defaults to world size / (tp*pp).")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--global-batch", type=click.IntRange(min=1), default=16, show_default=True, help="Sequences per step.")
@inject_option
@out_run_option
def train(nproc: int | None, tp: int, pp: int, dp: int | None, steps: int, seed: int, global_batch: int,
          injects: tuple[str, ...], out: Path) -> None:
    """Train the bundled GPT on a TP x PP x DP mesh, fully instrumented."""
    not_built("train")


def register(group: click.Group) -> None:
    group.add_command(train)
