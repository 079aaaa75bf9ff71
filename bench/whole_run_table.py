"""The collector's cost as a user measures it: whole runs with the collector on and off, interleaved.

Reads the trainer's ``--result-json`` files that ``bench/gpu_trainer.sh`` (part ``whole``) wrote,
named ``<layout>-r<round>-<on|off>.json``, and prints per layout one row per pair (the on and off
run of one round) and one summary row: the mean, median and p90 step time of each mode over every
counted step of its runs, and on / off - 1 for each. Steps counted: FIRST to LAST-1 (``--steps``,
default 4-23, the issue's window), rank 0's host clock between step ends. Then rank 0's wait for
its device per step, and, where the runs were made with ``--host-stats`` (``<run>-host/``), each
rank's host counters per step and rank 0's step time in the steps holding a writer pass against
the others.

    python bench/whole_run_table.py RUNS_DIR [--first 4 --last 24]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.fmean(xs), statistics.median(xs), _p90(xs)


def table(runs: Path, first: int, last: int) -> str:
    by: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    for f in sorted(runs.glob("*.json")):
        m = re.match(r"(.+)-r(\d+)-(on|off)$", f.stem)
        if not m:
            continue
        steps = json.loads(f.read_text()).get("step_seconds") or []
        if len(steps) >= last:
            by[m.group(1)][int(m.group(2))][m.group(3)] = [s * 1e3 for s in steps[first:last]]
    # A variant run with the collector on only (``<layout>-<tag>-r<round>-on``, WHOLE_ON_VARIANTS)
    # is compared with its layout's unrecorded run of the same round.
    for layout, rounds in list(by.items()):
        base = by.get(layout.rsplit("-", 1)[0]) if "-" in layout else None
        for r, modes in rounds.items():
            if "off" not in modes and base is not None and "off" in base.get(r, {}):
                modes["off"] = base[r]["off"]
    lines = ["| layout | pair | off mean (median, p90) ms | on mean (median, p90) ms | on vs off: mean | median | p90 |",
             "|---|---|---|---|---|---|---|"]
    for layout, rounds in sorted(by.items()):
        pooled: dict[str, list[float]] = {"on": [], "off": []}
        pair_ratios = []
        for r, modes in sorted(rounds.items()):
            if set(modes) != {"on", "off"}:
                continue
            off, on = _stats(modes["off"]), _stats(modes["on"])
            pooled["off"] += modes["off"]
            pooled["on"] += modes["on"]
            pair_ratios.append(on[0] / off[0] - 1)
            lines.append(f"| {layout} | {r} | {off[0]:.1f} ({off[1]:.1f}, {off[2]:.1f}) | {on[0]:.1f} ({on[1]:.1f}, "
                         f"{on[2]:.1f}) | {on[0] / off[0] - 1:+.2%} | {on[1] / off[1] - 1:+.2%} | {on[2] / off[2] - 1:+.2%} |")
        if pair_ratios:
            off, on = _stats(pooled["off"]), _stats(pooled["on"])
            lines.append(f"| **{layout}** | **all {len(pair_ratios)}** | {off[0]:.1f} ({off[1]:.1f}, {off[2]:.1f}) | "
                         f"{on[0]:.1f} ({on[1]:.1f}, {on[2]:.1f}) | **{on[0] / off[0] - 1:+.2%}** | "
                         f"{on[1] / off[1] - 1:+.2%} | **{on[2] / off[2] - 1:+.2%}** |")
    return "\n".join(lines)


def waits(runs: Path, first: int, last: int) -> str:
    """Rank 0's wait for the device per step (``step_wait_seconds``, CUDA runs): how far ahead of
    its device the host ran. A host that waits ~0 ms sets the pace itself, and whatever the
    collector adds to it is added to the step; one that waits absorbs it."""
    rows: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: {"step": [], "wait": []})
    for f in sorted(runs.glob("*.json")):
        m = re.match(r"(.+)-r(\d+)-(on|off)$", f.stem)
        if not m:
            continue
        data = json.loads(f.read_text())
        steps, wait = data.get("step_seconds") or [], data.get("step_wait_seconds") or []
        if len(steps) < last or len(wait) < last + 1:
            continue
        row = rows[(m.group(1), m.group(3))]
        row["step"] += [s * 1e3 for s in steps[first:last]]
        # step_seconds[i] runs from the end of step i to the end of step i + 1, whose wait is wait[i + 1]
        row["wait"] += [w * 1e3 for w in wait[first + 1:last + 1]]
    if not rows:
        return ""
    lines = ["| layout | mode | step mean ms | wait for the device, mean ms | host busy (step - wait), mean ms | "
             "steps waiting under 1 ms |", "|---|---|---|---|---|---|"]
    for (layout, mode), row in sorted(rows.items()):
        busy = [a - b for a, b in zip(row["step"], row["wait"], strict=True)]
        short = sum(1 for w in row["wait"] if w < 1.0) / len(row["wait"])
        lines.append(f"| {layout} | {mode} | {statistics.fmean(row['step']):.1f} | {statistics.fmean(row['wait']):.1f} | "
                     f"{statistics.fmean(busy):.1f} | {short:.0%} |")
    return "\n".join(lines)


HostRun = tuple[str, str, str, list[dict[str, Any]]]  # run name, layout, mode, its ranks' counters


def _host_runs(runs: Path, last: int) -> list[HostRun]:
    """(run, layout, mode, its ranks' counters) of every run with ``--host-stats`` (``<run>-host/rank-N.json``)
    whose ranks all wrote at least ``last`` steps of counters (those that did not are left out)."""
    out = []
    for d in sorted(runs.glob("*-host")):
        m = re.match(r"(.+)-r(\d+)-(on|off)-host$", d.name)
        if not m:
            continue
        ranks = [json.loads(f.read_text()) for f in sorted(d.glob("rank-*.json"))]
        ranks = [r for r in ranks if len(r.get("seconds") or []) >= last]
        if ranks:
            out.append((d.name[:-len("-host")], m.group(1), m.group(3), ranks))
    return out


def host(found: list[HostRun], first: int, last: int) -> str:
    """Each rank's host counters per step, pooled over the rounds of a layout and mode: step time,
    the training thread's CPU, the process's CPU (every thread) and the training thread's voluntary
    (it blocked) and involuntary (its CPU was taken) context switches."""
    keys = ("seconds", "thread_cpu_s", "process_cpu_s", "voluntary", "involuntary")
    timed = keys[:3]  # seconds, printed as milliseconds
    rows: dict[tuple[str, str, int], dict[str, list[float]]] = defaultdict(lambda: {k: [] for k in keys})
    for _, layout, mode, ranks in found:
        for data in ranks:
            row = rows[(layout, mode, int(data["rank"]))]
            for k in keys:
                row[k] += (data.get(k) or [])[first:last]
    if not rows:
        return ""
    lines = ["| layout | mode | rank | step ms | thread CPU ms | process CPU ms | voluntary switches | "
             "involuntary switches |", "|---|---|---|---|---|---|---|---|"]
    for (layout, mode, rank), row in sorted(rows.items()):
        cells = [f"{statistics.fmean(row[k]) * (1e3 if k in timed else 1.0):.1f}" if row[k] else "-" for k in keys]
        lines.append(f"| {layout} | {mode} | {rank} | {' | '.join(cells)} |")
    return "\n".join(lines)


PASS_SWITCHES = 30  # a step in which a rank's training thread blocked this often held a writer pass (unrecorded: 5-22)


def _mean_ms(seconds: list[float], steps: list[int]) -> str:
    return f"{statistics.fmean(seconds[s] for s in steps) * 1e3:.1f}" if steps else "-"


def pass_steps(found: list[HostRun], first: int, last: int) -> str:
    """Per recorded run: rank 0's mean step time over the steps in which some rank's training thread
    switched PASS_SWITCHES times or more (its writer made a pass then) and over the others."""
    lines = ["| run | steps holding a pass | their mean ms | the other steps | their mean ms |", "|---|---|---|---|---|"]
    for name, _, mode, ranks in found:
        ranks = [r for r in ranks if len(r.get("voluntary") or []) >= last]
        if mode != "on" or not ranks:
            continue
        held = [s for s in range(first, last) if any(r["voluntary"][s] >= PASS_SWITCHES for r in ranks)]
        other = [s for s in range(first, last) if s not in held]
        rank0 = next((r for r in ranks if r["rank"] == 0), ranks[0])["seconds"]
        lines.append(f"| {name} | {len(held)} | {_mean_ms(rank0, held)} | {len(other)} | {_mean_ms(rank0, other)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path)
    parser.add_argument("--first", type=int, default=4)
    parser.add_argument("--last", type=int, default=24)
    args = parser.parse_args()
    print(f"whole runs, steps {args.first}-{args.last - 1}, rank 0's step time")
    print(table(args.runs, args.first, args.last))
    wait = waits(args.runs, args.first, args.last)
    if wait:
        print("\nrank 0's wait for its device per step (the host at most a step ahead)")
        print(wait)
    found = _host_runs(args.runs, args.last)
    counters = host(found, args.first, args.last)
    if counters:
        print("\neach rank's host per step (--host-stats): its training thread's CPU and context switches")
        print(counters)
    passes = pass_steps(found, args.first, args.last)
    if passes:
        print(f"\nrank 0's step time, steps where some rank's training thread switched {PASS_SWITCHES}+ times "
              "(its writer's pass) and the others")
        print(passes)


if __name__ == "__main__":
    main()
