"""Benchmark: ``megascope compact`` at scale: files, open, report and a timeline selection, before and after.

Per size, a synth run (tp=8, pp=8, a straggler planted at rank 517) is written fresh into ``--dir``
(compaction changes it), then, each step in a fresh process (so each peak RSS is its own):

* before: part files and bytes on disk; ``open_run``; a cold ``report`` (the analysis cache
  ``RUN/_cache`` removed first, so the base tables are built from the files); a dashboard timeline
  selection (8 ranks, one step, ``dashboard.queries.timeline_spans``) on a freshly opened run;
* ``compact(RUN, everything=True)`` (what ``megascope compact RUN --all`` does): time, peak memory;
* after: the same measures as before.

Also printed: bytes on disk per span row, before (one part per rank) and after (compacted).

    python bench/compact_scale.py --dir /big/disk/bench                        # 1,024 x 100
    python bench/compact_scale.py --dir D --size 1024x100 --size 12288x20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STRAGGLER_RANK = 517

CHILD = r"""
import json, resource, shutil, sys, time
from pathlib import Path
what, path = sys.argv[1], Path(sys.argv[2])
out = {}
if what == "compact":
    from megascope.compact import compact
    t0 = time.perf_counter()
    r = compact(path, everything=True)
    out = {"seconds": time.perf_counter() - t0, "parts_merged": r.parts_merged, "files_written": r.files_written,
           "rows": r.rows}
elif what == "open":
    t0 = time.perf_counter()
    from megascope.store import open_run
    t1 = time.perf_counter()
    run = open_run(path, memory_limit="3GB")
    out = {"seconds": time.perf_counter() - t1, "problems": len(run.problems)}
elif what == "report":
    shutil.rmtree(path / "_cache", ignore_errors=True)
    from megascope.store import open_run
    from megascope.analysis import report
    t0 = time.perf_counter()
    run = open_run(path, memory_limit="3GB")
    r = report(run)
    out = {"seconds": time.perf_counter() - t0, "found": [(s["rank"], s["cause"]) for s in r["stragglers"]][:3]}
elif what == "timeline":
    from megascope.store import open_run
    from megascope.dashboard import queries
    run = open_run(path, memory_limit="3GB")
    (steps,) = run.con.execute("SELECT max(step) FROM spans").fetchone()
    t0 = time.perf_counter()
    frame = queries.timeline_spans(run, ranks=list(range(8)), steps=(steps // 2, steps // 2))
    out = {"seconds": time.perf_counter() - t0, "spans": len(frame)}
out["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
"""


def child(what: str, path: Path) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", CHILD, what, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed: {proc.stderr[-2000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def files_and_bytes(path: Path, sub: str = "") -> tuple[int, int]:
    files = [p for p in (path / sub if sub else path).rglob("*.parquet") if "_cache" not in p.parts]
    return len(files), sum(p.stat().st_size for p in files)


def span_bytes(path: Path) -> tuple[int, int]:
    """Bytes on disk of the spans table (parts and compacted files)."""
    parts = [*(path / "spans").rglob("*.parquet"), *(path / "compacted" / "spans").glob("*.parquet")]
    return len(parts), sum(p.stat().st_size for p in parts)


def measure(path: Path) -> dict[str, object]:
    files, size = files_and_bytes(path)
    return {"files": files, "bytes": size, "open": child("open", path), "report": child("report", path),
            "timeline": child("timeline", path)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="Where the synth runs are written (rewritten each time).")
    ap.add_argument("--size", action="append", default=None, metavar="RANKSxSTEPS",
                    help="Run size, repeatable (default 1024x100).")
    args = ap.parse_args()
    sizes = args.size or ["1024x100"]
    rows = []
    for size in sizes:
        ranks, steps = (int(x) for x in size.lower().split("x"))
        run = args.dir / f"c{ranks}x{steps}"
        shutil.rmtree(run, ignore_errors=True)
        run.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "megascope", "synth", "--ranks", str(ranks), "--steps", str(steps),
                        "--tp", "8", "--pp", "8", "--inject", f"straggler:rank={STRAGGLER_RANK % ranks},factor=1.1",
                        "-o", str(run)], check=True, stdout=subprocess.DEVNULL)
        synth_s = time.perf_counter() - t0
        print(f"{size}: synth {synth_s:.1f} s", file=sys.stderr)
        span_files, span_size = span_bytes(run)
        before = measure(run)
        print(f"{size}: before {before}", file=sys.stderr)
        done = child("compact", run)
        print(f"{size}: compact {done}", file=sys.stderr)
        after = measure(run)
        print(f"{size}: after {after}", file=sys.stderr)
        compacted_files, compacted_size = span_bytes(run)
        spans_rows = int(done["rows"])  # every table's rows; spans counted apart below
        import duckdb

        ((n_spans,),) = duckdb.sql(f"SELECT count(*) FROM read_parquet('{run}/compacted/spans/*.parquet')").fetchall()
        rows.append((ranks, steps, before, done, after, span_size / n_spans, compacted_size / n_spans, spans_rows,
                     n_spans, span_files, compacted_files))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; cores: {os.cpu_count()}")
    print("| ranks | steps | rows | files before -> after | compact s (peak) | open_run s before -> after "
          "| report s before -> after | timeline s before -> after | bytes/span before -> after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ranks, steps, b, c, a, bps_before, bps_after, all_rows, _n_spans, _f0, _f1 in rows:
        print(f"| {ranks:,} | {steps:,} | {all_rows:,} | {b['files']:,} -> {a['files']:,} "
              f"| {c['seconds']:.1f} ({c['peak_bytes'] / 2**30:.1f} GB) "
              f"| {b['open']['seconds']:.2f} -> {a['open']['seconds']:.2f} "
              f"| {b['report']['seconds']:.1f} -> {a['report']['seconds']:.1f} "
              f"| {b['timeline']['seconds']:.2f} -> {a['timeline']['seconds']:.2f} "
              f"| {bps_before:.1f} -> {bps_after:.1f} |")
    for ranks, steps, b, _c, a, *_ in rows:
        print(f"{ranks}x{steps}: stragglers before {b['report']['found']}, after {a['report']['found']}; "
              f"report peak {b['report']['peak_bytes'] / 2**30:.2f} -> {a['report']['peak_bytes'] / 2**30:.2f} GB")


if __name__ == "__main__":
    main()
