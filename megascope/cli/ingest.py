"""``megascope ingest``: foreign traces (Kineto JSON, NCCL flight-recorder dumps) into run directories."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from megascope.cli.common import echo_json, out_run_option

mesh_option = click.option(
    "--mesh", "mesh_spec", metavar="AXIS=N,...",
    help="How ranks map onto the mesh when process-group names do not say, e.g. tp=2,pp=2,dp=2.",
)


def _mesh(spec: str | None) -> dict[str, int] | None:
    if not spec:
        return None
    from megascope.ingest.groups import parse_mesh_spec

    return parse_mesh_spec(spec)


def _summary(result: Any, as_json: bool) -> None:
    if as_json:
        data = dataclasses.asdict(result)
        data["run_dir"] = str(result.run_dir)
        echo_json(data)
        return
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(
        f"wrote {result.run_dir}: {result.source}, {len(result.ranks_found)} of {result.world_size} ranks, "
        f"mesh {' '.join(f'{k}={v}' for k, v in result.mesh.items())}, "
        f"{result.spans} spans, {result.markers} markers from {result.events} events in {result.seconds:.1f} s"
    )


@click.group()
def ingest() -> None:
    """Turn traces you already have into megascope runs."""


@ingest.command()
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@out_run_option
@mesh_option
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Parsing processes (default: one per core).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def kineto(src: Path, out: Path, mesh_spec: str | None, workers: int | None, as_json: bool) -> None:
    """torch.profiler (Kineto) JSON traces, one file per rank (.json or .json.gz).

    SRC is a trace file or a directory searched for *.json and *.json.gz.
    """
    from megascope.ingest import ingest_kineto

    mesh = _mesh(mesh_spec)
    bar: Any = None
    shown = 0

    def progress(done: int, total: int) -> None:
        # The bar appears once work is under way, and only on a terminal, so errors stay one line.
        nonlocal bar, shown
        if not sys.stderr.isatty():
            return
        if bar is None:
            bar = click.progressbar(length=total, label="reading traces", file=sys.stderr)
            bar.__enter__()
        bar.update(done - shown)
        shown = done

    try:
        result = ingest_kineto(src, out, mesh=mesh, workers=workers, progress=progress)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    _summary(result, as_json)


@ingest.command("flight-recorder")
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@out_run_option
@mesh_option
@click.option("--world-size", type=click.IntRange(min=1), default=None,
              help="Ranks in the job, when the dumps do not say (silent ranks are then counted).")
@click.option("--prefix", default=None, help="Dump file prefix (TORCH_NCCL_DEBUG_INFO_TEMP_FILE's file name part).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def flight_recorder(
    src: Path, out: Path, mesh_spec: str | None, world_size: int | None, prefix: str | None, as_json: bool
) -> None:
    """NCCL flight-recorder dumps: one pickled (or JSON) file per rank, named <prefix><rank>.

    SRC is a directory of dumps or a single dump. Ranks that wrote no dump are kept as suspects.
    """
    from megascope.ingest import ingest_flight_recorder

    result = ingest_flight_recorder(src, out, mesh=_mesh(mesh_spec), world_size=world_size, prefix=prefix)
    _summary(result, as_json)


def register(group: click.Group) -> None:
    group.add_command(ingest)
