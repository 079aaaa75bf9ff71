"""Which ranks an ``--around-stragglers`` export keeps: the stragglers and the peers they make wait.

Role in the data flow: used by :mod:`megascope.export.selection` only. The stragglers are the ones
``megascope.analysis.stragglers`` names (worst first, at most :data:`MAX_STRAGGLERS`), so an export
around them shows the ranks the report names. The peers are every rank that shares a collective
group with a straggler (the world group aside: it would keep everyone) plus its point-to-point
partners (the pipeline neighbours that wait in ``recv``).
"""

from __future__ import annotations

import logging

from megascope.analysis.stragglers import stragglers as named_stragglers
from megascope.store import Run

log = logging.getLogger(__name__)

MAX_STRAGGLERS = 8


def find_stragglers(run: Run) -> list[int]:
    """The ranks the straggler analysis names, worst first (at most :data:`MAX_STRAGGLERS`)."""
    frame = named_stragglers(run.with_cursor())
    return [int(r) for r in frame["rank"].tolist()][:MAX_STRAGGLERS]


def straggler_neighbourhood(run: Run) -> tuple[list[int], set[int]]:
    """``(stragglers, ranks to keep)``: the stragglers and every peer that waited for them."""
    stragglers = find_stragglers(run)
    if not stragglers:
        log.warning("no stragglers found; --around-stragglers keeps every rank")
        return [], {int(r) for (r,) in run.cursor().execute("SELECT DISTINCT rank FROM spans").fetchall()}
    listed = ", ".join(str(int(r)) for r in stragglers)
    rows = run.cursor().execute(
        f"""
        SELECT DISTINCT rank FROM spans
        WHERE rank IN ({listed})
           OR peer IN ({listed})
           OR "group" IN (SELECT DISTINCT "group" FROM spans
                          WHERE rank IN ({listed}) AND kind = 'collective'
                            AND "group" IS NOT NULL AND "group" <> 'world')
        UNION SELECT DISTINCT peer FROM spans WHERE rank IN ({listed}) AND peer IS NOT NULL
        """
    ).fetchall()
    return stragglers, {int(r) for (r,) in rows if r is not None}
