"""Opt-in: every trace of a local Kineto corpus (e.g. Holistic Trace Analysis' ``tests/data``).

Set ``MEGASCOPE_KINETO_CORPUS=DIR`` to run. The corpus is not ours to commit; this checks that each
``*.json`` / ``*.json.gz`` in it is either read or refused with one ``IngestError`` line, and that
every file holding a Kineto ``traceEvents`` array is read. ``bench/kineto_corpus.py`` prints the list.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from megascope.errors import IngestError
from megascope.ingest import ingest_kineto
from megascope.ingest.kineto import find_trace_files

CORPUS = os.environ.get("MEGASCOPE_KINETO_CORPUS")
FILES = find_trace_files(Path(CORPUS)) if CORPUS and Path(CORPUS).is_dir() else []

pytestmark = pytest.mark.skipif(not FILES, reason="MEGASCOPE_KINETO_CORPUS not set to a folder of traces")


def _is_kineto(path: Path) -> bool:
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CORPUS)) for p in FILES] if CORPUS else [])
def test_corpus_trace_is_read_or_refused_in_one_line(path: Path, tmp_path: Path) -> None:
    try:
        result = ingest_kineto(path, tmp_path / "run", workers=1)
    except IngestError as exc:
        assert "\n" not in str(exc)
        assert not _is_kineto(path), f"a Kineto trace was refused: {exc}"
        assert not (tmp_path / "run").exists()
        return
    assert result.ranks_found and result.world_size >= len(result.ranks_found)
    assert (tmp_path / "run" / "run.json").exists()
