"""Do the ranks' clocks agree? Two checks on a run's own spans, printed as a table per run.

* **TP call ends**: the members of a TP group end each of its calls together (the last transfer
  ends them all), so per pair of ranks the median difference of their completion times of the
  same TP calls is their clocks' disagreement. Ranks on one host share a host clock, but
  device-timed ranks each map their device's events to it through their own anchors: an anchor
  off by a few milliseconds shows here. (DP calls do not count: launched asynchronously, each
  rank's span of one ends when that rank waits for it.)
* **lead**: a device-timed call cannot start before its host enqueued it, so per rank the
  smallest (call start - enqueue marker) is near zero wherever the device waited for its host even
  once; a rank whose smallest lead is milliseconds while its peers' are zero reads late.

    python bench/clock_agreement.py RUN [RUN ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb

from megascope.errors import RunDirError
from megascope.store import open_run


def agreement(path: Path) -> tuple[float | None, list[tuple[int, float | None]]]:
    """(worst pair's median TP call end difference in ms, [(rank, smallest lead in ms)])."""
    con = open_run(path).con
    pairs = con.execute("""
        SELECT a.rank, b.rank, median((a.start_ns + a.dur_ns) - (b.start_ns + b.dur_ns)) / 1e6 AS d
        FROM spans a JOIN spans b ON a."group" = b."group" AND a.seq = b.seq AND a.rank < b.rank
        WHERE a.kind = 'collective' AND b.kind = 'collective'
          AND a."group" IN (SELECT "group" FROM groups WHERE kind = 'tp')
        GROUP BY 1, 2""").fetchall()
    worst = max((abs(d) for _, _, d in pairs if d is not None), default=None)
    leads = con.execute("""
        SELECT s.rank, min(s.start_ns - m.time_ns) / 1e6
        FROM spans s JOIN markers m ON s.rank = m.rank AND s."group" = m."group" AND s.seq = m.seq
        WHERE s.kind = 'collective' AND m.state = 'enqueued' GROUP BY 1 ORDER BY 1""").fetchall()
    return worst, [(int(r), None if v is None else float(v)) for r, v in leads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | worst pair, median TP call end difference (ms) | smallest lead per rank (ms) |")
    print("|---|---|---|")
    for run in args.runs:
        if not run.is_dir():
            continue
        try:
            worst, leads = agreement(run)
        except (RunDirError, duckdb.Error) as exc:  # a run that wrote nothing readable (a hang, a crash)
            print(f"| {run.name} | unreadable: {str(exc).splitlines()[0]} | |")
            continue
        shown = ", ".join(f"{r}: {v:.3f}" for r, v in leads if v is not None)
        print(f"| {run.name} | {'-' if worst is None else f'{worst:.3f}'} | {shown} |")


if __name__ == "__main__":
    main()
