"""Judge self-test results against peers and name the suspect ranks.

Role in the data flow: the pure middle of ``megascope diagnose`` (no torch, no duckdb, no pandas:
it runs on rank 0 of the job). Input and output are diagnostics rows as dicts with the columns of
``schema.DIAGNOSTICS`` plus ``device_name`` and ``coords``.

* Per-rank tests (gemm, membw, h2d, d2d): a rank is an outlier when its value is below
  ``(1 - tolerance)`` times the median of ranks with the same device name.
* All-reduce: a group's speed is its slowest member's measurement (a collective finishes
  together); a group is slow when below ``(1 - tolerance)`` times the median of groups of the same
  kind and size. Ranks that sit in the most slow groups are the suspects (a slow rank slows its
  TP, DP and PP groups alike; a slow link slows one group), and their rows are marked outliers.
* A result that failed its check makes its rank a suspect before any slowness does.

Example::

    rows = mark_outliers(rows, tolerance=0.25)
    for s in suspects(rows): print(s["rank"], s["host"], s["reasons"])
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from megascope.schema import DiagnosticTest

Row = dict[str, Any]

PER_RANK_TESTS = frozenset({DiagnosticTest.GEMM, DiagnosticTest.MEMBW, DiagnosticTest.H2D, DiagnosticTest.D2D})


def _kind(group: str) -> str:
    return group.split(":", 1)[0]


def mark_outliers(rows: Iterable[Row], *, tolerance: float = 0.25) -> list[Row]:
    """Copies of ``rows`` with ``outlier`` set and ``detail`` explaining each outlier."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    out = [dict(r, outlier=False) for r in rows]
    floor = 1.0 - tolerance

    peers: dict[tuple[str, str | None], list[Row]] = defaultdict(list)
    for r in out:
        if r["test"] in PER_RANK_TESTS and r["value"] is not None:
            peers[(r["test"], r.get("device_name"))].append(r)
    for group_rows in peers.values():
        if len(group_rows) < 2:
            continue
        median = statistics.median(r["value"] for r in group_rows)
        for r in group_rows:
            if median > 0 and r["value"] < floor * median:
                r["outlier"] = True
                r["detail"] = _join(r.get("detail"), f"{r['value']:.3g} {r['unit']} is {r['value'] / median:.0%} "
                                    f"of the median of {len(group_rows)} peers ({median:.3g})")

    by_group: dict[str, list[Row]] = defaultdict(list)
    for r in out:
        if r["test"] == DiagnosticTest.ALLREDUCE and r.get("group") and r["value"] is not None:
            by_group[r["group"]].append(r)
    speed = {g: min(r["value"] for r in rs) for g, rs in by_group.items()}
    families: dict[tuple[str, int], list[str]] = defaultdict(list)
    for g, rs in by_group.items():
        families[(_kind(g), len(rs))].append(g)
    slow: dict[str, float] = {}  # group -> fraction of its family's median
    for groups in families.values():
        if len(groups) < 2:
            continue
        median = statistics.median(speed[g] for g in groups)
        for g in groups:
            if median > 0 and speed[g] < floor * median:
                slow[g] = speed[g] / median
    if slow:
        count: dict[int, int] = defaultdict(int)
        for g in slow:
            for r in by_group[g]:
                count[r["rank"]] += 1
        most = max(count.values())
        for g, frac in slow.items():
            members = sorted(r["rank"] for r in by_group[g])
            for r in by_group[g]:
                if count[r["rank"]] == most:
                    r["outlier"] = True
                    r["detail"] = _join(r.get("detail"), (
                        f"group {g} (ranks {_ranks(members)}) at {speed[g]:.3g} GB/s, {frac:.0%} of the median "
                        f"{_kind(g)} group; rank {r['rank']} is in {most} of {len(slow)} slow groups"))
    return out


def _join(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


def _ranks(members: list[int]) -> str:
    return ", ".join(map(str, members[:8])) + (" ..." if len(members) > 8 else "")


def suspects(rows: Iterable[Row]) -> list[Row]:
    """Ranks to look at, most likely first: ``{rank, host, coords, reasons}``.

    Failed checks weigh most, then slow per-rank tests (by how slow), then slow groups.
    """
    score: dict[int, float] = defaultdict(float)
    reasons: dict[int, list[str]] = defaultdict(list)
    where: dict[int, Row] = {}
    for r in rows:
        rank = r.get("rank")
        if rank is None:
            continue
        where.setdefault(rank, r)
        label = r["test"] + (f" {r['group']}" if r.get("group") else "")
        if r.get("ok") is False:
            score[rank] += 100.0
            reasons[rank].append(f"{label} failed: {r.get('detail') or 'wrong result'}")
        elif r.get("outlier"):
            score[rank] += 10.0 if r["test"] in PER_RANK_TESTS else 1.0
            reasons[rank].append(f"{label} slow: {r.get('detail')}")
    ranked = sorted(score, key=lambda k: (-score[k], k))
    return [{"rank": k, "host": where[k]["host"], "coords": where[k].get("coords") or {},
             "reasons": reasons[k]} for k in ranked]
