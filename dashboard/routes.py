"""URLs of the dashboard: ``/run/<id>/<page>?ranks=...&steps=...``, parsed and built in one place.

Role in the data flow: the shell's router and every link use these helpers. A URL names a run by
its registry id and a selection by numbers; it never carries a path, and a malformed selection
becomes a :class:`~megascope.errors.ConfigError` the page shows in one line.

Example::

    run_id, page = parse_path("/run/demo/timeline")       # ("demo", "timeline")
    href("demo", "timeline", ranks=[4, 5], steps=(3, 3))   # "/run/demo/timeline?ranks=4,5&steps=3"
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs, urlencode

from megascope.errors import ConfigError

PAGES = ("overview", "heatmap", "stragglers", "topology", "timeline", "health")
PAGE_TITLES = {
    "overview": "Overview",
    "heatmap": "Heat-map",
    "stragglers": "Stragglers",
    "topology": "Topology",
    "timeline": "Timeline",
    "health": "Health",
}
MAX_SELECTED_RANKS = 64


def parse_path(pathname: str | None) -> tuple[str | None, str]:
    """``(run id or None, page)`` of a dashboard path; unknown shapes give the overview of no run."""
    parts = [p for p in (pathname or "/").split("/") if p]
    if len(parts) >= 2 and parts[0] == "run":
        page = parts[2] if len(parts) >= 3 else "overview"
        return parts[1], page
    return None, "overview"


def href(run_id: str, page: str, *, ranks: Sequence[int] | None = None,
         steps: tuple[int, int] | None = None) -> str:
    query = selection_query(ranks, steps)
    return f"/run/{run_id}/{page}" + (f"?{query}" if query else "")


def selection_query(ranks: Sequence[int] | None, steps: tuple[int, int] | None) -> str:
    params = {}
    if ranks:
        params["ranks"] = format_ranks(ranks)
    if steps is not None:
        params["steps"] = str(steps[0]) if steps[0] == steps[1] else f"{steps[0]}-{steps[1]}"
    return urlencode(params, safe=",-")


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``."""
    out: list[str] = []
    ordered = sorted(set(int(r) for r in ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def parse_ranks(text: str | None, *, world_size: int) -> list[int] | None:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``; None for empty text. Bounded by the world and the cap."""
    if text is None or not text.strip():
        return None
    ranks: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo_text, sep, hi_text = item.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise ConfigError(f"ranks {text!r}: {item!r} is not a rank or a range like 4-7") from None
        if lo > hi or lo < 0 or hi >= world_size:
            raise ConfigError(f"ranks {text!r}: {item!r} is outside 0-{world_size - 1}")
        if hi - lo + 1 + len(ranks) > MAX_SELECTED_RANKS:
            raise ConfigError(f"ranks {text!r}: at most {MAX_SELECTED_RANKS} ranks on one timeline")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks) or None


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``"3"`` -> ``(3, 3)``, ``"3-5"`` -> ``(3, 5)``; None for empty text."""
    if text is None or not text.strip():
        return None
    lo_text, sep, hi_text = text.strip().partition("-")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise ConfigError(f"steps {text!r}: expected a step or a range like 3-5") from None
    if lo < 0 or hi < lo:
        raise ConfigError(f"steps {text!r}: expected 0 <= first <= last")
    if hi - lo >= 20:
        raise ConfigError(f"steps {text!r}: at most 20 steps on one timeline")
    return lo, hi


def query_params(search: str | None) -> dict[str, str]:
    """The first value of each parameter of ``?a=1&b=2``."""
    parsed = parse_qs((search or "").lstrip("?"), keep_blank_values=False)
    return {k: v[0] for k, v in parsed.items() if v}
