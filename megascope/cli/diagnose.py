"""``megascope diagnose`` and ``megascope health``: self-tests that find the bad GPU or link, and
the health findings of a run."""

from __future__ import annotations

from pathlib import Path

import click

from megascope.cli.common import echo_json, echo_problems, json_option, out_run_option, run_dir_argument


@click.command()
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Start this many local ranks (else run under torchrun, or alone).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size of the mesh.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size of the mesh.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="auto: nccl where CUDA is available, else gloo.")
@click.option("--tolerance", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.25,
              show_default=True, help="An outlier is below (1 - tolerance) x the median of its peers.")
@click.option("--iters", type=click.IntRange(min=1), default=None, help="Timed iterations per test.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=120.0, show_default=True,
              help="Seconds before a stuck collective fails the run.")
@click.option("--slow-rank", type=click.IntRange(min=0), default=None, hidden=True,
              help="Test hook: make this rank slow (also env MEGASCOPE_DIAGNOSE_SLOW_RANK).")
@json_option
@out_run_option
def diagnose(nproc: int | None, tp: int, pp: int, backend: str, tolerance: float, iters: int | None,
             timeout_s: float, slow_rank: int | None, as_json: bool, out: Path) -> None:
    """GEMM, memory bandwidth, device copies and all-reduce per TP/PP/DP group; outliers named.

    Results go to RUN's diagnostics table (a new run, or a part added to an existing one).
    """
    from megascope.health.diagnose import DiagnoseConfig, format_report, run_diagnose

    cfg = DiagnoseConfig(out=out, nproc=nproc, tp=tp, pp=pp, backend=backend, tolerance=tolerance, iters=iters,
                         timeout_s=timeout_s, slow_rank=slow_rank)
    report = run_diagnose(cfg)
    if report is None:  # a non-zero rank under torchrun: rank 0 reports
        return
    if as_json:
        echo_json(report)
    else:
        click.echo(format_report(report))


@click.command()
@run_dir_argument
@click.option("--silent-after", type=click.FloatRange(min=0, min_open=True), default=3.0, show_default=True,
              help="Heartbeat periods of silence before a rank counts as stopped.")
@json_option
def health(run_dir: Path, silent_after: float, as_json: bool) -> None:
    """Health findings of RUN: silent ranks, throttled or hot GPUs, XID/ECC errors, IB links, diagnose outliers."""
    import pandas as pd

    from megascope.health import health_findings
    from megascope.store import open_run

    run = open_run(run_dir)
    echo_problems(run.problems)
    df = health_findings(run.con, silent_after=silent_after)  # one thread: the connection itself
    records = [{k: (None if pd.isna(v) else v) for k, v in row.items()} for row in df.to_dict("records")]
    if as_json:
        echo_json({"run": str(run_dir), "findings": records})
        return
    if not records:
        click.echo("no health findings")
        return
    for r in records:
        who = "host" if r["rank"] is None else f"rank {r['rank']}"
        click.echo(f"{r['finding']:<16} {who:<10} {r['host']:<20} {r['detail']}")


def register(group: click.Group) -> None:
    group.add_command(diagnose)
    group.add_command(health)
