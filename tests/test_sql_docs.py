"""Every statement of the SQL modules (``megascope/analysis/sql/*.sql``) documents its output
columns with ``-- @column`` lines, and the documented names are the columns it really returns.

A statement that returns rows (SELECT, WITH) or creates a table from a query documents every
column of its result; a ``-- @column a, b, c  text`` line documents several, and ``ex_*_ns``
stands for a family. Statements that return no rows of their own (INSERT into a documented
table, CREATE MACRO) document none. Every statement that yields rows is executed on a synthetic
run and its documented names compared with its result, so a new statement cannot go unchecked.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Iterator
from importlib import resources

import duckdb
import pytest
from conftest import Synth

from megascope import analysis
from megascope.analysis import _sql
from megascope.analysis.runstate import run_state
from megascope.store import open_run

MODULES = sorted(p.name[:-4] for p in resources.files("megascope.analysis").joinpath("sql").iterdir()
                 if p.name.endswith(".sql"))
_COLUMN = re.compile(r"^-- @column\s+([\w*]+(?:\s*,\s*[\w*]+)*)", re.MULTILINE)
_TABLE = re.compile(r"^CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP(?:ORARY)?\s+)?(?:TABLE|VIEW)\s+(\S+)\s+AS\b", re.I)
_NO_ROWS = re.compile(r"^(INSERT|UPDATE|DELETE|DROP|CREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP\s+)?MACRO)\b", re.I)
_ROWS = re.compile(r"^(SELECT|WITH|FROM|VALUES)\b", re.I)


def _code(text: str) -> str:
    """A statement without its comment lines."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--")).strip()


def documented(text: str) -> list[str]:
    """The column names (or ``*`` patterns) that a statement's ``@column`` lines document."""
    return [name.strip() for group in _COLUMN.findall(text) for name in group.split(",")]


def _all_statements() -> list[tuple[str, str, str]]:
    return [(module, name, text) for module in MODULES for name, text in _sql.statements(module).items()]


def test_the_modules_are_found() -> None:
    assert {"base", "stragglers", "hang"} <= set(MODULES)
    assert len(_all_statements()) >= 20


@pytest.mark.parametrize("module,name,text", _all_statements(), ids=lambda v: v if "\n" not in v else "")
def test_every_statement_that_yields_rows_documents_its_columns(module: str, name: str, text: str) -> None:
    code = _code(text)
    if _NO_ROWS.match(code):
        return
    assert _TABLE.match(code) or _ROWS.match(code), \
        f"{module}.sql/{name}: neither a query, a table built from one, nor a statement without rows"
    assert documented(text), f"{module}.sql/{name}: no '-- @column' line for its output"


def _undocumented(columns: list[str], names: list[str]) -> list[str]:
    return [c for c in columns if not any(fnmatch.fnmatchcase(c, n) for n in names)]


def _stale(columns: list[str], names: list[str]) -> list[str]:
    return [n for n in names if not any(fnmatch.fnmatchcase(c, n) for c in columns)]


@pytest.fixture(scope="module")
def executed(synth: Synth, tmp_path_factory: pytest.TempPathFactory,
             monkeypatch_module: pytest.MonkeyPatch) -> dict[tuple[str, str], list[str]]:
    """The output columns of every statement that the public analyses execute on a pipelined run
    with a straggler and a hang, keyed by (module, statement)."""
    seen: dict[tuple[str, str], list[str]] = {}
    execute = _sql.execute

    def recording(con: duckdb.DuckDBPyConnection, module: str, name: str, **params: object) -> duckdb.DuckDBPyConnection:
        result = execute(con, module, name, **params)
        code = _code(_sql.render(module, name, **params))
        table = _TABLE.match(code)
        if table:
            # A fresh cursor: reading the table must not replace the caller's pending result.
            seen[(module, name)] = [r[0] for r in con.cursor().execute(f"DESCRIBE {table.group(1)}").fetchall()]
        elif _ROWS.match(code):
            seen[(module, name)] = [d[0] for d in result.description or []]
        return result

    monkeypatch_module.setattr(_sql, "execute", recording)
    run_dir = synth(tmp_path_factory.mktemp("sqldocs") / "run", "straggler:rank=5,factor=1.3", "hang:rank=9,step=4",
                    ranks=16, steps=6, tp=2, pp=2, seed=5, gpus_per_host=4)
    run = open_run(run_dir)
    analysis.report(run)
    analysis.localize(run)
    # What the report leaves out: the dashboard's views and the CLI's tables.
    analysis.step_times(run)
    analysis.heatmap(run, phase="host", max_ranks=4, max_steps=3)
    analysis.bubbles(run)
    analysis.exposed_comm(run)
    analysis.host_lead(run)
    analysis.pipeline.host_issue(run, steps=[2, 3], ranks=[0, 1])  # the what-if asks it of host-bound jobs only
    analysis.mfu(run)
    analysis.skew(run, limit=10)
    analysis.skew_drift(run)  # without the report's median step: it reads its own
    analysis.whatif(run)
    run_state(run)  # without a localization: it counts the calls in flight itself
    # Branches this run does not take: a drifting collective's ranks (after the report's skew_drift
    # built ms_cache.skew_collectives), tokens logged as metrics rather than given in run.json.
    _sql.execute(run.con, "skew", "growing_ranks", name_index=0).fetchall()
    _sql.execute(run.con, "timeline", "tokens_per_step").fetchall()
    # Asked only of a run with no straggler (the mesh's peers), and where it has none.
    analysis.stragglers_told(run)
    importlib.import_module("megascope.analysis.stragglers").lone_stages_own(run)
    # The steps of a run whose lowest ranks recorded none; extending the base tables of a run that
    # grew (the cached tables loaded as old_*, here copies of the current ones).
    _sql.execute(run.con, "base", "all_steps").fetchall()
    # Asked only where the run's backward is its kernels alone (a Kineto trace of GPU ranks).
    _sql.execute(run.con, "base", "world_only").fetchall()
    for table in ("clock_offsets", "rank_clock", "inst", "rank_step"):
        run.con.execute(f"CREATE OR REPLACE TABLE ms_cache.old_{table} AS SELECT * FROM ms_cache.{table}")
    _sql.execute(run.con, "base", "keep_clock_offsets")
    _sql.execute(run.con, "base", "keep_rank_clock")
    _sql.execute(run.con, "base", "moved_clocks").fetchall()
    _sql.execute(run.con, "base", "calls_across_edge", first=3).fetchall()
    _sql.execute(run.con, "base", "extend_inst", first=3)
    _sql.execute(run.con, "base", "extend_rank_step", first=3)
    # Read only for a rank the rules take for its host on a TP mesh (synth stragglers are compute).
    _sql.execute(run.con, "stragglers", "tp_members").fetchall()
    _sql.execute(run.con, "stragglers", "tp_exclusive", ranks=[4, 5, 6, 7], bar=1.1,
                 spans=_sql.Raw(run.rank_source("spans", [4, 5, 6, 7]))).fetchall()
    # Read only for a rank whose cause the spans' share leaves in doubt.
    _sql.execute(run.con, "stragglers", "outside", ranks=[4, 5],
                 spans=_sql.Raw(run.rank_source("spans", [4, 5]))).fetchall()
    # Read only for a rank named by its spans against its DP peers (a mesh without TP partners).
    _sql.execute(run.con, "stragglers", "step_compute", ranks=[4, 5]).fetchall()
    # Read only for a rank named for its compute on a real run, to tell data arriving late.
    _sql.execute(run.con, "stragglers", "group_members", max_members=64).fetchall()
    _sql.execute(run.con, "stragglers", "device_timed").fetchall()
    _sql.execute(run.con, "stragglers", "late_completion", ranks=[4, 5], steps=[2, 3], max_members=64,
                 spans=_sql.Raw(run.rank_source("spans", [4, 5]))).fetchall()
    _sql.execute(run.con, "stragglers", "compute_outside_calls", ranks=[4, 5], steps=[2, 3],
                 spans=_sql.Raw(run.rank_source("spans", [4, 5]))).fetchall()
    # Asked of the rows only where a marker file's footer does not tell its steps (a footer
    # answers here), and of the newest markers where a hung rank's completions are set aside.
    _sql.execute(run.con, "hang", "markers_beyond", step=0).fetchall()
    # Read only where some rank's trail was lost, and where a suspect wrote nothing at all.
    _sql.execute(run.con, "hang", "rank_trail", ranks=[0, 1]).fetchall()
    _sql.execute(run.con, "hang", "groups_with", rank=1).fetchall()
    importlib.import_module("megascope.analysis.runstate")._last_completion_ns(run.con, run, {9: 2 ** 62})
    # Read only for a rank replayed on a real run (synth runs are not replayed).
    importlib.import_module("megascope.analysis.stragglers").sample_period(run, 5, [2, 3])
    return seen


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_documented_columns_are_the_columns_each_statement_returns(
        executed: dict[tuple[str, str], list[str]]) -> None:
    # The report runs the base tables, stragglers, skew and hang modules: most of the statements.
    assert {("base", "rank_step"), ("stragglers", "candidates"), ("hang", "member_state")} <= set(executed)
    problems = []
    for (module, name), columns in sorted(executed.items()):
        names = documented(_sql.statements(module)[name])
        if missing := _undocumented(columns, names):
            problems.append(f"{module}.sql/{name}: undocumented output columns {missing}")
        if stale := _stale(columns, names):
            problems.append(f"{module}.sql/{name}: documented but not returned {stale}")
    assert not problems, "\n".join(problems)


def test_every_statement_that_yields_rows_is_checked_against_its_result(
        executed: dict[tuple[str, str], list[str]]) -> None:
    yielding = {(module, name) for module, name, text in _all_statements() if not _NO_ROWS.match(_code(text))}
    assert not yielding - set(executed), f"never executed by the fixture: {sorted(yielding - set(executed))}"


def test_column_lines_parse_as_intended() -> None:
    text = ("-- @column a, b_ns  two columns\n-- @column ex_*_ns excess per kind\n"
            "-- @column c      one, with a comma in its text\nSELECT 1")
    assert documented(text) == ["a", "b_ns", "ex_*_ns", "c"]
    assert _undocumented(["a", "b_ns", "ex_own_ns", "c", "d"], documented(text)) == ["d"]
    assert _stale(["a", "c"], documented(text)) == ["b_ns", "ex_*_ns"]

