"""Nothing overwritten: a command never writes into an existing run or over a file it did not make.

Each refusal is one ``Error:`` line, a non-zero exit and a directory left byte for byte as it was.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safety import SAMPLES, assert_one_line_error, megascope, tree_digest


@pytest.fixture
def existing_run(tmp_path: Path) -> Path:
    run = tmp_path / "R"
    shutil.copytree(SAMPLES / "straggler", run)
    return run


def test_train_refuses_an_existing_run(existing_run: Path) -> None:
    before = tree_digest(existing_run)
    proc = megascope("train", "--nproc", "2", "--steps", "2", "-o", existing_run)
    assert_one_line_error(proc, mentions=str(existing_run))
    assert tree_digest(existing_run) == before


def test_train_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me\n")
    proc = megascope("train", "--nproc", "2", "--steps", "2", "-o", out)
    assert_one_line_error(proc, mentions="not empty")
    assert (out / "todo.txt").read_text() == "keep me\n" and len(list(out.iterdir())) == 1


def test_train_refuses_before_it_imports_torch(tmp_path: Path) -> None:
    """The arguments and the output directory are checked first: a refusal costs no torch import
    (seconds, the most of such a command's time)."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me\n")
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            f"sys.argv = ['megascope', 'train', '--nproc', '2', '--steps', '2', '-o', {str(out)!r}]\n"
            "runpy.run_module('megascope', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, mentions="not empty")
    assert proc.stdout.strip().splitlines()[-1] == "torch imported: False", proc.stdout


def test_train_under_torchrun_refuses_an_existing_run_before_starting(existing_run: Path) -> None:
    before = tree_digest(existing_run)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = megascope("train", "--steps", "2", "-o", existing_run, env=env, timeout=60)
    assert_one_line_error(proc, mentions=str(existing_run))
    assert tree_digest(existing_run) == before


def test_synth_refuses_an_existing_run(existing_run: Path) -> None:
    before = tree_digest(existing_run)
    proc = megascope("synth", "--ranks", "2", "--steps", "2", "-o", existing_run)
    assert_one_line_error(proc, mentions=str(existing_run))
    assert tree_digest(existing_run) == before


def test_a_new_run_inside_a_run_is_refused(existing_run: Path) -> None:
    before = tree_digest(existing_run)
    proc = megascope("synth", "--ranks", "2", "--steps", "2", "-o", existing_run / "spans" / "inner")
    assert_one_line_error(proc, mentions="inside the run directory")
    assert tree_digest(existing_run) == before


@pytest.mark.parametrize("command", [
    ["export", "chrome", "{run}", "-o", "{run}/run.json"],
    ["export", "chrome", "{run}", "-o", "{run}/new.json"],
    ["export", "chrome", "{run}", "--split-ranks", "-o", "{run}"],
    ["export", "chrome", "{run}", "--split-ranks", "-o", "{run}/traces"],
    ["export", "perfetto", "{run}", "-o", "{run}/run.json"],
    ["export", "perfetto", "{run}", "-o", "{run}/spans/rank=00000/t.pftrace"],
    ["heatmap", "{run}", "-o", "{run}/hm.html"],
], ids=lambda c: " ".join(c).replace("{run}", "R"))
def test_exports_never_write_into_a_run(existing_run: Path, command: list[str]) -> None:
    before = tree_digest(existing_run)
    proc = megascope(*(c.replace("{run}", str(existing_run)) for c in command))
    assert_one_line_error(proc, mentions="inside the run directory")
    assert tree_digest(existing_run) == before


@pytest.mark.parametrize("kind", ["chrome", "perfetto"])
def test_export_replaces_an_existing_file_only_with_force(existing_run: Path, tmp_path: Path, kind: str) -> None:
    target = tmp_path / "trace.out"
    target.write_text("an earlier file\n")
    proc = megascope("export", kind, existing_run, "-o", target)
    assert_one_line_error(proc, mentions="--force")
    assert target.read_text() == "an earlier file\n"
    proc = megascope("export", kind, existing_run, "-o", target, "--force")
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() != b"an earlier file\n" and target.stat().st_size > 1000


def test_heatmap_replaces_an_existing_file_only_with_force(existing_run: Path, tmp_path: Path) -> None:
    target = tmp_path / "hm.html"
    target.write_text("mine\n")
    proc = megascope("heatmap", existing_run, "-o", target)
    assert_one_line_error(proc, mentions="--force")
    assert target.read_text() == "mine\n"


def test_split_ranks_refuses_a_non_empty_directory(existing_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "hta"
    out.mkdir()
    (out / "rank-00000.json").write_text("{}\n")
    proc = megascope("export", "chrome", existing_run, "--split-ranks", "-o", out)
    assert_one_line_error(proc, mentions="not empty")
    assert (out / "rank-00000.json").read_text() == "{}\n"
    proc = megascope("export", "chrome", existing_run, "--split-ranks", "-o", out, "--force")
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("rank-*.json"))) == 8


def test_result_json_never_lands_in_the_run(tmp_path: Path) -> None:
    out = tmp_path / "R"
    proc = megascope("train", "--nproc", "1", "--steps", "1", "-o", out, "--result-json", out / "run.json")
    assert_one_line_error(proc, mentions="inside the run directory")
    assert not out.exists()
