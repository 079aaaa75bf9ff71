"""Benchmark: one node's scoped compaction pass beside a live job (``megascope compact --ranks``).

A 12,288-rank job flushing every second writes ~37,000 parts a second; one process merges a few
hundred a second (``bench/compact_scale.py``). A scoped pass merges one node's ranks only, so each
node runs its own (``megascope compact RUN --ranks 8-15 --every 60``) and the work per node does
not grow with the job. This measures that work: a synthetic live job (``megascope.synth.LiveSynth``:
per rank and second a spans part with its sums twin, a markers part and, on some ranks, a metrics
part) written ``--every`` seconds at a time (not timed), then the node's pass over its ranks
(``--ranks-per-host``, default 8) timed: wall, CPU (all threads), parts merged. The share of a
core is the pass's CPU over the seconds of job it covers.

``--other-scopes N`` first plants N other nodes' committed manifests (and their files' names) in
``compacted/<table>/``, as a job of N+1 nodes would have them, to show what a node's pass pays for
the rest of the job: a listing, no reading. After the last pass the planted files go and the rows
are checked: the run reads the same spans, markers and metrics as before the passes.

    python bench/compact_host.py --work DIR                      # 16 ranks, 5 passes of 60 s
    python bench/compact_host.py --work DIR --other-scopes 1535  # as one node of 12,288 ranks
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from megascope import layout
from megascope.compact import Scope, compact
from megascope.synth import LiveSynth, SynthConfig

_COUNT = "SELECT (SELECT count(*) FROM spans), (SELECT count(*) FROM markers), (SELECT count(*) FROM metrics)"


def _count(run: Path) -> tuple[int, ...]:
    from megascope.store import open_run

    opened = open_run(run)
    try:
        return tuple(opened.con.execute(_COUNT).fetchone() or ())
    finally:
        opened.con.close()


def _plant(run: Path, n: int, first_rank: int, per_host: int, run_id: str) -> list[Path]:
    """N other nodes' manifests (one per table) and their files' names: what a node's pass lists."""
    planted = []
    for table in ("spans", "markers", "metrics"):
        base = layout.compacted_dir(run, table)
        base.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            lo = first_rank + i * per_host
            tag = f"r{lo:05d}_{lo + per_host - 1:05d}"
            stem = f"c-{time.time_ns():019d}-1-{tag}"
            data = base / f"{stem}-000.parquet"
            data.write_bytes(b"")
            manifest = base / f"{stem}{layout.MANIFEST_SUFFIX}"
            manifest.write_text(json.dumps({"format": layout.MANIFEST_FORMAT, "table": table, "run_id": run_id,
                                            "committed_ns": time.time_ns(), "files": [], "replaces": []}))
            planted += [data, manifest]
    return planted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=100,
                    help="synth micro-batches a step: 100 gives ~600 spans a rank-step, as the bundled trainer's "
                         "4-GPU runs write")
    ap.add_argument("--every", type=int, default=60, help="seconds of job (flushes) between passes")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--other-scopes", type=int, default=0)
    args = ap.parse_args()

    ranks = args.tp * args.pp * args.dp
    run = args.work / "host-run"
    shutil.rmtree(run, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = SynthConfig(ranks=ranks, steps=args.every * args.passes + 2, tp=args.tp, pp=args.pp,
                      gpus_per_host=args.ranks_per_host, micro_batches=args.micro_batches, seed=7)
    job = LiveSynth(run, cfg, threads=2)
    run_id = layout.read_run_json(run)["run_id"]
    planted = _plant(run, args.other_scopes, ranks, args.ranks_per_host, run_id) if args.other_scopes else []
    scope = Scope(ranks=(0, args.ranks_per_host - 1))
    print(f"job: {ranks} ranks (tp={args.tp} pp={args.pp} dp={args.dp}), a flush a second; node: ranks "
          f"0-{args.ranks_per_host - 1}; a pass every {args.every} s of job; {args.other_scopes} other nodes' "
          "manifests planted")
    job.write_step()
    spans = _count(run)[0] / ranks
    print(f"spans a rank-step: {spans:.0f}")
    print("| pass | parts merged | rows | wall s | CPU s | parts/s (wall) | share of a core |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for i in range(args.passes):
        for _ in range(args.every):
            job.write_step()
        if i == args.passes - 1:
            job.write_step()  # the last pass leaves each rank's newest two, as a live pass does
            for p in planted:  # the planted names commit nothing readable: out while the rows are counted
                p.unlink()
            before = _count(run)
            planted = _plant(run, args.other_scopes, ranks, args.ranks_per_host, run_id) if args.other_scopes else []
        w0, c0 = time.perf_counter(), time.process_time()
        result = compact(run, min_age_s=0, keep_newest=2, grace_s=0, scope=scope)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        rows.append((result.parts_merged, result.rows, wall, cpu))
        print(f"| {i + 1} | {result.parts_merged:,} | {result.rows:,} | {wall:.2f} | {cpu:.2f} | "
              f"{result.parts_merged / wall:,.0f} | {100 * cpu / args.every:.1f}% |")
    job.close()
    for p in planted:
        p.unlink()
    after = _count(run)
    print(f"rows before the last pass (spans, markers, metrics): {before}; after: {after}; "
          f"{'the same' if before == after else 'DIFFERENT'}")
    parts = sum(r[0] for r in rows)
    wall = sum(r[2] for r in rows)
    cpu = sum(r[3] for r in rows)
    print(f"all passes: {parts:,} parts in {wall:.1f} s wall, {cpu:.1f} s CPU: {parts / wall:,.0f} parts/s; "
          f"{100 * cpu / (args.every * args.passes):.1f}% of a core for {args.ranks_per_host} ranks")
    if before != after:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
