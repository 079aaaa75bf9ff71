"""Smoke test of an installed wheel, run by ``make test-install`` from outside the source tree.

    python install_smoke.py core   # torch + pyarrow + click only: the command answers, the collector writes
    python install_smoke.py all    # megascope[all]: synth, report, export, heat-map and the dashboard factory

Exits non-zero with a line naming what failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _megascope(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("megascope")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)


def _check(ok: bool, what: str) -> None:
    if not ok:
        print(f"install smoke test failed: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def _not_from_source() -> None:
    import megascope

    where = Path(megascope.__file__).resolve()
    _check("site-packages" in where.parts, f"megascope imported from the installed wheel ({where})")


def core(tmp: Path) -> None:
    _not_from_source()
    for module in ("duckdb", "pandas", "dash"):
        _check(importlib.util.find_spec(module) is None, f"{module} is not part of a core install")
    proc = _megascope("--help")
    _check(proc.returncode == 0 and "Usage:" in proc.stdout, "megascope --help")

    import pyarrow.parquet as pq
    import torch
    from megascope.collectors import Collector, CollectorConfig

    from megascope.schema import RunMeta

    run = tmp / "job"
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False)
    col = Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                    meta=RunMeta(run_id="smoke", source="collector", world_size=1))
    x = torch.randn(64, 64)
    for step in range(3):
        with col.step(step), col.span("matmul", kind="forward"):
            x = torch.tanh(x @ x)
        col.metric("loss", float(x.mean()), step=step)
    col.close()
    _check((run / "run.json").is_file(), "the collector wrote run.json")
    spans = sum(pq.read_table(p).num_rows for p in run.glob("spans/rank=*/*.parquet"))
    _check(spans >= 6, f"the collector wrote spans ({spans} rows)")
    steps_log = run / "step_log" / "smoke" / "rank=00000.steps"
    size = steps_log.stat().st_size if steps_log.is_file() else 0
    # A header, then a record per step and flush (a step across a flush has two).
    _check(size >= 16 + 3 * 128 and (size - 16) % 128 == 0, f"the collector wrote its step log ({size} bytes)")
    proc = _megascope("report", str(run))
    _check(proc.returncode == 1 and "megascope[analysis]" in proc.stderr and proc.stderr.count("\n") == 1,
           f"report in a core install names the extra it needs ({proc.stderr.strip()!r})")


def full(tmp: Path) -> None:
    _not_from_source()
    run = tmp / "synth"
    proc = _megascope("synth", "--ranks", "8", "--steps", "4", "--tp", "2", "--pp", "2",
                      "--inject", "straggler:rank=5,factor=1.5", "-o", str(run))
    _check(proc.returncode == 0, f"megascope synth ({proc.stderr.strip()})")
    proc = _megascope("report", str(run), "--json")
    _check(proc.returncode == 0, f"megascope report ({proc.stderr.strip()})")
    report = json.loads(proc.stdout)
    _check(report["stragglers"] and report["stragglers"][0]["rank"] == 5, "report finds the planted straggler (SQL shipped)")
    proc = _megascope("export", "perfetto", str(run), "-o", str(tmp / "t.pftrace"))
    _check(proc.returncode == 0 and (tmp / "t.pftrace").stat().st_size > 0, f"export perfetto ({proc.stderr.strip()})")
    proc = _megascope("heatmap", str(run), "-o", str(tmp / "hm.html"))
    _check(proc.returncode == 0, f"heatmap ({proc.stderr.strip()})")
    from megascope.dashboard.app import create_app, registry_of

    app = create_app([run])
    try:
        assets = Path(app.config.assets_folder)
        _check(any(assets.glob("*.css")), f"dashboard assets shipped ({assets})")
        page = app.server.test_client().get("/")
        _check(page.status_code == 200, "the dashboard answers /")
    finally:
        registry_of(app).stop()


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "core"
    if Path.cwd().joinpath("megascope", "__init__.py").exists():
        os.chdir(tempfile.gettempdir())  # never import the source tree by accident
    with tempfile.TemporaryDirectory() as tmp:
        {"core": core, "all": full}[kind](Path(tmp))


if __name__ == "__main__":
    main()
