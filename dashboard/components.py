"""Small building blocks the pages share: notices, metric cards, tables, and error containment.

Role in the data flow: presentation only. :func:`contained` wraps a callback body so that a run
the analysis cannot read yet (a job that has written two spans) shows one line on the page
instead of a failed callback and a console error.

Example::

    card("MFU", "41.3 %", "mean over 40 steps")
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pandas as pd
from dash import dcc, html

from megascope.errors import MegascopeError

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def notice(text: str, kind: str = "info") -> html.Div:
    """A one-line message; ``kind`` is info, warn or error (styled in assets/style.css)."""
    return html.Div(text, className=f"notice notice-{kind}")


def card(title: str, value: str, sub: str = "", *, kind: str = "") -> html.Div:
    return html.Div(
        [html.Div(title, className="card-title"), html.Div(value, className="card-value"),
         html.Div(sub, className="card-sub")],
        className=f"card {kind}".strip(),
    )


def contained(*fallbacks: Any) -> Callable[[F], F]:
    """Turn an exception inside a callback into ``fallbacks`` plus a notice in the last output.

    The decorated callback's *last* output must accept children; the others get ``fallbacks``.
    A MegascopeError is the user's to act on (shown as it is); anything else is logged with its
    traceback and shown as an internal error.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except MegascopeError as exc:
                shown: Any = notice(str(exc), "warn")
            except Exception as exc:  # noqa: BLE001 - a page must never die with a traceback
                log.exception("callback %s failed", fn.__name__)
                shown = notice(f"internal error in {fn.__name__}: {type(exc).__name__}: {exc}", "error")
            return (*fallbacks, shown) if fallbacks else shown

        return inner  # type: ignore[return-value]

    return wrap


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value)


def table(frame: pd.DataFrame, *, id: str, columns: Sequence[str] | None = None, max_rows: int = 200,
          names: Mapping[str, str] | None = None,
          links: Mapping[str, Callable[[dict[str, Any]], str]] | None = None) -> html.Table:
    """A plain HTML table of at most ``max_rows`` rows of ``frame`` (dicts and lists flattened to text).

    ``links`` maps a column to a function of the row giving an href: that cell becomes a link
    (the straggler table links each rank to its timeline).
    """
    columns = [c for c in (columns if columns is not None else frame.columns) if c in frame.columns]
    names, links = names or {}, links or {}
    header = html.Thead(html.Tr([html.Th(names.get(c, c)) for c in columns]))
    rows = []
    for raw in frame[columns].head(max_rows).to_dict("records"):
        record = {str(k): v for k, v in raw.items()}
        cells = []
        for c in columns:
            text = _cell(record[c])
            cells.append(html.Td(dcc.Link(text, href=links[c](record)) if c in links else text))
        rows.append(html.Tr(cells))
    footer = [html.Caption(f"first {max_rows} of {len(frame)} rows", className="hint")] if len(frame) > max_rows else []
    return html.Table([*footer, header, html.Tbody(rows)], id=id, className="table")
