"""Check: the compiled Kineto scanner and the Python path write the same run, table for table.

Each input (a trace file or a directory of one job's traces) is ingested twice, in subprocesses,
with ``MEGASCOPE_KINETO_SCANNER=1`` and ``=0``; the spans, markers, step_sums, ranks and groups
tables of every rank are compared with Arrow's ``equals`` (row order included, schema metadata
dropped: it holds the run id), and so is ``run.json`` but its ``run_id``. An input refused by
both must be refused with the same error line. ``--each-file DIR`` adds every trace under DIR as
an input of its own (a corpus of unrelated traces). Exit status 1 if any input differs.

Usage::

    python bench/kineto_scanner_identity.py TRACES_A/ TRACES_B/ --each-file CORPUS/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TABLES = ("spans", "markers", "step_sums", "ranks", "groups")


def ingest(src: Path, out: Path, scanner: bool) -> str | None:
    """Ingest ``src`` into ``out``; None, or the error line where it is refused."""
    env = dict(os.environ, MEGASCOPE_KINETO_SCANNER="1" if scanner else "0")
    proc = subprocess.run([sys.executable, "-m", "megascope", "ingest", "kineto", str(src), "-o", str(out)],
                          env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def tables(run: Path) -> dict[str, pa.Table]:
    """Every part of the run, keyed by its path relative to the table's folder (rank partition)."""
    out = {}
    for name in TABLES:
        for path in sorted((run / name).rglob("*.parquet")):
            # part names carry times and process ids: key by the rank folder and the part's place in it
            siblings = sorted(path.parent.glob("*.parquet"), key=lambda p: p.stem.rsplit("-", 1)[-1])
            key = f"{name}/{path.parent.relative_to(run / name)}/{siblings.index(path)}"
            out[key] = pq.read_table(path).replace_schema_metadata(None)
    return out


def run_meta(run: Path) -> dict[str, object]:
    meta = json.loads((run / "run.json").read_text())
    meta.pop("run_id", None)
    return meta


def compare(src: Path, work: Path) -> list[str]:
    """What differs between the two ingests of ``src`` (empty: nothing)."""
    runs = {flag: work / ("scanner" if flag else "python") for flag in (True, False)}
    errors = {flag: ingest(src, runs[flag], flag) for flag in (True, False)}
    if errors[True] or errors[False]:
        return [] if errors[True] == errors[False] else [f"refusals differ: {errors[True]!r} vs {errors[False]!r}"]
    a, b = tables(runs[True]), tables(runs[False])
    problems = []
    if sorted(a) != sorted(b):
        problems.append(f"parts differ: {sorted(set(a) ^ set(b))[:5]}")
    problems += [f"{key} differs" for key in sorted(set(a) & set(b)) if not a[key].equals(b[key])]
    if run_meta(runs[True]) != run_meta(runs[False]):
        problems.append("run.json differs")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="*", type=Path, help="trace files or directories, each one job")
    ap.add_argument("--each-file", type=Path, action="append", default=[],
                    help="a directory whose every *.json / *.json.gz is an input of its own")
    args = ap.parse_args()
    inputs = list(args.inputs)
    for folder in args.each_file:
        inputs += sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz")))
    failed = 0
    for src in inputs:
        with tempfile.TemporaryDirectory() as work:
            problems = compare(src, Path(work))
        failed += bool(problems)
        print(f"{'DIFFERS' if problems else 'same'}  {src}" + "".join(f"\n    {p}" for p in problems))
    print(f"{len(inputs)} inputs, {failed} with differences")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
