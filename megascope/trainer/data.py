"""Training data: a seeded synthetic language with learnable structure, or a flat token file; both
prefetched ahead (a background thread, or on GPUs a worker process).

Role in the data flow: ``loop.py`` asks a :class:`Prefetcher` for each step's batch inside a
``data`` span, so a slow input pipeline shows up as data wait in the run directory.

Both sources are indexed by ``(seed, step)`` and yield the step's whole global batch in one fixed
order; a data-parallel rank keeps its contiguous slice. So the same sequences train every mesh.

* :class:`SyntheticLanguage`: a first-order Markov chain in which each token has a few likely
  successors (drawn once from the seed) and a small chance of a uniformly random one. Its entropy is
  far below ``log(vocab)``, so the loss must fall from ``log(vocab)`` towards it.
* :class:`TokenFile`: a flat ``uint16``/``uint32`` array of token ids (as nanoGPT-style pipelines
  write ``train.bin``), memory-mapped; each sequence starts at a seeded random offset.

Example::

    source = SyntheticLanguage(vocab=512, seq_len=128, seed=0)
    batch = source.batch(step=3, global_batch=16)           # int64 [16, 129]
    with Prefetcher(source, steps=range(10), global_batch=16, rows=slice(0, 8)) as data:
        tokens = data.next()
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from megascope.errors import ConfigError

log = logging.getLogger(__name__)


class Source(Protocol):
    seq_len: int

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        """int64 ``[global_batch, seq_len + 1]``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
        ...


class SyntheticLanguage:
    def __init__(self, *, vocab: int, seq_len: int, seed: int, successors: int = 4, noise: float = 0.05) -> None:
        self.vocab = vocab
        self.seq_len = seq_len
        self.seed = seed
        self.noise = noise
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
        self.successors = torch.randint(0, vocab, (vocab, successors), generator=gen)
        # Skewed choice among the successors: the chain is predictable but not deterministic.
        self.weights = torch.tensor([0.5 ** i for i in range(successors)])

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * (step + 1))
        n = self.seq_len + 1
        out = torch.empty(global_batch, n, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (global_batch,), generator=gen)
        choice = torch.multinomial(self.weights, global_batch * n, replacement=True, generator=gen).view(global_batch, n)
        noisy = torch.rand(global_batch, n, generator=gen) < self.noise
        random_tok = torch.randint(0, self.vocab, (global_batch, n), generator=gen)
        rows = torch.arange(global_batch)
        for t in range(1, n):
            nxt = self.successors[out[:, t - 1], choice[rows, t]]
            out[:, t] = torch.where(noisy[:, t], random_tok[:, t], nxt)
        return out


class TokenFile:
    def __init__(self, path: Path, *, dtype: str, vocab: int, seq_len: int, seed: int) -> None:
        self.path = Path(path)
        try:
            self.tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        except (OSError, ValueError) as exc:
            raise ConfigError(f"token file {self.path}: cannot be read as {dtype} ({exc})") from None
        if len(self.tokens) < seq_len + 2:
            raise ConfigError(f"token file {self.path}: {len(self.tokens)} tokens, fewer than one sequence of {seq_len + 1}")
        self.vocab = vocab
        self.seq_len = seq_len
        self.seed = seed

    def batch(self, step: int, global_batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * (step + 1))
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (global_batch,), generator=gen).tolist()
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        out = torch.from_numpy(rows)
        top = int(out.max())
        if top >= self.vocab:
            raise ConfigError(f"token file {self.path}: token id {top} is outside the model's vocabulary of {self.vocab}")
        return out


class Prefetcher:
    """Produces this rank's rows of each step's batch ``depth`` steps ahead, on a background thread
    or (``process=True``) in a forked worker process.

    A thread shares the training thread's interpreter lock: the synthetic language builds a batch
    token by token (thousands of small tensor operations a step), and on a GPU rank whose host is
    barely ahead of its device every switch of the lock to that thread is launch time lost. A
    worker process, as a DataLoader's workers are, keeps that work off the training process
    entirely; it uses no CUDA (its batches are pinned in the rank's process on arrival). It exits
    with the rank, killed or not.
    """

    def __init__(self, source: Source, *, steps: Iterable[int], global_batch: int, rows: slice,
                 device: torch.device | None = None, depth: int = 2, process: bool = False) -> None:
        self.source = source
        self.steps = list(steps)
        self.global_batch = global_batch
        self.rows = rows
        self.device = device
        self._queue: queue.Queue[torch.Tensor | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker: Any = None
        self._results: Any = None
        if not process:
            self._thread = threading.Thread(target=self._run, name="megascope-data", daemon=True)
        else:
            # Batches travel pickled by value (numpy arrays): torch's shared-memory tensors would
            # need the worker alive until the rank has read them.
            ctx = multiprocessing.get_context("fork")
            self._results = ctx.Queue(maxsize=depth)
            self._worker = ctx.Process(target=_produce, name="megascope-data",
                                       args=(source, self.steps, global_batch, rows, self._results, os.getpid()),
                                       daemon=True)

    def __enter__(self) -> Prefetcher:
        if self._worker is not None:
            with warnings.catch_warnings():
                # Python 3.12+ warns on any fork of a process with threads (the collector's): the
                # worker only builds batches, touching no lock those threads may hold.
                warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)
                self._worker.start()
        elif self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            for step in self.steps:
                batch = self.source.batch(step, self.global_batch)[self.rows].contiguous()
                if self.device is not None and self.device.type == "cuda":
                    batch = batch.pin_memory()
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # handed to the training thread, which raises it
            self._queue.put(exc)

    def next(self) -> torch.Tensor:
        if self._worker is not None:
            item = self._from_worker()
        else:
            item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if self.device is not None and self.device.type == "cuda":
            if self._worker is not None:
                item = item.pin_memory()
            return item.to(self.device, non_blocking=True)
        return item

    def _from_worker(self) -> torch.Tensor | BaseException:
        while True:
            try:
                item: np.ndarray | BaseException = self._results.get(timeout=1.0)
                return item if isinstance(item, BaseException) else torch.from_numpy(item)
            except queue.Empty:
                if not self._worker.is_alive():
                    return RuntimeError(f"the data worker process ended (exit code {self._worker.exitcode})")

    def close(self) -> None:
        self._stop.set()
        if self._worker is not None:
            if self._worker.is_alive():
                self._worker.terminate()
            self._worker.join(timeout=5)
            self._results.close()
            self._results.cancel_join_thread()
        elif self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)


def _produce(source: Source, steps: list[int], global_batch: int, rows: slice, results: Any, parent: int) -> None:
    """The worker process of :class:`Prefetcher`: every step's rows, in order, into ``results``.
    Ends when the rank's process is gone (it may be killed without closing its prefetcher)."""
    # Not the rank's signal handlers: the collector's SIGTERM handler would flush the copy of its
    # buffers this process was forked with (spans written twice). Ctrl-C is the rank's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    # Once the rank is gone nobody reads ``results``: a put, or the exit that waits to flush a
    # batch into the full pipe, would block forever. This process holds a copy of every file the
    # rank had open (the write end of its marker agent's pipe too, whose end-of-file starts the
    # agent's last pass): it must not outlive the rank by more than a moment.
    threading.Thread(target=_end_with, args=(parent,), name="megascope-data-parent", daemon=True).start()
    try:
        for step in steps:
            batch = source.batch(step, global_batch)[rows].contiguous().numpy()
            while True:
                try:
                    results.put(batch, timeout=0.5)
                    break
                except queue.Full:
                    if os.getppid() != parent:
                        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - handed to the rank, which raises it
        results.put(RuntimeError(f"data worker: {type(exc).__name__}: {exc}"))


def _end_with(parent: int, every_s: float = 0.25) -> None:
    """End this worker process, skipping every exit handler, as soon as its rank is gone."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)
