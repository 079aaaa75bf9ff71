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
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pandas as pd
from dash import dash_table, html

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


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return value


def table(frame: pd.DataFrame, *, id: str, columns: Sequence[str] | None = None, page_size: int = 20,
          names: dict[str, str] | None = None) -> Any:
    """A sortable, paged table of ``frame`` (dicts and lists flattened to text)."""
    columns = list(columns) if columns is not None else list(frame.columns)
    names = names or {}
    shown = frame[columns] if len(frame) else pd.DataFrame(columns=columns)
    records = [{c: _cell(v) for c, v in row.items()} for row in shown.to_dict("records")]
    return dash_table.DataTable(  # type: ignore[attr-defined]
        id=id, data=records, columns=[{"name": names.get(c, c), "id": c} for c in columns],
        page_size=page_size, sort_action="native", style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "4px 8px", "textAlign": "left"},
        style_header={"fontWeight": "600"},
    )
