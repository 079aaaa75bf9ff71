"""Fixtures shared by the test modules.

* ``synth``: a synthetic run of a given shape and planted faults, copied to where the test asks.
  Synthesis is deterministic (fixed seed, fixed epoch), so each distinct configuration is simulated
  once per session and every request gets its own copy: a test may write into its run (analysis
  cache, run.json, new parts) without another test seeing it.
* ``cli``: ``megascope ...`` through click, in process, with the output kept apart from stderr.
* ``wait_until``: poll a condition with a deadline instead of sleeping a guessed time.

Markers other than those of ``pyproject.toml`` are registered here.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pytest
from click.testing import CliRunner, Result


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "timing: depends on real elapsed time (a live collector's flush interval, a "
        "process stalled on purpose); its deadlines are generous for a loaded machine")


class Synth(Protocol):
    def __call__(self, dest: Path, *faults: str, **config: Any) -> Path: ...


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """``synth(dest, "straggler:rank=3,factor=1.3", ranks=16, steps=6, tp=2, pp=2, seed=5)``: a copy
    at ``dest`` of the synthetic run of that :class:`~megascope.synth.SynthConfig` with those
    ``--inject`` faults; returns ``dest``."""
    from megascope.inject import parse_injects
    from megascope.synth import SynthConfig, synth_run

    pristine: dict[tuple[Any, ...], Path] = {}
    root = tmp_path_factory.mktemp("synth-pristine")

    def make(dest: Path, *faults: str, **config: Any) -> Path:
        key = (faults, tuple(sorted(config.items())))
        if key not in pristine:
            path = root / f"run{len(pristine)}"
            synth_run(path, SynthConfig(**config, faults=parse_injects(list(faults))))
            pristine[key] = path
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(pristine[key], dest)
        return dest

    return make


@pytest.fixture(scope="session")
def cli() -> Callable[..., Result]:
    """``cli("report", str(run), "--json")``: the click result of ``megascope`` with those arguments."""
    from megascope.cli import main

    def invoke(*args: str, **kwargs: Any) -> Result:
        return CliRunner().invoke(main, list(args), **kwargs)

    return invoke


def ended_ranks(run_dir: Path) -> set[int]:
    """Ranks whose marker agent made its last pass (its ``rank_alive`` row of value 0): the rank's
    process ended and everything its agent will write is on disk."""
    import pyarrow.parquet as pq

    ended = set()
    for part in run_dir.glob("heartbeats/host=*/part-*.parquet"):
        for row in pq.read_table(part, columns=["rank", "metric", "value"]).to_pylist():
            if row["metric"] == "rank_alive" and row["value"] == 0.0:
                ended.add(int(row["rank"]))
    return ended


def wait_until(condition: Callable[[], Any], *, timeout: float, interval: float = 0.02,
               message: str = "condition") -> Any:
    """Poll ``condition`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{message}: not met within {timeout:g} s")
        time.sleep(interval)


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    return wait_until


def same_answer(a: Any, b: Any) -> bool:
    """Two reports (JSON-like values) equal, floats to 1e-9 relative: DuckDB's parallel float sums
    round differently from one build or run to the next."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_answer(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_answer(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float | int) or isinstance(b, float) and isinstance(a, int):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return bool(a == b) and type(a) is type(b)
