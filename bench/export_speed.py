"""Benchmark: Perfetto and Chrome JSON export speed (spans/s) and peak memory against run size.

Writes synthetic runs with ``megascope.synth`` (or reuses them under ``--workdir``), then exports
each one in a fresh process so that peak memory (max RSS) belongs to that export alone. The target
for the Perfetto export is >= 1M spans/s on a 2-core machine, with memory flat in run size.

On a shared machine, compare only within one call: ``--baseline-src DIR`` (a checkout of another
version's source tree, e.g. ``git archive COMMIT megascope | tar -x -C DIR``) runs that version's
export on the same runs, interleaved with this one, ``--repeats`` times each; the table gives mean
and p90 wall time, and the ratio of means against the baseline. ``--clock raw`` exports host
clocks as recorded (no clock-offset estimate), ``estimated`` (default) as ``megascope export`` does.
``--compacted`` also exports a copy of each run after ``megascope compact --all`` (``--only-compacted``:
that copy alone); the last lines say whether every export of a run (parts and compacted, every
repeat) wrote the same bytes. The
machine's 1-minute load average is sampled every second during each row's exports and reported.

    python bench/export_speed.py                       # 256 and 1,024 ranks, 10 steps, tp=8 pp=8
    python bench/export_speed.py --runs 1024x20 12288x10 --formats perfetto --repeats 3 --compacted \\
        --baseline-src /tmp/megascope-base --workdir /tmp/export-bench
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_CHILD = r"""
import json, resource, sys, time
fmt, run_dir, out, clock = sys.argv[1:5]
from megascope.export import export_chrome, export_perfetto
from megascope.store import open_run
import megascope
print(megascope.__file__)
began = time.perf_counter()
run = open_run(run_dir)
opened = time.perf_counter() - began
began, cpu = time.perf_counter(), time.process_time()
export = export_perfetto if fmt == "perfetto" else export_chrome
try:
    stats = export(run, out, clock=clock)
except TypeError:  # a baseline from before the clock argument
    stats = export(run, out, correct_clocks=clock == "estimated")
seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
print(json.dumps({"spans": stats.spans, "bytes": stats.bytes, "seconds": seconds, "cpu": cpu, "open_s": opened,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _synth(path: Path, ranks: int, steps: int, tp: int, pp: int) -> None:
    if (path / "run.json").exists():
        return
    from megascope.synth import SynthConfig, synth_run

    synth_run(path, SynthConfig(ranks=ranks, steps=steps, tp=tp, pp=pp, seed=0))


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


class _LoadSampler:
    """The 1-minute load average, sampled every second in a thread: what else ran meanwhile."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def since(self, mark: int) -> list[float]:
        return self.samples[mark:] or [os.getloadavg()[0]]


_THIS_TREE = Path(__file__).resolve().parents[1]


def _export(src: Path | None, fmt: str, run_dir: Path, out: Path, clock: str) -> tuple[dict[str, float], str]:
    # -P: the working directory is not on the path, so a baseline tree is not shadowed by this one
    tree = src or _THIS_TREE
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-P", "-c", _CHILD, fmt, str(run_dir), str(out), clock],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"export of {run_dir} failed:\n{proc.stderr[-2000:]}")
    ran = Path(proc.stdout.strip().splitlines()[-2]).resolve()
    if not ran.is_relative_to(tree.resolve()):
        raise SystemExit(f"the export meant to run {tree} ran {ran}")
    digest = hashlib.sha256()
    with open(out, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    out.unlink(missing_ok=True)
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["256x10", "1024x10"], help="RANKSxSTEPS, e.g. 1024x20 12288x10")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--formats", nargs="+", default=["perfetto", "chrome"], choices=["perfetto", "chrome"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--clock", choices=["estimated", "raw"], default="estimated")
    parser.add_argument("--compacted", action="store_true",
                        help="Also export a copy of each run after `megascope compact --all` (and compare the bytes).")
    parser.add_argument("--only-compacted", action="store_true",
                        help="With --compacted: export the compacted copy only, not the run's parts.")
    parser.add_argument("--baseline-src", type=Path, default=None, help="Source tree of the version to compare with.")
    parser.add_argument("--workdir", type=Path, default=None, help="Keep runs here (reused).")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megascope-export-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    variants: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline_src is not None:
        variants.insert(0, ("baseline", args.baseline_src.resolve()))
    load = _LoadSampler()
    results: dict[tuple[str, str, str, str], list[dict[str, float]]] = {}
    loads: dict[tuple[str, str, str, str], list[float]] = {}
    digests: dict[tuple[str, str, str], set[str]] = {}
    for spec in args.runs:
        ranks, steps = (int(x) for x in spec.lower().split("x"))
        run_dir = workdir / f"synth-{ranks}r-{steps}s-tp{args.tp}-pp{args.pp}"
        _synth(run_dir, ranks, steps, args.tp, args.pp)
        stores = [("parts", run_dir)]
        if args.compacted:
            compacted = run_dir.with_name(run_dir.name + "-compacted")
            if not (compacted / "run.json").exists():
                from megascope.compact import compact

                shutil.copytree(run_dir, compacted, ignore=shutil.ignore_patterns("_cache"))
                compact(compacted, everything=True)
            stores.append(("compacted", compacted))
            if args.only_compacted:
                stores = stores[1:]
        for _ in range(args.repeats):
            for fmt in args.formats:
                for store, path in stores:
                    for name, src in variants:  # interleaved: a load change hits both alike
                        out = workdir / f"{path.name}.{name}.{'pftrace' if fmt == 'perfetto' else 'json'}"
                        key = (spec, store, fmt, name)
                        mark = len(load.samples)
                        result, digest = _export(src, fmt, path, out, args.clock)
                        results.setdefault(key, []).append(result)
                        loads.setdefault(key, []).extend(load.since(mark))
                        digests.setdefault((spec, fmt, name), set()).add(digest)

    print(f"clock: {args.clock}; repeats: {args.repeats}; load average (1 min) sampled every second during each row's "
          f"exports: mean / max")
    print("| ranks x steps | store | format | version | spans | output | wall s mean / p90 | CPU s mean | open_run s | "
          "spans/s (wall, mean) | spans per CPU-s | peak RSS | load mean / max | wall vs baseline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (spec, store, fmt, name), rows in results.items():
        wall = [r["seconds"] for r in rows]
        cpu = [r["cpu"] for r in rows]
        spans = rows[0]["spans"]
        base = results.get((spec, store, fmt, "baseline"))
        ratio = ""
        if base is not None and name != "baseline":
            ratio = f"{statistics.mean(r['seconds'] for r in base) / statistics.mean(wall):.2f}x faster"
        sampled = loads[(spec, store, fmt, name)]
        print(f"| {spec} | {store} | {fmt} | {name} | {spans:,} | {rows[0]['bytes'] / 1e6:,.0f} MB | "
              f"{statistics.mean(wall):.2f} / {_p90(wall):.2f} | {statistics.mean(cpu):.2f} | "
              f"{statistics.mean(r['open_s'] for r in rows):.2f} | {spans / statistics.mean(wall):,.0f} | "
              f"{spans / statistics.mean(cpu):,.0f} | {max(r['rss_mb'] for r in rows):,.0f} MB | "
              f"{statistics.mean(sampled):.1f} / {max(sampled):.1f} | {ratio} |")
    for (spec, fmt, name), seen in digests.items():
        stores_seen = "compacted" if args.only_compacted else "parts and compacted"
        print(f"{spec} {fmt} {name}: {'the same bytes' if len(seen) == 1 else f'{len(seen)} different outputs'}"
              f" over every export{f' ({stores_seen})' if args.compacted else ''}; sha256 {', '.join(sorted(seen))}")


if __name__ == "__main__":
    main()
