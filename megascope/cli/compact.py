"""``megascope compact RUN``: merge a run's part files into a few large sorted files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

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
@click.option("--ranks", "ranks", default=None, metavar="LOW-HIGH",
              help="Only these ranks' parts (a node's sidecar: its own ranks). Passes over disjoint ranks "
                   "run at once; ranks/groups/diagnostics are left to an unscoped pass.")
@click.option("--host", default=None, metavar="NAME",
              help="Only this host's heartbeat parts (with --ranks: both).")
@click.option("--every", "every_s", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="Repeat the pass this often until interrupted (a pass another holds is skipped, said once).")
@click.option("--while-pid", "while_pid", type=click.IntRange(min=1), default=None, metavar="PID",
              help="With --every: stop once process PID has ended (the job's, say).")
@click.option("--analyze/--no-analyze", "analyze", default=None,
              help="Then build what `megascope report` and the dashboard read (base tables, straggler scores, "
                   "the what-if replay) and keep it beside the run, so that the first report reads it "
                   "(default: with --all).")
@json_option
def compact(run_dir: Path, everything: bool, min_age_s: float | None, keep_newest: int | None,
            grace_s: float | None, ranks: str | None, host: str | None, every_s: float | None,
            while_pid: int | None, analyze: bool | None, as_json: bool) -> None:
    """Merge RUN's part files into a few large files sorted by step and rank (spans: step, kind, rank).

    Safe while the job still writes (only parts older than --min-age, never a rank's newest), on a
    run being read (readers never see a half-compacted run), and if interrupted (run it again).
    On a job of many nodes, run one per node with --ranks (and --host) and --every: each node then
    merges its own ranks' parts, and the work does not grow with the job.
    """
    from megascope.compact import DEFAULT_GRACE_S, DEFAULT_KEEP_NEWEST, DEFAULT_MIN_AGE_S, Scope

    if every_s is not None and everything:
        raise click.UsageError("--every repeats a live pass; --all is the last pass of an ended job")
    if while_pid is not None and every_s is None:
        raise click.UsageError("--while-pid goes with --every")
    if analyze and (every_s is not None or ranks is not None or host is not None):
        raise click.UsageError("--analyze goes with a pass over the whole run, not --every, --ranks or --host")
    scope = Scope(ranks=_rank_range(ranks), host=host) if ranks is not None or host is not None else None
    kwargs = {
        "everything": everything,
        "min_age_s": min_age_s if min_age_s is not None else (0.0 if everything else DEFAULT_MIN_AGE_S),
        "keep_newest": keep_newest if keep_newest is not None else (0 if everything else DEFAULT_KEEP_NEWEST),
        "grace_s": grace_s if grace_s is not None else (0.0 if everything else DEFAULT_GRACE_S),
        "scope": scope,
    }
    if every_s is None:
        _one_pass(run_dir, kwargs, as_json, analyze=everything if analyze is None else analyze)
        return
    _repeat(run_dir, kwargs, as_json, every_s, while_pid)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _rank_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    lo, sep, hi = text.strip().partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a rank or a range of ranks (e.g. 8-15)",
                                 param_hint="--ranks") from None
    return first, last


def _repeat(run_dir: Path, kwargs: dict[str, Any], as_json: bool, every_s: float, while_pid: int | None) -> None:
    """A pass every ``every_s`` seconds until interrupted (SIGINT or SIGTERM: a pass under way is
    cut short, which leaves the run as readable as ever; the next pass finishes it) or until
    process ``while_pid`` has ended."""
    import signal

    from megascope.compact import CompactionBusy

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    said: set[str] = set()
    try:
        while True:
            started = time.monotonic()
            try:
                _one_pass(run_dir, kwargs, as_json, quiet=True, said=said)
            except CompactionBusy as exc:
                if str(exc) not in said:  # a pass of another process holds it: try again next time
                    said.add(str(exc))
                    click.echo(f"warning: {exc}; trying again every {every_s:g} s", err=True)
            while _alive(while_pid) and time.monotonic() - started < every_s:
                time.sleep(min(1.0, max(0.0, every_s - (time.monotonic() - started))))
            if not _alive(while_pid):
                return
    except KeyboardInterrupt:
        return


def keep_analysis(run_dir: Path) -> float:
    """Run the report's analyses on ``run_dir`` so that what they build is kept in its analysis
    cache (``RUN/_cache``, megascope.analysis.persist) for the first report and the dashboard;
    returns the seconds it took. Raises what opening or analysing the run raises."""
    from megascope.analysis import report as build_report
    from megascope.cli.analyze import MEMORY_LIMIT
    from megascope.store import open_run

    started = time.monotonic()
    run = open_run(run_dir, memory_limit=MEMORY_LIMIT)
    try:
        build_report(run)
    finally:
        run.con.close()
    return time.monotonic() - started


def _analysis_note(run_dir: Path) -> tuple[float | None, str | None]:
    """:func:`keep_analysis`, or why it could not be done: a warning, never a failure, since the
    compaction it follows stands and the first report builds the same tables."""
    try:
        return keep_analysis(run_dir), None
    except Exception as exc:  # noqa: BLE001 - optional work after a finished compaction
        return None, f"{run_dir}: analysis tables not kept ({type(exc).__name__}: {exc}); the first report builds them"


def _one_pass(run_dir: Path, kwargs: dict[str, Any], as_json: bool, *, quiet: bool = False,
              said: set[str] | None = None, analyze: bool = False) -> None:
    """One pass, and what it did (``quiet``: nothing said of a pass that did nothing; ``said``: the
    warnings already given by earlier passes, not repeated; ``analyze``: then :func:`keep_analysis`)."""
    from megascope.compact import compact as run_compaction

    result = run_compaction(run_dir, **kwargs)
    analysis_s, problem = _analysis_note(run_dir) if analyze else (None, None)
    if problem is not None:
        click.echo(f"warning: {problem}", err=True)
    skipped = [line for t in result.tables.values() for line in t.skipped]
    for line in skipped:
        if said is None or line not in said:
            click.echo(f"warning: {line}", err=True)
            if said is not None:
                said.add(line)
    if quiet and not (result.parts_merged or result.removed):
        return
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
            "analysis_s": round(analysis_s, 3) if analysis_s is not None else None,
        })
        return
    scope = kwargs.get("scope")
    where = f"{run_dir} ({scope})" if scope is not None else f"{run_dir}"
    click.echo(f"{where}: merged {result.parts_merged} parts ({result.rows} rows) into {result.files_written} "
               f"files in {result.seconds:.1f} s; removed {result.removed} files")
    if analysis_s is not None:
        click.echo(f"{run_dir}: analysis tables kept beside the run in {analysis_s:.1f} s (the first report reads them)")


def register(group: click.Group) -> None:
    group.add_command(compact)
