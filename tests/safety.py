"""Helpers for the tests of what megascope promises about bad input: one ``Error:`` line on stderr,
a non-zero exit, no traceback, and nothing written or overwritten."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_traces"


def tree_digest(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` (itself included) -> a digest of its content."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def megascope(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the command line as a user would, in a fresh interpreter."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "megascope", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *, mentions: str | None = None) -> str:
    """Non-zero exit, exactly one ``Error:`` line on stderr and nothing else there, no traceback."""
    assert proc.returncode != 0, f"exit 0; stdout={proc.stdout!r} stderr={proc.stderr!r}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    if mentions is not None:
        assert mentions in lines[0], lines[0]
    assert "internal error" not in lines[0], lines[0]
    return lines[0]
