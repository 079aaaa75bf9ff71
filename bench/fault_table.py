"""Planted hangs and freezes against what ``localize`` names: markers alone, flight recorder alone, joined.

Reads run directories of the bundled trainer (their run.json holds the planted fault) and prints a
markdown table, one row per run, plus a JSON line per run with ``--json``. Used by
``bench/gpu_faults.sh`` on GPUs and by hand on CPU runs:

    python bench/fault_table.py runs/fault-*            # table
    python bench/fault_table.py --json runs/fault-*     # one JSON object per run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megascope.analysis.hang import localize
from megascope.analysis.witness import flight_recorder_hang, frame_text
from megascope.errors import MegascopeError
from megascope.inject import parse_inject
from megascope.store import open_run


def mesh_text(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}{n}" for a, n in sizes.items() if n > 1) or "1 rank"


def one(path: Path) -> dict[str, object]:
    run = open_run(path)
    specs = [s for s in (run.meta.config or {}).get("inject", []) if s.split(":")[0] in ("hang", "freeze")]
    planted = parse_inject(specs[0]) if specs else None
    markers = localize(run, witnesses=False)
    fr = flight_recorder_hang(run)
    joined = localize(run)
    want = planted.rank if planted else None
    first = joined["suspects"][0] if joined["suspects"] else None
    stack = first.get("stack") if first else None
    return {
        "run": path.name,
        "mesh": mesh_text(dict(run.meta.mesh_sizes or {})),
        "planted": planted.spec() if planted else "none",
        "markers": [s["rank"] for s in markers["suspects"]] if markers["hung"] else [],
        "flight_recorder": ([s["rank"] for s in fr["suspects"]] if fr and fr["hung"] else
                            (f"error: {fr['error']}" if fr and fr["error"] else ([] if fr else None))),
        "fr_dumps": fr["dumps"] if fr else 0,
        "joined": [s["rank"] for s in joined["suspects"]] if joined["hung"] else [],
        "markers_first_right": bool(markers["hung"] and markers["suspects"] and markers["suspects"][0]["rank"] == want),
        "joined_first_right": bool(joined["hung"] and first is not None and first["rank"] == want),
        "state": first["state"] if first else None,
        "stack": frame_text(stack["frames"][0]) if stack and stack.get("frames") else None,
        "waited_s": joined.get("waited_s"),
    }


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    paths = [Path(a) for a in argv if a != "--json"]
    rows = []
    for p in paths:
        try:
            rows.append(one(p))
        except (MegascopeError, OSError) as exc:
            rows.append({"run": p.name, "error": str(exc).splitlines()[0]})
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print("| run | mesh | planted | markers alone | flight recorder | joined | first right (markers / joined) "
          "| state | culprit's innermost frame |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['run']} | | | error: {r['error']} | | | | | |")
            continue
        print(f"| {r['run']} | {r['mesh']} | {r['planted']} | {r['markers']} | {r['flight_recorder']} "
              f"({r['fr_dumps']} dumps) | {r['joined']} | {'yes' if r['markers_first_right'] else 'NO'} / "
              f"{'yes' if r['joined_first_right'] else 'NO'} | {r['state']} | {r['stack']} |")
    ok = [r for r in rows if "error" not in r]
    print(f"\nplanted rank first: markers alone {sum(bool(r['markers_first_right']) for r in ok)}/{len(rows)}, "
          f"joined {sum(bool(r['joined_first_right']) for r in ok)}/{len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
