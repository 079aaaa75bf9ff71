"""``megascope synth``: a realistic synthetic run directory at any scale."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from megascope.cli.common import inject_option, out_run_option


@click.command()
@click.option("--ranks", type=click.IntRange(min=1), required=True, help="World size.")
@click.option("--steps", type=click.IntRange(min=1), required=True)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--cp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Context parallel: an all-gather of keys and values per forward and backward.")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
              help="Expert parallel: a token all-to-all per forward and backward.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=None, help="Per step and DP replica [default: max(4, pp)].")
@click.option("--gpus-per-host", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--clock-skew-ms", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Std-dev of the per-host wall-clock offsets.")
@click.option("--seed", type=int, default=0, show_default=True)
@inject_option
@out_run_option
def synth(ranks: int, steps: int, tp: int, pp: int, cp: int, ep: int, micro_batches: int | None, gpus_per_host: int,
          clock_skew_ms: float, seed: int, injects: tuple[str, ...], out: Path) -> None:
    """Write a synthetic run (dp = ranks / (tp*pp*cp*ep)) with optional planted faults."""
    from megascope.inject import parse_injects
    from megascope.synth import SynthConfig, synth_run

    cfg = SynthConfig(ranks=ranks, steps=steps, tp=tp, pp=pp, cp=cp, ep=ep, micro_batches=micro_batches, seed=seed,
                      gpus_per_host=gpus_per_host, clock_skew_ms=clock_skew_ms, faults=parse_injects(injects))

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            click.echo(f"\rsimulating step {done}/{total}", err=True, nl=done == total)

    stats = synth_run(out, cfg, progress=progress)
    hung = f", hung at step {stats.hung_at_step}" if stats.hung_at_step is not None else ""
    extra = "".join(f" {axis}={size}" for axis, size in (("cp", cp), ("ep", ep)) if size > 1)
    click.echo(
        f"wrote {out}: {ranks} ranks (tp={tp} pp={pp} dp={cfg.dp}{extra}), {stats.spans:,} spans, "
        f"{stats.markers:,} markers, {stats.files:,} files in {stats.seconds:.1f} s "
        f"({stats.rows / max(stats.seconds, 1e-9):,.0f} rows/s){hung}"
    )


def register(group: click.Group) -> None:
    group.add_command(synth)
