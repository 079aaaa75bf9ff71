"""The hang's other witnesses in a run directory: NCCL flight-recorder dumps and Python stacks.

Role in the data flow: :func:`megascope.analysis.localize` reads the markers first; this module
adds what the job left beside them.

* ``RUN/flight_recorder/rank_N``: torch's flight-recorder dumps, written by its C++ watchdog on a
  collective timeout (the collector and the bundled trainer turn this on,
  :func:`megascope.collectors.evidence.enable_nccl_flight_recorder`). :func:`flight_recorder_hang`
  imports them into a scratch run and localizes the hang there, from torch's own sequence
  numbers; its groups are mapped back to this run's by their members.
* ``RUN/stacks/rank=N.txt``: every thread's Python stack, dumped by faulthandler when a step
  stalled (:class:`megascope.collectors.evidence.StackWatch`). :func:`read_stacks` returns the
  training thread's frames, innermost first.

Example::

    from megascope.analysis.witness import flight_recorder_hang, read_stacks
    flight_recorder_hang(run)["suspects"][0]["rank"]
    read_stacks(run.path, 5)["frames"][0]   # {"file": ".../faults.py", "line": 95, "function": "freeze"}
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from megascope.errors import MegascopeError
from megascope.store import Run

log = logging.getLogger(__name__)

FLIGHT_RECORDER_DIR = "flight_recorder"
STACKS_DIR = "stacks"
_HEADER = re.compile(r"^# megascope stacks (?P<fields>.*)$")
_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.+)$')
MAX_STACK_BYTES = 4 << 20


def read_stacks(run_path: Path, rank: int) -> dict[str, Any] | None:
    """The stall dump of ``rank``: step, when the watch was armed, and the frames innermost first
    (``file``, ``line``, ``function``) of the training thread, or of the autograd thread that runs
    the backward the training thread waits for (``thread`` says which); None when it has none."""
    path = run_path / STACKS_DIR / f"rank={rank:05d}.txt"
    try:
        if path.stat().st_size > MAX_STACK_BYTES:
            return None
        text = path.read_text(errors="replace")
    except OSError:
        return None
    header: dict[str, str] = {}
    threads: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for line in text.splitlines():
        if m := _HEADER.match(line):
            header = dict(f.split("=", 1) for f in m.group("fields").split() if "=" in f)
            threads, current = {}, None  # a later dump replaces an earlier one
        elif m := _THREAD.match(line):
            current = threads.setdefault(m.group("ident").lower(), [])
        elif (m := _FRAME.match(line)) and current is not None:
            current.append({"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function")})
    if not threads:
        return None
    ident = header.get("thread", "").lower()
    frames = threads.get(ident)
    if frames is None:  # the header's thread not found: the longest stack is the likeliest
        frames = max(threads.values(), key=len)
    thread = "training"
    if frames and _waits_on_autograd(frames[0]):
        # The training thread waits for backward: the work (and a hook that stopped) is on an
        # autograd thread, the one busy stack that is not a sleeping helper thread.
        busy = [f for i, f in threads.items() if i != ident and f and not _idle(f[0])]
        if busy:
            frames, thread = max(busy, key=len), "autograd"
    return {
        "thread": thread,
        "step": _int(header.get("step")),
        "armed_ns": _int(header.get("armed_ns")),
        "after_s": _float(header.get("after_s")),
        "threads": len(threads),
        "frames": frames,
    }


_IDLE_FILES = ("threading.py", "queue.py", "selectors.py", "socket.py")


def _idle(frame: dict[str, Any]) -> bool:
    """A helper thread parked in a wait (the collector's writer, a data loader, a sampler)."""
    return str(frame["file"]).endswith(_IDLE_FILES) or frame["function"] == "<no Python frame>"


def _waits_on_autograd(frame: dict[str, Any]) -> bool:
    return str(frame["function"]) == "_engine_run_backward" or str(frame["file"]).endswith("autograd/graph.py")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def frame_text(frame: dict[str, Any]) -> str:
    """``faults.py:95 freeze``: a frame in one short line (the file's last two path parts)."""
    parts = Path(str(frame["file"])).parts
    short = "/".join(parts[-2:]) if len(parts) > 1 else str(frame["file"])
    return f"{short}:{frame['line']} {frame['function']}"


def flight_recorder_hang(run: Run) -> dict[str, Any] | None:
    """Localize the hang from the run's flight-recorder dumps alone; None when it has none.

    Keys: ``dumps`` (ranks that wrote one), ``hung``, ``suspects`` (as :func:`localize`'s, with
    ``group`` mapped to this run's group of the same members where there is one, and the
    recorder's own name in ``fr_group``), ``error`` (why the dumps could not be read, else None).
    """
    src = run.path / FLIGHT_RECORDER_DIR
    try:
        if not src.is_dir() or not any(p.is_file() and not p.name.startswith(".") for p in src.iterdir()):
            return None
    except OSError:
        return None
    # Deferred: the hang localization imports this module (its witnesses), and the importer is
    # needed only where a run has dumps.
    from megascope.analysis.hang import localize, where_text
    from megascope.ingest.flight_recorder import ingest_flight_recorder
    from megascope.store import open_run

    meta = run.meta
    mesh = {a: int(n) for a, n in (meta.mesh_sizes or {}).items() if int(n) > 0} or None
    with tempfile.TemporaryDirectory(prefix="megascope-fr-") as scratch:
        out = Path(scratch) / "run"
        try:
            result = ingest_flight_recorder(src, out, mesh=mesh, world_size=meta.world_size)
            fr_run = open_run(out)
            found = localize(fr_run, witnesses=False)
        except (MegascopeError, OSError, ValueError) as exc:
            return {"dumps": 0, "missing": [], "hung": False, "suspects": [],
                    "error": str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}
        ours = _groups_by_members(run)
        suspects = []
        for s in found["suspects"]:
            members = _members(fr_run, s["group"])
            group = ours.get(members, s["group"]) if members else s["group"]
            where = str(s.get("where") or "")
            if s.get("missing_seq") is not None or not where or where.startswith("stuck in"):
                where = where_text(group, s.get("missing_seq"))  # in the run's group's name
            s = dict(s, fr_group=s["group"], group=group, where=where)
            suspects.append(s)
        return {"dumps": len(result.ranks_found), "missing": list(result.missing_ranks), "hung": found["hung"],
                "suspects": suspects, "error": None}


def _members(run: Run, group: str) -> frozenset[int] | None:
    rows = run.cursor().execute('SELECT members FROM groups WHERE "group" = ? LIMIT 1', [group]).fetchall()
    return frozenset(int(m) for m in rows[0][0]) if rows and rows[0][0] is not None else None


def _groups_by_members(run: Run) -> dict[frozenset[int], str]:
    """This run's group ids by member set; where two groups share members (dp and world on two
    ranks), the narrower kind wins (tp, pp, dp before world)."""
    order = {"tp": 0, "cp": 1, "ep": 2, "pp": 3, "dp": 4, "world": 9}
    out: dict[frozenset[int], tuple[int, str]] = {}
    rows = run.cursor().execute('SELECT DISTINCT "group", kind, members FROM groups').fetchall()
    for group, kind, members in rows:
        if members is None or str(group).startswith("fr:"):
            continue
        key = frozenset(int(m) for m in members)
        rank_of = order.get(str(kind), 5)
        if key not in out or rank_of < out[key][0]:
            out[key] = (rank_of, str(group))
    return {k: v[1] for k, v in out.items()}
