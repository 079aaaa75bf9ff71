"""The built wheel: what a core install gets, and that nothing is left behind by the build.

The install itself (a clean virtual environment, core dependencies only, then ``[all]``) is a CI
step (``make test-install``); these checks need no network and run with the fast tests.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from safety import REPO

SOURCES = ["pyproject.toml", "README.md", "megascope", "collectors", "dashboard"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built from a copy of the sources, and the build's output."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(dist),
                           str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("megascope-*.whl")
    return wheel, proc.stdout + proc.stderr


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name))


def test_core_install_has_what_the_command_line_needs(built: tuple[Path, str]) -> None:
    wheel, _ = built
    core = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
            for r in _metadata(wheel).get_all("Requires-Dist") or [] if "extra ==" not in r}
    assert {"torch", "pyarrow", "click"} <= core, core
    # the analysis stack stays optional: a training job does not need it
    assert not core & {"duckdb", "pandas", "dash", "plotly"}, core


def test_wheel_carries_sql_and_dashboard_assets(built: tuple[Path, str]) -> None:
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    sql = {p.name for p in (REPO / "megascope" / "analysis" / "sql").glob("*.sql")}
    assert sql and {f"megascope/analysis/sql/{n}" for n in sql} <= names
    assets = {p.name for p in (REPO / "dashboard" / "assets").iterdir() if p.is_file()}
    assert assets and {f"megascope/dashboard/assets/{n}" for n in assets} <= names


def test_build_warns_about_nothing_ignored(built: tuple[Path, str]) -> None:
    _, output = built
    assert "would be ignored" not in output and "is absent from the `packages` configuration" not in output, output


@pytest.mark.parametrize("missing,args,extra", [
    ("duckdb", ["report", str(REPO / "sample_traces" / "healthy")], "analysis"),
    ("dash", ["serve", str(REPO / "sample_traces" / "healthy")], "dashboard"),
])
def test_a_command_names_the_extra_it_needs(missing: str, args: list[str], extra: str) -> None:
    """In a core install, an analysis command says which extra to install, in one line."""
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            f"from megascope.cli import main\nmain({args!r}, prog_name='megascope')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("Error: "), proc.stderr
    assert f"pip install 'megascope[{extra}]'" in proc.stderr and missing in proc.stderr
