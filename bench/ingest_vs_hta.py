"""Benchmark: the same Kineto trace sets through megascope (ingest + report) and through Holistic
Trace Analysis (load + temporal breakdown), same machine, same run: wall seconds and peak memory.

Each tool runs in its own subprocess tree; peak memory is the largest sum of PSS (proportional set
size: pages that forked workers share with their parent count once) over that tree, sampled every
50 ms from /proc (worker processes included), with the sum of RSS next to it; CPU seconds are user + system time of
the whole tree (from the reaped children's rusage), the fair measure on a shared, loaded machine. Traces come from the project's
shared generator (``../shared/tools/gen_kineto.py``, run from its shared location).

HTA is not a megascope dependency: install it into any virtualenv and point ``--hta-python`` at that
interpreter (``pip install holistictraceanalysis``).

Usage::

    python bench/ingest_vs_hta.py --sizes 8x50,64x50 --work /tmp/ingest-bench \
        --hta-python /path/to/hta-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GEN = REPO.parent / "shared" / "tools" / "gen_kineto.py"

HTA_SCRIPT = """
import sys
from hta.trace_analysis import TraceAnalysis
analysis = TraceAnalysis(trace_dir=sys.argv[1])
breakdown = analysis.get_temporal_breakdown(visualize=False)
print(len(breakdown))
"""


def _pss(pid: int) -> int | None:
    """Proportional set size in bytes (pages shared by forked workers counted once overall)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _tree_memory(root: int) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) bytes of ``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total_rss = total_pss = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        total_rss += rss.get(pid, 0)
        pss = _pss(pid)
        total_pss += pss if pss is not None else rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total_rss, total_pss


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[float, int, int, str, float, int, str]:
    """(wall s, peak tree PSS bytes, exit code, stderr tail, CPU s of the tree, peak tree RSS bytes,
    stdout) of running ``cmd``."""
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, text=True)
    peak = peak_rss = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, peak_rss
        while not done.is_set():
            rss, pss = _tree_memory(proc.pid)
            peak, peak_rss = max(peak, pss), max(peak_rss, rss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    tail = err.strip().splitlines()[-1] if err.strip() else ""
    return wall, peak, proc.returncode, tail, _children_cpu() - cpu0, peak_rss, out


def generate(gen: Path, out: Path, ranks: int, steps: int) -> dict[str, Any]:
    truth = out / "ground_truth.json.txt"
    if not truth.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(gen), "--out", str(out), "--ranks", str(ranks), "--steps", str(steps)],
                       check=True, stdout=subprocess.DEVNULL)
    return json.loads(truth.read_text())


def warm(src: Path) -> tuple[int, float]:
    """Read every file under ``src`` once (bytes, seconds), so that both tools find the traces in
    the page cache: the tool run first would otherwise pay for the disk reads alone (6.2 GB at
    1,024x10), and the second find them cached."""
    t0, total = time.perf_counter(), 0
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8x50,64x50", help="comma-separated RANKSxSTEPS")
    ap.add_argument("--work", type=Path, default=Path("/tmp/megascope-ingest-bench"))
    ap.add_argument("--gen", type=Path, default=DEFAULT_GEN, help="path of gen_kineto.py")
    ap.add_argument("--hta-python", default=None, help="interpreter with holistictraceanalysis (omit to skip HTA)")
    ap.add_argument("--report-pythonpath", default=None,
                    help="PYTHONPATH for the report step only (time an analysis from another checkout)")
    ap.add_argument("--keep", action="store_true", help="keep generated traces and runs")
    ap.add_argument("--cold", action="store_true",
                    help="do not read the traces once before timing (the first tool then reads them from disk)")
    args = ap.parse_args()

    rows = []
    for size in args.sizes.split(","):
        ranks, steps = (int(v) for v in size.lower().split("x"))
        src = args.work / f"traces-{ranks}x{steps}"
        truth = generate(args.gen, src, ranks, steps)
        run = args.work / f"run-{ranks}x{steps}"
        shutil.rmtree(run, ignore_errors=True)
        if not args.cold:
            nbytes, seconds = warm(src)
            print(f"{size}: read {nbytes / 1e9:.2f} GB of traces once before timing, {seconds:.1f} s", file=sys.stderr)
        ingest = measure([sys.executable, "-m", "megascope", "ingest", "kineto", str(src), "-o", str(run)])
        env = dict(os.environ)
        if args.report_pythonpath:
            env["PYTHONPATH"] = args.report_pythonpath
        # Run outside the checkout so that PYTHONPATH, not the current directory, picks the package.
        report = measure([sys.executable, "-m", "megascope", "report", str(run.resolve()), "--json"], env=env,
                         cwd=args.work)
        hta: tuple[float, int, int, str, float, int, str] = (float("nan"), 0, -1, "skipped", float("nan"), 0, "")
        if args.hta_python:
            hta = measure([args.hta_python, "-c", HTA_SCRIPT, str(src)])
        rows.append((size, truth, ingest, report, hta))
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
        print(f"{size}: ingest rc={ingest[2]} {ingest[3]} | report rc={report[2]} {report[3]} | "
              f"hta rc={hta[2]} {hta[3]}", file=sys.stderr)

    gb = 1 << 30
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| ranks x steps | events | JSON | megascope ingest + report: wall / CPU | peak mem PSS (RSS) | "
          "straggler named (planted) | HTA load + temporal: wall / CPU | HTA peak mem PSS (RSS) | CPU ratio | "
          "wall ratio | memory ratio (PSS) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, truth, ingest, report, hta in rows:
        wall = ingest[0] + report[0]
        cpu = ingest[4] + report[4]
        peak = max(ingest[1], report[1])
        peak_rss = max(ingest[5], report[5])
        ok = "" if ingest[2] == 0 and report[2] == 0 else " (failed)"
        good = hta[2] == 0
        nan = float("nan")
        print(f"| {size} | {truth['total_events'] / 1e6:.2f}M | {int(truth['total_bytes_on_disk']) / 1e9:.2f} GB | "
              f"{ingest[0]:.1f} + {report[0]:.1f} = {wall:.1f} s / {cpu:.1f} s{ok} | {peak / gb:.2f} ({peak_rss / gb:.2f}) GiB | "
              f"{_named(report[6])} ({truth.get('straggler_rank')}) | "
              f"{hta[0]:.1f} s / {hta[4]:.1f} s | {hta[1] / gb:.2f} ({hta[5] / gb:.2f}) GiB | "
              f"{(hta[4] / cpu if good and cpu else nan):.1f}x | {(hta[0] / wall if good else nan):.1f}x | "
              f"{(hta[1] / peak if good and peak else nan):.1f}x |")


def _named(report_stdout: str) -> str:
    """The worst straggler's rank in ``megascope report --json`` output ("-" if none)."""
    try:
        stragglers = json.loads(report_stdout.strip().splitlines()[-1]).get("stragglers") or []
    except (ValueError, IndexError, AttributeError):
        return "?"
    return str(stragglers[0].get("rank")) if stragglers else "-"


if __name__ == "__main__":
    main()
