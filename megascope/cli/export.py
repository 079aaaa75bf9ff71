"""``megascope export``: Perfetto (protobuf) and Chrome JSON traces of a run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from megascope.cli.common import echo_json, echo_problems, json_option, run_dir_argument


def _selection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--ranks", metavar="LIST", help="Ranks to keep, e.g. 0-7,12."),
        click.option("--steps", metavar="RANGE", help="Steps to keep, inclusive, e.g. 10-20 or 15."),
        click.option("--window", metavar="START:END",
                     help="Seconds since the run's first span; keeps spans that overlap, e.g. 12.5:14."),
        click.option("--around-stragglers", is_flag=True,
                     help="Keep only the stragglers and the peers they make wait."),
        click.option("--clock", type=click.Choice(["estimated", "raw"]), default="estimated", show_default=True,
                     help="estimated: add each host's clock offset, estimated from the collectives "
                          "(an estimate that fails is an error); raw: host clocks as recorded."),
        json_option,
    ]
    for option in reversed(options):
        func = option(func)
    return func


force_option = click.option("--force", is_flag=True,
                            help="Replace OUT if it exists (never a file inside a run directory).")


def _run_export(kind: str, run_dir: Path, out: Path, ranks: str | None, steps: str | None, window: str | None,
                around_stragglers: bool, clock: str, as_json: bool, force: bool, **extra: Any) -> None:
    from megascope import layout
    from megascope.export import export_chrome, export_perfetto
    from megascope.export.selection import parse_ranks, parse_steps, parse_window, window_from_seconds
    from megascope.store import open_run

    # Where the export goes is checked first: never into a run, never over a file without --force.
    if extra.get("split_ranks"):
        layout.check_output_dir(out, replace=force)
    else:
        layout.check_output_file(out, replace=force)
    # parse every option before any work, so a typo costs nothing
    rank_list = parse_ranks(ranks) if ranks else None
    step_range = parse_steps(steps) if steps else None
    seconds = parse_window(window) if window else None
    run = open_run(run_dir)
    echo_problems(run.problems)
    window_ns = window_from_seconds(run, *seconds) if seconds else None
    export = export_perfetto if kind == "perfetto" else export_chrome
    stats = export(run, out, ranks=rank_list, steps=step_range, window=window_ns,
                   around_stragglers=around_stragglers, clock=clock, **extra)
    if as_json:
        echo_json({"out": str(out), **stats.to_json()})
    else:
        click.echo(f"wrote {out}: {stats.spans:,} spans of {stats.ranks:,} ranks, {stats.flows:,} flow links, "
                   f"{stats.bytes / 1e6:,.1f} MB in {stats.seconds:.1f}s; clocks: {stats.clock_correction}", err=True)


@click.group()
def export() -> None:
    """Write a run as a trace for Perfetto UI or chrome://tracing."""


@export.command()
@run_dir_argument
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Trace file to write (.pftrace).")
@_selection_options
@force_option
def perfetto(run_dir: Path, out: Path, ranks: str | None, steps: str | None, window: str | None,
             around_stragglers: bool, clock: str, as_json: bool, force: bool) -> None:
    """Perfetto protobuf trace: a process per rank, flows across ranks, corrected clocks."""
    _run_export("perfetto", run_dir, out, ranks, steps, window, around_stragglers, clock, as_json, force)


@export.command()
@run_dir_argument
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path),
              help="JSON file to write (a directory with --split-ranks).")
@click.option("--split-ranks", is_flag=True, help="One rank-NNNNN.json per rank in OUT (the layout HTA loads).")
@_selection_options
@force_option
def chrome(run_dir: Path, out: Path, ranks: str | None, steps: str | None, window: str | None,
           around_stragglers: bool, clock: str, as_json: bool, split_ranks: bool, force: bool) -> None:
    """Chrome trace-event JSON (for HTA and chrome://tracing)."""
    _run_export("chrome", run_dir, out, ranks, steps, window, around_stragglers, clock, as_json, force,
                split_ranks=split_ranks)


def register(group: click.Group) -> None:
    group.add_command(export)
