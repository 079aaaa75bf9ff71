"""Write an imported run: a hidden staging directory, renamed into place only when complete.

Role in the data flow: the last stage of both importers. A failed or interrupted ingest leaves
nothing at ``-o RUN`` (and never touches an existing run), so "loses nothing" holds for the
output as well as the input.

Example::

    with StagedRun(out) as stage:
        write_rank_tables(stage.path, plan, rank_info)
        layout.write_part(stage.path, "spans", table, rank=0)
        layout.write_run_meta(stage.path, meta)
    # out now exists, complete
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pyarrow as pa

from megascope import layout, schema
from megascope.errors import IngestError, MegascopeError, OutputError
from megascope.ingest.groups import GroupPlan

log = logging.getLogger(__name__)


@dataclass
class RankInfo:
    """What a trace says about one rank, beyond its events."""

    rank: int
    host: str = "unknown"
    local_rank: int | None = None
    pid: int | None = None
    device: str | None = None
    device_name: str | None = None
    start_ns: int | None = None


def check_out_dir(out: Path) -> None:
    """Refuse to overwrite: ``out`` must not exist, or be an empty directory outside any run."""
    try:
        layout.check_new_run_dir(out)
    except OutputError as exc:
        raise IngestError(str(exc)) from None


def _cannot_write(exc: OSError, where: Path) -> OutputError:
    return OutputError(f"{exc.filename or where}: cannot write ({exc.strerror or exc})")


class StagedRun:
    """A temporary run directory next to ``out``; moved to ``out`` on a clean exit, removed otherwise."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        check_out_dir(self.out)
        # Unique, so that two imports into directories of the same name never pass for one run.
        self.run_id = f"{self.out.name}-{uuid.uuid4().hex[:12]}"
        self.path = self.out.parent / f".{self.out.name}.ingest-{os.getpid()}.tmp"
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                shutil.rmtree(self.path)
            self.path.mkdir()
        except OSError as exc:
            shutil.rmtree(self.path, ignore_errors=True)
            raise _cannot_write(exc, self.out) from None

    def __enter__(self) -> StagedRun:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, MegascopeError):
                raise _cannot_write(exc, self.out) from None
            return
        try:
            check_out_dir(self.out)
            if self.out.exists():
                self.out.rmdir()
            os.replace(self.path, self.out)
        except BaseException as failed:
            # Nothing left behind: the staging directory goes, whatever stopped the rename.
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(failed, OSError):
                raise _cannot_write(failed, self.out) from None
            raise


def write_rank_tables(run_dir: Path, plan: GroupPlan, infos: Mapping[int, RankInfo], run_id: str | None = None) -> None:
    """One ``ranks`` file and one ``groups`` file per rank of the job (silent ranks included)."""
    for rank in range(plan.world_size):
        info = infos.get(rank) or RankInfo(rank=rank)
        coords = plan.coords.get(rank, {})
        row = {
            "rank": rank,
            "host": info.host,
            "local_rank": info.local_rank,
            "pid": info.pid,
            "device": info.device,
            "device_name": info.device_name,
            "coords": coords,
            "started_at_ns": info.start_ns,
        }
        layout.write_part(run_dir, "ranks", pa.Table.from_pylist([row], schema=schema.RANKS), rank=rank,
                          run_id=run_id)
        groups = [
            {"rank": rank, "group": gid, "kind": kind, "group_rank": members.index(rank), "members": list(members)}
            for gid, kind, members in plan.rank_groups(rank)
        ]
        if groups:
            layout.write_part(run_dir, "groups", pa.Table.from_pylist(groups, schema=schema.GROUPS), rank=rank,
                              run_id=run_id)


def write_rows(run_dir: Path, table: str, rows: Iterable[dict[str, object]] | pa.Table, rank: int,
               run_id: str | None = None) -> int:
    """Write ``rows`` as one part of ``table`` for ``rank``; returns the row count (0 writes nothing)."""
    data = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows), schema=schema.TABLES[table])
    if data.num_rows and table == "spans":  # with its sums, as the collector writes them
        layout.write_spans_part(run_dir, data, rank=rank, run_id=run_id)
    elif data.num_rows:
        layout.write_part(run_dir, table, data, rank=rank, run_id=run_id)
    return int(data.num_rows)
