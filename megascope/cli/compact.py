"""``megascope compact RUN``: merge a run's part files into a few large sorted files."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import echo_json, json_option, run_dir_argument


@click.command()
@run_dir_argument
@click.option("--all", "everything", is_flag=True,
              help="The job has ended: merge every part, each rank's newest and ranks/groups too, whatever its age.")
@click.option("--min-age", "min_age_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Merge only parts older than this (default 60; 0 with --all).")
@click.option("--keep-newest", type=click.IntRange(min=0), default=None, metavar="N",
              help="Leave each rank's N newest parts (default 2; 0 with --all).")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Remove replaced parts once their compaction is this old, so that readers of a live run "
                   "refresh first (default 60; 0 with --all).")
@json_option
def compact(run_dir: Path, everything: bool, min_age_s: float | None, keep_newest: int | None,
            grace_s: float | None, as_json: bool) -> None:
    """Merge RUN's part files into a few large files sorted by step and rank (spans: step, kind, rank).

    Safe while the job still writes (only parts older than --min-age, never a rank's newest), on a
    run being read (readers never see a half-compacted run), and if interrupted (run it again).
    """
    from megascope.compact import DEFAULT_GRACE_S, DEFAULT_KEEP_NEWEST, DEFAULT_MIN_AGE_S
    from megascope.compact import compact as run_compaction

    result = run_compaction(
        run_dir,
        everything=everything,
        min_age_s=min_age_s if min_age_s is not None else (0.0 if everything else DEFAULT_MIN_AGE_S),
        keep_newest=keep_newest if keep_newest is not None else (0 if everything else DEFAULT_KEEP_NEWEST),
        grace_s=grace_s if grace_s is not None else (0.0 if everything else DEFAULT_GRACE_S),
    )
    skipped = [line for t in result.tables.values() for line in t.skipped]
    for line in skipped:
        click.echo(f"warning: {line}", err=True)
    if as_json:
        echo_json({
            "run": str(run_dir),
            "parts_merged": result.parts_merged,
            "files_written": result.files_written,
            "rows": result.rows,
            "removed": result.removed,
            "seconds": round(result.seconds, 3),
            "tables": {t: {"parts_merged": r.parts_merged, "files_written": r.files_written, "rows": r.rows}
                       for t, r in result.tables.items()},
            "skipped": skipped,
        })
        return
    click.echo(f"{run_dir}: merged {result.parts_merged} parts ({result.rows} rows) into {result.files_written} "
               f"files in {result.seconds:.1f} s; removed {result.removed} files")


def register(group: click.Group) -> None:
    group.add_command(compact)
