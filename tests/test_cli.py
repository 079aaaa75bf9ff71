"""The command line: every command answers --help fast; errors are one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from click.testing import Result

from megascope.cli import main


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in group.commands.items():
        out.append((*prefix, name))
        if isinstance(cmd, click.Group):
            out.extend(_commands(cmd, (*prefix, name)))
    return out


@pytest.mark.parametrize("path", _commands(main), ids=" ".join)
def test_help_of_every_command(path: tuple[str, ...], cli: Callable[..., Result]) -> None:
    result = cli(*path, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_contract_commands_exist() -> None:
    names = {" ".join(p) for p in _commands(main)}
    for expected in ["train", "synth", "ingest kineto", "ingest flight-recorder", "watch", "report", "localize",
                     "heatmap", "export perfetto", "export chrome", "serve", "diagnose", "demo"]:
        assert expected in names


def test_version(cli: Callable[..., Result]) -> None:
    result = cli("--version")
    assert result.exit_code == 0 and "megascope" in result.output


def test_help_does_not_import_heavy_modules() -> None:
    code = "import sys; from megascope.cli import main\ntry:\n main(['--help'])\nexcept SystemExit: pass\nprint(sorted(m for m in ('torch','duckdb','pandas','dash','plotly') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_bad_run_dir_is_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "megascope", "report", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
