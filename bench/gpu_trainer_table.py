"""Table of the GPU trainer benchmark (bench/gpu_trainer.sh).

Per layout and collector setting: median step time, tokens/s and MFU. Step times come from the
trainer's own result (rank 0's host clock between step ends, which on a GPU equals device time in
the steady state) so that runs with the collector off, which write no spans, are measured the same
way as runs with it on. MFU = run.json's model FLOPs per step / step time / GPUs / peak.

For runs with the collector on, also megascope's own post-mortem MFU (``analysis.mfu``, from the
recorded step spans) next to it; how host-bound each run was (``analysis.host_lead``: the worst
rank's share of calls at which its device sat idle waiting for the host); and the communication
left exposed per step and rank, by group kind, from ``analysis.exposed_comm`` (every rank, steps
after the warm-up).

Runs made with ``--collector-ab`` (``*-ab.json``) get their own table: per run, recorded vs
unrecorded steps of the same process (``megascope.trainer.ab.ab_cost``), the cost without and with
the boundary flushes charged, and per layout the median over runs.

    python bench/gpu_trainer_table.py RUNS_DIR BASELINE_JSON
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

WARMUP = 3  # steps left out of the medians (allocator, NCCL and kernel warm-up)


def _megascope_view(run_dir: Path) -> tuple[float, dict[str, tuple[float, float]], float | None] | None:
    """(megascope's median MFU after the warm-up, {group kind: (exposed ms, comm ms) per rank-step},
    the largest share of calls at which a rank's device waited for its host (analysis.host_lead))."""
    try:
        from megascope.analysis import exposed_comm, host_lead, mfu
        from megascope.store import open_run
    except ImportError:
        return None
    run = open_run(run_dir)
    per_step = mfu(run)
    steps = [int(s) for s in per_step["step"] if s >= WARMUP]
    med = float(per_step[per_step["step"] >= WARMUP]["mfu"].median())
    ex = exposed_comm(run, steps=steps)
    n = max(1, len(steps) * run.meta.world_size)
    kinds: dict[str, tuple[float, float]] = {}
    for kind, rows in ex.groupby("group_kind"):
        # Every call issued (untimed ones counted at the mean of the timed ones, --tp-comm-spans
        # first); issued-to-completion time of the timed calls, scaled the same way.
        scale = rows["calls"] / rows["spans"]
        kinds[str(kind)] = (float(rows["exposed_all_ns"].sum()) / n / 1e6,
                            float((rows["comm_ns"] * scale).sum()) / n / 1e6)
    lead = host_lead(run, steps=steps)
    return med, kinds, float(lead["starved_frac"].max()) if len(lead) else None


def main() -> None:
    runs, baseline_path = Path(sys.argv[1]), Path(sys.argv[2])
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    meta: dict[str, dict] = {}
    dirs: dict[str, list[Path]] = defaultdict(list)
    for result in sorted(runs.glob("*.json")):
        m = re.match(r"(.+)-r\d+-(on|off)$", result.stem)
        if not m:
            continue
        layout, mode = m.groups()
        steps = json.loads(result.read_text())["step_seconds"][WARMUP:]
        groups[(layout, mode)].extend(steps)
        run_json = runs / result.stem / "run.json"  # the collector (on) writes it
        if run_json.exists():
            meta[layout] = json.loads(run_json.read_text())
            dirs[layout].append(runs / result.stem)
    bases = [json.loads(line) for line in baseline_path.read_text().splitlines() if line.startswith("{")]
    print(f"{'layout':<22} {'collector':<9} {'steps':>5} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'megascope MFU':>13} "
          f"{'host-bound':>12}")
    for i, base in enumerate(bases):
        print(f"{'baseline #' + str(i + 1):<22} {'-':<9} {'':>5} {base['step_s_median'] * 1e3:>9.1f} "
              f"{base['tokens_per_s']:>10,.0f} {base['mfu']:>6.1%}")
    views = {layout: [v for d in ds if (v := _megascope_view(d)) is not None] for layout, ds in dirs.items()}
    mfus: dict[str, float] = {}
    for (layout, mode), steps in sorted(groups.items()):
        if layout not in meta:
            continue
        run = meta[layout]
        gpus = run["world_size"]
        med = statistics.median(steps)
        mfus[f"{layout}-{mode}"] = mfu = run["model_flops_per_step"] / med / gpus / run["peak_flops_per_device"]
        on_views = views.get(layout) if mode == "on" else None
        own = f"{statistics.median(v[0] for v in on_views):.1%}" if on_views else "-"
        # Per run: the worst rank's share of calls at which its device sat idle waiting for the host.
        bound = "/".join(f"{100 * v[2]:.0f}%" for v in on_views if v[2] is not None) if on_views else ""
        print(f"{layout:<22} {mode:<9} {len(steps):>5} {med * 1e3:>9.1f} {run['tokens_per_step'] / med:>10,.0f} "
              f"{mfu:>6.1%} {own:>13} {bound or '-':>12}")
    print()
    if bases:
        base_mfu = statistics.median(b["mfu"] for b in bases)
        for key in ("1gpu-on", "1gpu-off"):
            if key in mfus:
                print(f"trainer {key} vs baseline (median of {len(bases)}): {mfus[key] / base_mfu - 1:+.2%} MFU")
    offs = sorted((layout for layout, mode in groups if mode == "off"), key=len, reverse=True)
    for layout in sorted(meta):
        on = groups.get((layout, "on"))
        # A variant run (e.g. "2gpu-tphost", collector on only) is compared with its layout's "off".
        base = next((b for b in offs if b == layout or (layout.startswith(b) and layout[len(b)] != "-")), None)
        off = groups.get((base, "off")) if base else None
        if on and off:
            label = layout if base == layout else f"{layout} vs {base} off"
            mean_on, mean_off = statistics.fmean(on), statistics.fmean(off)
            print(f"collector overhead {label}: median {statistics.median(on) / statistics.median(off) - 1:+.2%} "
                  f"({statistics.median(on) * 1e3:.1f} vs {statistics.median(off) * 1e3:.1f} ms), "
                  f"mean {mean_on / mean_off - 1:+.2%} ({mean_on * 1e3:.1f} vs {mean_off * 1e3:.1f} ms); "
                  f"steps on {min(on) * 1e3:.0f}-{max(on) * 1e3:.0f}, off {min(off) * 1e3:.0f}-{max(off) * 1e3:.0f} ms")
    print()
    print("communication per rank and step, ms exposed / ms issued-to-completion (megascope exposed_comm)")
    kinds = sorted({k for vs in views.values() for v in vs for k in v[1]})
    print(f"{'layout':<22} " + " ".join(f"{k:>15}" for k in kinds) + f" {'exposed/step':>13}")
    for layout, vs in sorted(views.items()):
        if not vs:
            continue
        v = vs[0]
        med_step = statistics.median(groups[(layout, "on")]) * 1e3 if groups.get((layout, "on")) else float("nan")
        cells = [f"{v[1][k][0]:7.1f} / {v[1][k][1]:5.1f}" if k in v[1] else f"{'-':>15}" for k in kinds]
        total = sum(e for e, _ in v[1].values())
        print(f"{layout:<22} " + " ".join(cells) + f" {total / med_step:>13.1%}")
    ab_table(runs)


def ab_table(runs: Path) -> None:
    from megascope.trainer.ab import ab_cost

    by_layout: dict[str, list[dict[str, float]]] = defaultdict(list)
    rows = []
    for result in sorted(runs.glob("*-ab.json")):
        m = re.match(r"(.+)-r(\d+)-ab$", result.stem)
        record = json.loads(result.read_text())
        if not m or "collector_on" not in record:
            continue
        cost = ab_cost(record["step_seconds"], record["collector_on"], record["ab_flush_seconds"], warmup=WARMUP)
        by_layout[m.group(1)].append(cost)
        rows.append((m.group(1), m.group(2), cost))
    if not rows:
        return
    print()
    print("collector A/B in one process (recorded vs paused blocks; first step of each block left out)")
    print(f"{'layout':<22} {'run':>3} {'steps on/off':>12} {'on ms':>8} {'off ms':>8} {'flush ms/step':>13} "
          f"{'cost mean':>10} {'cost median':>11} {'cost charged':>12}")
    for layout, run, c in rows:
        print(f"{layout:<22} {run:>3} {c['on_steps']:>5}/{c['off_steps']:<6} {c['on_mean_s'] * 1e3:>8.1f} "
              f"{c['off_mean_s'] * 1e3:>8.1f} {c['flush_per_step_s'] * 1e3:>13.2f} {c['cost']:>+10.2%} "
              f"{c['cost_median']:>+11.2%} {c['cost_charged']:>+12.2%}")
    for layout, costs in sorted(by_layout.items()):
        print(f"{layout:<22} median of {len(costs)} runs: cost {statistics.median(c['cost'] for c in costs):+.2%}, "
              f"charged {statistics.median(c['cost_charged'] for c in costs):+.2%}")


if __name__ == "__main__":
    main()
