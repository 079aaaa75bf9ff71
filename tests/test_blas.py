"""The analysis' small solves run on one OpenBLAS thread, and the count is restored after."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from megascope.analysis import blas
from megascope.analysis.base import solve_offsets


def test_one_blas_thread_sets_one_thread_and_restores_the_count() -> None:
    found = blas._openblas()
    if found is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS found in this process")
    _, threads = found
    before = threads()
    with blas.one_blas_thread():
        assert threads() == 1
        with blas.one_blas_thread():
            assert threads() == 1
        assert threads() == 1
    assert threads() == before
    with pytest.raises(ValueError), blas.one_blas_thread():
        raise ValueError("a failing solve")
    assert threads() == before


def test_solve_offsets_recovers_planted_offsets() -> None:
    rng = np.random.default_rng(5)
    hosts = [f"h{i:02d}" for i in range(40)]
    truth = {h: 0 if i == 0 else int(rng.integers(-5_000_000, 5_000_000)) for i, h in enumerate(hosts)}
    pairs = [(a, b) for i, a in enumerate(hosts) for b in hosts[max(0, i - 3):i]]
    frame = pd.DataFrame({
        "host": [a for a, _ in pairs], "ref_host": [b for _, b in pairs],
        "diff_ns": [-(truth[a] - truth[b]) + float(rng.normal(0, 100)) for a, b in pairs],
        "mad_ns": 100.0, "samples": 16,
    })
    offsets = solve_offsets(hosts, frame).set_index("host")["offset_ns"]
    assert max(abs(offsets[h] - truth[h]) for h in hosts) < 1_000
