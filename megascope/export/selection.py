"""What part of a run an export covers, and the host clock offsets it applies.

Role in the data flow: both exporters (Perfetto and Chrome JSON) and the dashboard's "download this
selection" turn their options into a :class:`Selection`, then :func:`resolve` it against an opened
run: which ranks, which steps, which time window (in corrected time), and the per-rank clock offset.

The clock is chosen explicitly: ``"estimated"`` (the default) adds each host's offset from
``megascope.analysis.base.estimate_clock_offsets`` (the analysis' estimate, without its other base
tables), and an estimate that fails stops the export with one line naming ``--clock raw``;
``"raw"`` keeps the host clocks as recorded. The metadata of every export states which.

Example::

    sel = Selection(ranks=parse_ranks("0-7,12"), steps=parse_steps("10-20"))
    resolved = resolve(run, sel)
    resolved.rank_offsets_ns[12]      # ns added to rank 12's times
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pandas as pd

from megascope.analysis.base import estimate_clock_offsets
from megascope.errors import ConfigError, ExportError
from megascope.export.stragglers import straggler_neighbourhood
from megascope.store import Run
from megascope.topology import coords_of

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


@dataclass(frozen=True, kw_only=True)
class Selection:
    """A subset of a run. ``None`` means everything along that axis.

    ``window`` is ``(start_ns, end_ns)`` in corrected epoch nanoseconds; a span is kept when it
    overlaps the window (spans are never clipped). ``steps`` is an inclusive ``(first, last)``.
    """

    ranks: tuple[int, ...] | None = None
    steps: tuple[int, int] | None = None
    window: tuple[int, int] | None = None
    around_stragglers: bool = False

    def __post_init__(self) -> None:
        if self.ranks is not None:
            if not self.ranks:
                raise ConfigError("the rank selection is empty")
            if min(self.ranks) < 0:
                raise ConfigError(f"ranks must be >= 0, got {min(self.ranks)}")
            object.__setattr__(self, "ranks", tuple(sorted(set(self.ranks))))
        if self.steps is not None and self.steps[0] > self.steps[1]:
            raise ConfigError(f"step range {self.steps[0]}-{self.steps[1]} is empty")
        if self.window is not None and self.window[0] >= self.window[1]:
            raise ConfigError(f"time window {self.window} is empty (start must be before end)")

    def describe(self) -> str:
        parts = []
        if self.ranks is not None:
            parts.append(f"ranks={format_ranks(self.ranks)}")
        if self.steps is not None:
            parts.append(f"steps={self.steps[0]}-{self.steps[1]}")
        if self.window is not None:
            parts.append(f"window_ns={self.window[0]}:{self.window[1]}")
        if self.around_stragglers:
            parts.append("around_stragglers")
        return " ".join(parts) or "all"


def parse_ranks(spec: str) -> tuple[int, ...]:
    """``"0-7,12,40-41"`` -> the ranks it names."""
    ranks: list[int] = []
    for part in spec.split(","):
        m = _RANGE.match(part)
        if not m:
            raise ConfigError(f"bad rank list {spec!r}: expected e.g. 0-7,12")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"bad rank range {part.strip()!r} in {spec!r}: end before start")
        ranks.extend(range(lo, hi + 1))
    return tuple(ranks)


def parse_steps(spec: str) -> tuple[int, int]:
    """``"10-20"`` or ``"15"`` -> an inclusive step range."""
    m = _RANGE.match(spec)
    if not m:
        raise ConfigError(f"bad step range {spec!r}: expected e.g. 10-20 or 15")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise ConfigError(f"bad step range {spec!r}: end before start")
    return lo, hi


def parse_window(spec: str) -> tuple[float, float]:
    """``"12.5:14"`` -> seconds since the start of the run (resolved against the run later)."""
    try:
        start_s, end_s = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"bad time window {spec!r}: expected START:END in seconds, e.g. 12.5:14") from None
    if not (np.isfinite(start_s) and np.isfinite(end_s)) or end_s <= start_s:
        raise ConfigError(f"bad time window {spec!r}: END must be after START")
    return start_s, end_s


def format_ranks(ranks: tuple[int, ...]) -> str:
    """The inverse of :func:`parse_ranks`, compact: ``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r == prev + 1:
            prev = r
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = r
    out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


@dataclass
class Resolved:
    """A selection made concrete against one run."""

    ranks: npt.NDArray[np.int64]  # selected ranks that exist in the ranks table or wrote spans, sorted
    steps: tuple[int, int] | None
    window: tuple[int, int] | None  # corrected ns
    rank_offsets_ns: npt.NDArray[np.int64]  # indexed by rank, 0 for unknown ranks
    host_offsets: dict[str, tuple[int, int | None]]  # host -> (offset_ns, error_ns)
    clock_source: str  # CLOCK_ESTIMATED or CLOCK_RAW
    shift_ns: int = 0  # added to every time (already inside rank_offsets_ns) so none is negative
    stragglers: list[int] = field(default_factory=list)
    selection: Selection = field(default_factory=Selection)
    rank_info: dict[int, tuple[str, dict[str, int]]] = field(default_factory=dict)  # rank -> (host, coords in axis order)

    @property
    def max_abs_offset_ns(self) -> int:
        return int(np.abs(self.rank_offsets_ns).max()) if len(self.rank_offsets_ns) else 0

    def span_filter_sql(self, *, margin_ns: int | None = None) -> str:
        """A WHERE clause over ``spans`` (raw times): a superset, exact after correction in numpy."""
        clauses = []
        if self.steps is not None:
            clauses.append(f"step BETWEEN {int(self.steps[0])} AND {int(self.steps[1])}")
        if self.window is not None:
            margin = self.max_abs_offset_ns + self.shift_ns if margin_ns is None else margin_ns
            clauses.append(f"start_ns <= {int(self.window[1]) + margin}")
            clauses.append(f"start_ns + dur_ns >= {int(self.window[0]) - margin}")
        return " AND ".join(clauses) if clauses else "TRUE"

    def metadata(self) -> dict[str, Any]:
        """How the times in the trace were made: stated in every export."""
        return {
            "clock_correction": self.clock_source,
            "clock_offsets_ns": {h: {"offset_ns": o, "error_ns": e} for h, (o, e) in sorted(self.host_offsets.items())},
            "time_shift_ns": self.shift_ns,
            "selection": self.selection.describe(),
            "stragglers": self.stragglers,
        }


CLOCKS = ("estimated", "raw")
CLOCK_ESTIMATED = "estimated (host offsets from collective completions)"
CLOCK_RAW = "raw (host clocks as recorded)"


def _clock_offsets(run: Run) -> dict[str, tuple[int, int | None]]:
    """Each host's estimated offset and error bound; a failure is an :class:`ExportError`."""
    try:
        frame = estimate_clock_offsets(run.cursor(), lambda ranks: run.rank_source("spans", ranks))
    except (duckdb.Error, np.linalg.LinAlgError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{run.path}: cannot estimate the hosts' clock offsets ({first_line}); "
                          "--clock raw exports the host clocks as recorded") from None
    offsets: dict[str, tuple[int, int | None]] = {}
    for host, offset, error in zip(frame["host"], frame["offset_ns"], frame["error_ns"], strict=True):
        if offset is None or pd.isna(offset):  # host without an estimate
            continue
        offsets[str(host)] = (int(offset), None if error is None or pd.isna(error) else int(error))
    return offsets


def _run_start_ns(run: Run) -> int:
    (first,) = run.cursor().execute("SELECT min(start_ns) FROM spans").fetchone() or (None,)
    if first is None:
        if run.meta.start_ns is None:
            raise ExportError(f"{run.path}: no spans and no start time; a window cannot be placed")
        return int(run.meta.start_ns)
    return int(first)


def window_from_seconds(run: Run, start_s: float, end_s: float) -> tuple[int, int]:
    """A window given in seconds since the run's first span, as epoch nanoseconds."""
    origin = _run_start_ns(run)
    return origin + int(start_s * 1e9), origin + int(end_s * 1e9)


# Epoch nanoseconds after 1973: a run whose clock reads this is on wall-clock time, where no
# clock offset (milliseconds to seconds) can take a span below zero.
EPOCH_FLOOR_NS = 10**17


def _ranks_with_spans(run: Run) -> set[int]:
    """Ranks that have spans, from the store's file lists (part directories, compaction manifests)."""
    return run.ranks_written(("spans",))


def _time_shift(run: Run, rank_offsets: npt.NDArray[np.int64]) -> int:
    """What to add to every corrected time so that none is negative (Perfetto times are unsigned).

    A run on epoch wall-clock time (``run.json`` start time after 1973, offsets far smaller) needs
    none, and no scan of the spans; otherwise the earliest span of each rank decides.
    """
    start = run.meta.start_ns
    lowest = int(rank_offsets.min()) if len(rank_offsets) else 0
    if start is not None and start >= EPOCH_FLOOR_NS and start + lowest >= EPOCH_FLOOR_NS // 2:
        return 0
    firsts = run.cursor().execute("SELECT rank, min(start_ns) FROM spans GROUP BY rank").fetchall()
    corrected = [int(t) + int(rank_offsets[int(r)]) for r, t in firsts if t is not None and int(r) < len(rank_offsets)]
    return max(0, -min(corrected)) if corrected else 0


def check_clock(clock: str) -> None:
    """A :class:`ConfigError` unless ``clock`` is one of :data:`CLOCKS`."""
    if clock not in CLOCKS:
        raise ConfigError(f"unknown clock {clock!r}: expected one of {', '.join(CLOCKS)}")


def spans_to_read(run: Run, selection: Selection) -> Resolved | None:
    """The selected ranks that have spans, known from the store's file lists alone (no query, no
    clock): enough for :func:`megascope.export.source.iter_span_chunks` to read the spans
    ``resolve`` would, on their recorded times, while it reads the ranks table and estimates the
    clock. None where the ranks come from the analysis (``around_stragglers``) or a time window
    (placed in corrected time) is asked for."""
    if selection.around_stragglers or selection.window is not None:
        return None
    ranks = _ranks_with_spans(run)
    if selection.ranks is not None:
        ranks = ranks & set(selection.ranks)
    return Resolved(ranks=np.array(sorted(ranks), dtype=np.int64), steps=selection.steps, window=None,
                    rank_offsets_ns=np.zeros(0, dtype=np.int64), host_offsets={}, clock_source=CLOCK_RAW,
                    selection=selection)


def resolve(run: Run, selection: Selection, *, clock: str = "estimated") -> Resolved:
    """Make ``selection`` concrete for ``run``: ranks, offsets and (if asked) the stragglers.

    ``clock="estimated"`` adds each host's clock offset, estimated from the completions of the
    collectives its ranks share with other hosts (a sample of steps and ranks; an estimate that
    fails is an :class:`ExportError`); ``clock="raw"`` keeps the host clocks as recorded and says so.
    """
    check_clock(clock)
    cur = run.cursor()
    rank_rows = cur.execute("SELECT rank, host, coords FROM ranks ORDER BY rank").fetchall()
    host_rows = [(r, h) for r, h, *_ in rank_rows]
    known = _ranks_with_spans(run) | {int(r) for r, _ in host_rows}
    if clock == "estimated":
        host_offsets, source = _clock_offsets(run), CLOCK_ESTIMATED
    else:
        host_offsets, source = {}, CLOCK_RAW
    size = max([*known, run.meta.world_size - 1, 0]) + 1
    rank_offsets = np.zeros(size, dtype=np.int64)
    for rank, host in host_rows:
        if host in host_offsets:
            rank_offsets[int(rank)] = host_offsets[host][0]

    # Trace timestamps are unsigned: a run whose corrected times go below zero (relative clocks)
    # is shifted as a whole, and the metadata says by how much.
    shift = _time_shift(run, rank_offsets)
    rank_offsets += shift

    ranks = sorted(known)
    stragglers: list[int] = []
    if selection.around_stragglers:
        stragglers, around = straggler_neighbourhood(run)
        ranks = [r for r in ranks if r in around]
    if selection.ranks is not None:
        missing = sorted(set(selection.ranks) - known)
        if missing and len(missing) == len(selection.ranks):
            raise ConfigError(f"none of the selected ranks exist in {run.path} (ranks 0-{size - 1})")
        if missing:
            log.warning("selected ranks not in the run, ignored: %s", format_ranks(tuple(missing)))
        chosen = set(selection.ranks)
        ranks = [r for r in ranks if r in chosen]
    return Resolved(
        ranks=np.array(ranks, dtype=np.int64),
        steps=selection.steps,
        window=selection.window,
        rank_offsets_ns=rank_offsets,
        host_offsets=host_offsets,
        clock_source=source,
        shift_ns=shift,
        stragglers=stragglers,
        selection=selection,
        rank_info={int(r): (h, coords_of(c, run.meta.mesh_axes)) for r, h, c in rank_rows},
    )
