"""Dashboard callback latency at scale: the server-side work behind each page, cold and warm.

For each size a seeded synth run with a planted straggler is written (or reused from --work), the
run is opened as the dashboard opens it, and each page's callback body is timed: the analysis
results it needs (through the dashboard's per-generation cache), the figure or table, and the
JSON encoding of what goes to the browser. "cold" is the first view after new data (nothing
cached), "warm" the median of three later views (what the watcher's precomputation gives); also
timed: the watcher's look for new parts of an unchanged run (off the request path) and the tick callback
every open page makes. HTTP and browser rendering are not included.

Targets (issue 11): a callback within 300 ms at 1,024 ranks and within 2 s at 12,288 ranks.

    python bench/dashboard_latency.py                         # 1,024 x 50 and 12,288 x 10
    python bench/dashboard_latency.py --sizes 1024x50 --work /tmp/ms-bench
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plotly.io as pio
from megascope.dashboard import data
from megascope.dashboard.pages import overview, stragglers, topology
from megascope.dashboard.pages.heatmap import DEFAULT_PHASE
from megascope.dashboard.pages.timeline import bubbles_section
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import status_line
from plotly.utils import PlotlyJSONEncoder

from megascope.figures.heatmap import heatmap_figure
from megascope.figures.timeline import timeline_figure
from megascope.figures.topology import topology_figure
from megascope.inject import parse_injects
from megascope.synth import SynthConfig, synth_run


def _payload(obj: Any) -> int:
    """Bytes of JSON the browser would receive for ``obj`` (a figure or Dash components)."""
    if hasattr(obj, "to_plotly_json") and hasattr(obj, "layout"):
        return len(pio.to_json(obj, validate=False))
    return len(json.dumps(obj, cls=PlotlyJSONEncoder))


def page_overview(served: ServedRun) -> list[Any]:
    per_step = data.per_step(served)
    from megascope.figures.overview import step_series_figure

    loss = data.loss(served)
    return [data.figure(served, ("overview",), lambda: step_series_figure(per_step, loss=loss)), overview.alerts(served),
            overview.cards(served, per_step)]


def page_heatmap(served: ServedRun) -> list[Any]:
    frame = data.heatmap(served, DEFAULT_PHASE)
    return [data.figure(served, ("heatmap", DEFAULT_PHASE), lambda: heatmap_figure(frame, phase=DEFAULT_PHASE))]


def page_stragglers(served: ServedRun) -> list[Any]:
    frame = data.stragglers(served)
    from megascope.dashboard.components import table

    return [stragglers.whatif_cards(data.whatif(served), n_stragglers=len(frame)),
            table(frame, id="t", columns=stragglers.COLUMNS)]


def page_topology(served: ServedRun) -> list[Any]:
    hang = data.hang(served)
    states = data.rank_states(served)
    suspects = (hang.get("suspects") or [])[:3] if hang.get("hung") else []
    return [data.figure(served, ("topology",), lambda: topology_figure(states, suspects=suspects)),
            topology.banner(served, data.rank_states(served), hang)]


def page_timeline(served: ServedRun) -> list[Any]:
    ranks = data.peers(served, data.focus_rank(served))
    spans, steps, labels = data.timeline(served, ranks, data.default_steps(served))
    return [timeline_figure(spans, labels=labels, step_bounds=steps), bubbles_section(data.bubbles(served))]


PAGES: list[tuple[str, Callable[[ServedRun], list[Any]]]] = [
    ("overview", page_overview), ("heat-map", page_heatmap), ("stragglers", page_stragglers),
    ("topology", page_topology), ("timeline", page_timeline),
]


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def measure(run_dir: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seconds, registry = _timed(lambda: RunRegistry([run_dir]))
    served = next(iter(registry))
    rows.append({"what": "open run (views over all parts)", "cold_s": seconds, "warm_s": None, "payload": None})
    for name, page in PAGES:
        cold, parts = _timed(lambda page=page: [_payload(p) for p in page(served)])  # type: ignore[misc]
        warm = statistics.median(_timed(lambda page=page: [_payload(p) for p in page(served)])[0]  # type: ignore[misc]
                                 for _ in range(3))
        rows.append({"what": f"page {name}", "cold_s": cold, "warm_s": warm, "payload": sum(parts)})
        sys.stderr.write(f"  {name}: cold {cold:.2f} s, warm {warm:.3f} s\n")
    served._settling = False  # as long after the last write as a finished run is
    poll = statistics.median(_timed(served.poll)[0] for _ in range(5))
    rows.append({"what": "watcher poll, no new data (background thread)", "cold_s": None, "warm_s": poll,
                 "payload": None})
    tick = statistics.median(_timed(lambda: status_line(served))[0] for _ in range(5))
    rows.append({"what": "tick callback (every 2 s per open page)", "cold_s": None, "warm_s": tick, "payload": None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1024x50", "12288x10"], help="RANKSxSTEPS")
    parser.add_argument("--work", type=Path, default=None, help="Keep (and reuse) the synth runs here.")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="megascope-dash-bench-"))
    print("| ranks x steps | what | cold (s) | warm (s) | JSON to browser |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        ranks, steps = (int(v) for v in size.lower().split("x"))
        run_dir = work / f"synth-{ranks}x{steps}"
        if not run_dir.exists():
            sys.stderr.write(f"writing {run_dir} ...\n")
            synth_run(run_dir, SynthConfig(ranks=ranks, steps=steps, tp=8, pp=8, seed=0,
                                           faults=parse_injects([f"straggler:rank={ranks // 3},factor=1.3"])))
        for row in measure(run_dir):
            cold = f"{row['cold_s']:.2f}" if row["cold_s"] is not None else ""
            warm = f"{row['warm_s']:.3f}" if row["warm_s"] is not None else ""
            payload = f"{row['payload'] / 1e3:,.0f} kB" if row["payload"] else ""
            print(f"| {ranks:,} x {steps} | {row['what']} | {cold} | {warm} | {payload} |", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"\npeak RSS of the process: {peak:.2f} GB")


if __name__ == "__main__":
    main()
