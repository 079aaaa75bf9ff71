"""``megascope report``, ``localize``, ``heatmap``: post-mortem on a run directory."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import json_option, not_built, run_dir_argument


@click.command()
@run_dir_argument
@json_option
def report(run_dir: Path, as_json: bool) -> None:
    """Stragglers with causes, skew, MFU and its drift, hang state."""
    not_built("report")


@click.command()
@run_dir_argument
@json_option
def localize(run_dir: Path, as_json: bool) -> None:
    """Where is the hang: the rank, host and TP/PP/DP coordinates behind it."""
    not_built("localize")


@click.command()
@run_dir_argument
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="HTML file to write (.png where a browser is installed).")
def heatmap(run_dir: Path, out: Path) -> None:
    """Rank x step heat-map of each phase, normalized within peers."""
    not_built("heatmap")


def register(group: click.Group) -> None:
    for command in (report, localize, heatmap):
        group.add_command(command)
