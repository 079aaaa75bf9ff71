"""Fuzz tier: malformed inputs made from valid ones, and the error contract they must meet.

Parquet parts, ``run.json``, Kineto JSON and flight-recorder pickles are taken from valid samples and
broken the ways files break (truncation, bit flips, a field of another type, extreme numbers). For
each, the command either succeeds on what is readable, or fails with exactly one ``Error:`` line on
stderr and a non-zero exit; never a traceback, never an "internal error", and nothing written or
overwritten but a complete new run.

``make test`` runs a fixed, fast slice (a few examples each). ``make test-fuzz`` runs the long one:
``MEGASCOPE_FUZZ=long`` (300 random examples per target; ``MEGASCOPE_FUZZ_EXAMPLES=N`` for another
number), with failures kept in ``.hypothesis/`` and replayed first next time.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import Synth
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ingest_fixtures import fr_dump, fr_entry, gpu_trace
from safety import tree_digest

from megascope.cli import main
from megascope.store import open_run

pytestmark = pytest.mark.fuzz

LONG = os.environ.get("MEGASCOPE_FUZZ", "") == "long"
_EXAMPLES = int(os.environ.get("MEGASCOPE_FUZZ_EXAMPLES", "300" if LONG else "6"))
settings.register_profile(
    "megascope-fuzz", max_examples=_EXAMPLES, deadline=None, derandomize=not LONG,
    database=None if not LONG else settings.default.database, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FUZZ = settings.get_profile("megascope-fuzz")

EXTREMES: list[Any] = [0, -1, 2**31, 2**63, -(2**63) - 1, 2**80, 1e300, -1e300, 1e-300, math.nan, math.inf,
                       -math.inf, "", "x" * 300, "NaN", None, True, [], {}, [[[[]]]], {"a": {"b": {}}}]


# ------------------------------------------------------------------ helpers


def _invoke(args: list[str]) -> Result:
    return CliRunner().invoke(main, args, catch_exceptions=True)


def assert_contract(result: Result) -> None:
    """Exit 0, or one ``Error:`` line on stderr and a non-zero exit; never an escaped exception."""
    escaped = result.exception is not None and not isinstance(result.exception, SystemExit)
    assert not escaped, f"exception escaped: {result.exception!r}"
    errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning: ")]
    if result.exit_code == 0:
        assert not any(line.startswith("Error") for line in errors), result.stderr
        return
    assert len(errors) == 1 and errors[0].startswith("Error: "), result.stderr
    assert "internal error" not in errors[0] and "Traceback" not in result.stderr, errors[0]


@pytest.fixture(scope="module")
def valid_run(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("fuzz") / "run", ranks=4, steps=3, tp=2, seed=11)


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A fresh directory per example (a pytest fixture would be shared by all of them)."""
    with tempfile.TemporaryDirectory(prefix="megascope-fuzz-") as tmp:
        yield Path(tmp)


def _json_paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _json_paths(v, (*prefix, i))


def _replace(obj: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


@st.composite
def mutated(draw: st.DrawFn, base: Any, paths: list[tuple[Any, ...]]) -> Any:
    """``base`` with one to three fields swapped for another type, an extreme number, or removed."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        try:
            doc = _replace(doc, path, draw(st.sampled_from(EXTREMES)), delete=bool(path) and draw(st.booleans()))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed or retyped the parent
    return doc


@st.composite
def broken_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` truncated, or with a few bits flipped, or a run of bytes zeroed."""
    how = draw(st.sampled_from(["truncate", "flip", "zero"]))
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(out) - 1))
        if how == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        else:
            width = draw(st.integers(1, 64))
            out[at: at + width] = bytes(len(out[at: at + width]))
    return bytes(out)


def _data_digest(root: Path) -> dict[str, str]:
    """tree_digest without the analysis cache a reader may add (RUN/_cache: derived tables, never data)."""
    return {k: v for k, v in tree_digest(root).items() if "_cache" not in Path(k).parts}


def _nothing_new_beside(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before, sorted(p.name for p in parent.iterdir())


def _check_ingest(result: Result, out: Path, parent: Path, before: set[str]) -> None:
    assert_contract(result)
    if result.exit_code == 0:
        open_run(out)  # what an ingest leaves is a readable run
        assert {p.name for p in parent.iterdir()} == before | {out.name}
    else:
        _nothing_new_beside(parent, before)


# ------------------------------------------------------------------ Parquet parts and run.json


_PARTS = ["spans/rank=00001", "markers/rank=00002", "metrics/rank=00000", "ranks/rank=00003.parquet"]


@FUZZ
@given(data=st.data(), where=st.sampled_from(_PARTS))
def test_fuzz_parquet_parts(valid_run: Path, data: st.DataObject, where: str) -> None:
    with _scratch() as scratch:
        run = scratch / "run"
        shutil.copytree(valid_run, run)
        target = run / where
        part = target if target.is_file() else sorted(target.glob("*.parquet"))[0]
        part.write_bytes(data.draw(broken_bytes(part.read_bytes())))
        before = _data_digest(scratch)
        for args in (["report", str(run), "--json", "--no-whatif"], ["localize", str(run), "--json"]):
            result = _invoke(args)
            assert_contract(result)
            if result.exit_code == 0:
                json.loads(result.stdout)
        assert _data_digest(scratch) == before  # reading never changes the run's data


@FUZZ
@given(data=st.data())
def test_fuzz_run_json(valid_run: Path, data: st.DataObject) -> None:
    with _scratch() as scratch:
        run = scratch / "run"
        shutil.copytree(valid_run, run)
        meta = json.loads((run / "run.json").read_text())
        if data.draw(st.booleans()):
            text = json.dumps(data.draw(mutated(meta, list(_json_paths(meta)))))
            (run / "run.json").write_text(text)
        else:
            (run / "run.json").write_bytes(data.draw(broken_bytes((run / "run.json").read_bytes())))
        before = _data_digest(scratch)
        result = _invoke(["report", str(run), "--json", "--no-whatif"])
        assert_contract(result)
        assert _data_digest(scratch) == before


# ------------------------------------------------------------------ Kineto JSON


_TRACE = gpu_trace(1, 2, steps=2)
_TRACE_PATHS = [p for p in _json_paths(_TRACE) if len(p) <= 4]


@FUZZ
@given(data=st.data())
def test_fuzz_kineto(data: st.DataObject) -> None:
    with _scratch() as scratch:
        src = scratch / "src"
        src.mkdir()
        (src / "rank0.json").write_text(json.dumps(gpu_trace(0, 2, steps=2)))
        text = json.dumps(data.draw(mutated(_TRACE, _TRACE_PATHS)))
        raw = text.encode()
        if data.draw(st.booleans()):
            raw = data.draw(broken_bytes(raw))
        (src / "rank1.json").write_bytes(raw)
        out = scratch / "run"
        before = {p.name for p in scratch.iterdir()}
        result = _invoke(["ingest", "kineto", str(src), "-o", str(out), "--workers", "1"])
        _check_ingest(result, out, scratch, before)


# ------------------------------------------------------------------ flight-recorder pickles


def _dump(rank: int) -> dict[str, Any]:
    entries = [fr_entry(seq - 1, seq, created=10**18 + seq * 10**7, completed=10**18 + seq * 10**7 + 10**6)
               for seq in range(1, 4)]
    return fr_dump(entries, {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}})


_DUMP = _dump(1)
_DUMP_PATHS = list(_json_paths(_DUMP))


@FUZZ
@given(data=st.data())
def test_fuzz_flight_recorder(data: st.DataObject) -> None:
    with _scratch() as scratch:
        src = scratch / "src"
        src.mkdir()
        (src / "nccl_trace_rank_0").write_bytes(pickle.dumps(_dump(0)))
        raw = pickle.dumps(data.draw(mutated(_DUMP, _DUMP_PATHS)))
        if data.draw(st.booleans()):
            raw = data.draw(broken_bytes(raw))
        (src / "nccl_trace_rank_1").write_bytes(raw)
        out = scratch / "run"
        before = {p.name for p in scratch.iterdir()}
        result = _invoke(["ingest", "flight-recorder", str(src), "-o", str(out)])
        _check_ingest(result, out, scratch, before)


# ------------------------------------------------------------------ synth arguments


_NUMBERS = st.one_of(st.integers(-(2**70), 2**70).map(str), st.floats(allow_nan=True).map(repr),
                     st.sampled_from(["nan", "inf", "-inf", "1e300", "", "x", "0x10", "1_000"]))


@FUZZ
@given(kind=st.sampled_from(["straggler", "skew", "hang"]), rank=_NUMBERS, value=_NUMBERS,
       micro_batches=st.one_of(st.none(), _NUMBERS))
def test_fuzz_synth_arguments(kind: str, rank: str, value: str, micro_batches: str | None) -> None:
    with _scratch() as scratch:
        param = {"straggler": "factor", "skew": "ms", "hang": "step"}[kind]
        out = scratch / "run"
        args = ["synth", "--ranks", "4", "--steps", "2", "--tp", "2", "--inject", f"{kind}:rank={rank},{param}={value}",
                "-o", str(out)]
        if micro_batches is not None:
            args[1:1] = ["--micro-batches", micro_batches]
        result = _invoke(args)
        assert_contract(result)
        if result.exit_code == 0:
            open_run(out)
        else:
            assert list(scratch.iterdir()) == []
