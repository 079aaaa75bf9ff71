"""Ingest every trace of a corpus of Kineto traces, one by one, and list what is read or refused.

For corpora that are not ours to commit, such as the traces in Holistic Trace Analysis'
``tests/data`` (a local copy of that repository). Each ``*.json`` / ``*.json.gz`` is ingested
alone; each folder holding several is ingested too, as one job. Prints a Markdown table: the
trace, the outcome, ranks, spans and markers, and the warnings or the one-line error.

    python bench/kineto_corpus.py HTA_CHECKOUT/tests/data
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

from megascope.errors import MegascopeError
from megascope.ingest import ingest_kineto
from megascope.ingest.kineto import find_trace_files


def _one(src: Path, work: Path) -> tuple[str, str]:
    out = Path(tempfile.mkdtemp(dir=work)) / "run"
    try:
        result = ingest_kineto(src, out, workers=1)
    except MegascopeError as exc:
        return "refused", str(exc).replace(str(src), "").strip(": ") or str(exc)
    what = f"{len(result.ranks_found)} of {result.world_size} ranks, {result.spans:,} spans, {result.markers:,} markers"
    if result.warnings:
        what += "; " + "; ".join(result.warnings)
    return "read", what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--work", type=Path, default=None, help="Where the runs go (default: a temporary folder).")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    work = args.work or Path(tempfile.mkdtemp(prefix="megascope-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    files = find_trace_files(args.corpus)
    targets = [*files]
    folders = sorted({f.parent for f in files})
    targets += [d for d in folders if sum(1 for f in files if f.parent == d) > 1]
    counts = {"read": 0, "refused": 0}
    print("| trace | outcome | detail |")
    print("|---|---|---|")
    for target in targets:
        outcome, detail = _one(target, work)
        counts[outcome] += 1
        name = os.path.relpath(target, args.corpus) + ("/ (folder)" if target.is_dir() else "")
        print(f"| `{name}` | {outcome} | {detail.replace('|', '/')} |")
    print(f"\n{counts['read']} read, {counts['refused']} refused, of {len(targets)} ({len(files)} files)")


if __name__ == "__main__":
    main()
