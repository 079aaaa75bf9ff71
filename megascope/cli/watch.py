"""``megascope watch``: a live job in the terminal, a line per step, from the ranks' step logs.

Thin: a :class:`megascope.live.StepSumsTail` looks at the run every ``--interval`` seconds and
:func:`megascope.live.step_lines` says, per step every rank has ended, its time, MFU, the rank
whose compute is furthest above its pipeline stage's median (all ranks' on a pure pipeline, whose
stages have one rank each) and the rank that spent the least in communication (the one the others
wait for when it pauses outside its work). What an on-call
engineer with only a shell wants from a job of any size: one read per rank a look, nothing that
grows with the run. A run without step logs is followed through its step sums twins. ``--once``
prints the steps there are and exits; ``--json`` prints a JSON object per step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from megascope.cli.common import echo_json, echo_problems, json_option, run_dir_argument

# Steps printed at start (the newest); the follower keeps this many.
SHOWN_AT_START = 20


def _missing(value: Any) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def _place(places: Any, rank: Any) -> str:
    from megascope.topology import format_coords

    if _missing(rank):
        return "-"
    row = places[places["rank"] == int(rank)]
    if row.empty:
        return f"rank {int(rank)}"
    where = format_coords(row.iloc[0]["coords"]) if isinstance(row.iloc[0]["coords"], dict) else ""
    return " ".join(filter(None, [f"rank {int(rank)}", str(row.iloc[0]["host"] or ""), where]))


def _line(row: dict[str, Any], places: Any) -> str:
    mfu = "    - " if _missing(row["mfu"]) else f"{row['mfu'] * 100:5.1f}%"
    slow = "-" if _missing(row["slow_x"]) else f"{_place(places, row['slow_rank'])} {row['slow_x']:.2f}x"
    quiet = "-" if _missing(row["quiet_x"]) else f"{_place(places, row['quiet_rank'])} {row['quiet_x']:.2f}x"
    return f"{row['step']:>7}  {row['step_time_ns'] / 1e6:>9.1f} ms  {mfu}  {slow:<40}  {quiet}"


@click.command()
@run_dir_argument
@json_option
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.2),
              help="Seconds between looks.")
@click.option("--once", is_flag=True, help="Print the steps there are and exit.")
def watch(run_dir: Path, as_json: bool, interval: float, once: bool) -> None:
    """Follow a live job: a line per step (time, MFU, slowest compute, least communication)."""
    from megascope.live import StepSumsTail, lone_stages, step_lines
    from megascope.store import open_run
    from megascope.topology import ranks_text

    tail = StepSumsTail(run_dir, window_steps=SHOWN_AT_START, backfill=SHOWN_AT_START)
    run = open_run(run_dir, tables=("ranks",))
    echo_problems(run.problems)
    places = run.con.execute("SELECT rank, host, coords FROM ranks ORDER BY rank").df()
    run.con.close()
    meta = tail.meta
    # A pure pipeline's ranks have no stage peer: each step's ranks are held to the median of all
    # of them, and the stages do different work (the header says so).
    against = "all ranks" if lone_stages(places) else "its stage"

    if not as_json:
        mesh = " x ".join(f"{a}{meta.mesh_sizes[a]}" for a in meta.mesh_axes if a in meta.mesh_sizes)
        click.echo(f"{run_dir}: {ranks_text(meta.world_size)}{', ' + mesh if mesh else ''}" + ("" if once else
                   f"; a look every {interval:g} s, Ctrl-C to stop"), err=True)
    last: int | None = None
    header = False
    shown: set[str] = set()
    quiet_since = time.monotonic()
    warned_idle = False
    try:
        while True:
            update = tail.update()
            echo_problems([p for p in tail.problems if p not in shown])
            shown.update(tail.problems)
            lines = step_lines(tail, places, after=last)
            if not lines.empty:
                if as_json:
                    for row in lines.to_dict("records"):
                        echo_json({k: None if _missing(v) else v for k, v in row.items()})
                else:
                    if not header:
                        click.echo(f"{'step':>7}  {'step time':>12}  {'MFU':>6}  "
                                   f"{f'slowest compute (x {against})':<40}  least communication (x {against})")
                        header = True
                    for row in lines.to_dict("records"):
                        click.echo(_line(row, places))
                last = int(lines["step"].max())
                quiet_since, warned_idle = time.monotonic(), False
            if once:
                if last is None and not as_json:
                    click.echo("no step every rank has ended yet" + (f" ({update.files_read} logs read)"
                                                                     if update.files_read else ""))
                return
            idle = time.monotonic() - quiet_since
            if not as_json and not warned_idle and idle >= max(30.0, 5 * interval):
                click.echo(f"... no new step for {idle:.0f} s (last {last if last is not None else 'none'}); "
                           "'megascope localize' tells where a hang is", err=True)
                warned_idle = True
            time.sleep(interval)
    finally:
        tail.close()


def register(group: click.Group) -> None:
    group.add_command(watch)
