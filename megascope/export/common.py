"""What both exporters share: their result record, the output target and the run argument.

Role in the data flow: :mod:`megascope.export.perfetto` and :mod:`megascope.export.chrome` write
through :func:`output_stream`, which makes a file appear whole or not at all (a temporary name in
the same directory, renamed at the end), or writes straight into a caller's binary stream (the
dashboard's download buffer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from megascope import layout
from megascope.errors import ExportError
from megascope.export.selection import Selection
from megascope.store import Run, open_run


@dataclass
class ExportStats:
    """What an export wrote."""

    format: str  # "perfetto" or "chrome"
    ranks: int = 0
    spans: int = 0
    flows: int = 0  # spans carrying a flow link (collective members, sends, receives)
    tracks: int = 0
    counter_samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    clock_correction: str = ""
    selection: str = "all"
    stragglers: list[int] = field(default_factory=list)

    @property
    def spans_per_s(self) -> float:
        return self.spans / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "spans_per_s": round(self.spans_per_s)}


class CountingWriter:
    """Counts the bytes written through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.raw.write(data)
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        self.bytes += n
        return n


@contextlib.contextmanager
def output_stream(out: Path | str | IO[bytes]) -> Iterator[CountingWriter]:
    """A binary stream to write the export into; a path appears only once complete."""
    if not isinstance(out, str | os.PathLike):
        yield CountingWriter(out)
        return
    path = Path(out)
    if path.is_dir():
        raise ExportError(f"{path}: is a directory; give a file name")
    outer = layout.enclosing_run(path.parent)
    if outer is not None:
        raise ExportError(f"{path}: inside the run directory {outer}; write exports outside the run")
    if not path.parent.exists():
        raise ExportError(f"{path.parent}: no such directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield CountingWriter(f)
        os.replace(tmp, path)
    except OSError as exc:
        raise ExportError(f"{path}: cannot write ({exc.strerror or exc})") from None
    finally:
        tmp.unlink(missing_ok=True)


def as_run(run: Run | Path | str) -> Run:
    return run if isinstance(run, Run) else open_run(run)


def make_selection(
    ranks: Iterable[int] | None,
    steps: tuple[int, int] | None,
    window: tuple[int, int] | None,
    around_stragglers: bool,
) -> Selection:
    return Selection(
        ranks=None if ranks is None else tuple(int(r) for r in ranks),
        steps=None if steps is None else (int(steps[0]), int(steps[1])),
        window=None if window is None else (int(window[0]), int(window[1])),
        around_stragglers=around_stragglers,
    )
