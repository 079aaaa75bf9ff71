"""Each node compacts its own ranks' parts while the job runs (``node_compact_every_s``).

Role in the data flow: beside the in-job collector. The collector of a node's first local rank
starts one ``megascope compact RUN --ranks LOW-HIGH --host HOST --every N --while-pid PID``
process (:class:`megascope.compact.Scope`: only this node's partitions), so that a job of
thousands of ranks keeps a bounded number of files without one process merging the whole job's.
The process shares nothing with the rank but the run directory, ends when the rank closes its
collector, and by itself once the rank is gone (``--while-pid``). The node's ranks come from the
launcher's environment: ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (torchrun and the bundled
launcher set both; torchrun numbers a node's ranks contiguously, its local rank 0 first).

Example::

    span = node_ranks(rank=8, world_size=16, environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"})
    span                                   # (8, 15): this process starts the node's compaction
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


def node_ranks(rank: int, world_size: int, environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The node's ranks (first, last) where this rank is the node's first local rank; None where
    another rank starts the node's compaction. Raises ValueError where the environment does not
    say which ranks share the node."""
    env = os.environ if environ is None else environ
    local, local_world = env.get("LOCAL_RANK"), env.get("LOCAL_WORLD_SIZE")
    if local is None and world_size == 1:
        return (rank, rank)
    if local is None or local_world is None:
        raise ValueError("LOCAL_RANK and LOCAL_WORLD_SIZE are not both set, so the node's ranks are unknown")
    try:
        first_local, size = int(local), int(local_world)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local!r} or LOCAL_WORLD_SIZE={local_world!r} is not a number") from None
    if first_local != 0:
        return None
    if size < 1 or rank + size > world_size:
        raise ValueError(f"LOCAL_WORLD_SIZE={size} does not fit rank {rank} of {world_size}")
    return (rank, rank + size - 1)


class NodeCompaction:
    """The node's ``megascope compact --every`` process; :meth:`close` stops it."""

    def __init__(self, process: subprocess.Popen[bytes], ranks: tuple[int, int]) -> None:
        self.process = process
        self.ranks = ranks

    @classmethod
    def start(cls, run_dir: Path, ranks: tuple[int, int], host: str, every_s: float,
              min_age_s: float) -> NodeCompaction:
        command = [sys.executable, "-m", "megascope", "compact", str(run_dir), "--ranks", f"{ranks[0]}-{ranks[1]}",
                   "--host", host, "--every", f"{every_s:g}", "--min-age", f"{min_age_s:g}",
                   "--while-pid", str(os.getpid())]
        # Its own session: a Ctrl-C meant for the job stops the job, which then stops this.
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   start_new_session=True)
        return cls(process, ranks)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop it: a pass under way is cut short (the next pass, or the job's last one, finishes it)."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
