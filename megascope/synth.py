"""Synthetic run directories at any scale, with the faults of the ``--inject`` grammar planted.

Role in the data flow: a writer, like the collector and the importers. ``synth`` simulates a
synchronous 3D-parallel (TP x PP x DP, optionally x CP x EP) training job step by step and writes what megascope's
collector would have recorded: per-rank spans with arrival semantics, collective markers, per-step
metrics, ranks and groups, and ``run.json``. Users try the analyses and the dashboard on it; tests
and the scale benchmarks use it.

The simulation follows the dependencies that make real jobs behave as they do:

* each pipeline stage runs a 1F1B schedule over ``micro_batches``; a forward waits for the previous
  stage's activation (p2p), a backward for the next stage's gradient;
* after each forward and backward compute, the TP group all-reduces: it completes when its last
  member arrives, so a slow rank makes its TP peers wait inside the collective; with ``cp`` > 1 the
  context-parallel group first all-gathers keys and values, with ``ep`` > 1 the expert-parallel
  group exchanges tokens (all-to-all), each completing at its last member's arrival too;
* after the last backward the DP group reduce-scatters gradients, the optimizer runs, and the DP
  group all-gathers parameters: a late DP member stalls its whole DP group (the gradient sync runs
  over the dp axis alone: a simplification where cp or ep ranks share parameters);
* every host has its own wall-clock offset (recorded in ``run.json`` under
  ``config.synth.clock_offsets_ns`` so that clock estimation can be checked).

Faults: ``straggler`` multiplies a rank's compute, ``skew`` delays its arrival at the DP gradient
sync by a host pause that leaves no span (as a GC pause would), ``hang`` stops a rank before its
first communication of a step: its peers enqueue and never complete, and the run ends there.

Example::

    from megascope.inject import parse_injects
    from megascope.synth import SynthConfig, synth_run
    synth_run("runs/s", SynthConfig(ranks=64, steps=20, tp=4, pp=4,
                                    faults=parse_injects(["straggler:rank=9,factor=1.2"])))
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from megascope import layout
from megascope.errors import ConfigError, OutputError
from megascope.inject import PROCESS_FAULTS, Faults
from megascope.schema import (
    AXIS_ORDER,
    GROUPS,
    MARKERS,
    METRICS,
    RANKS,
    SPANS,
    CollectiveOp,
    GroupKind,
    MarkerState,
    RunMeta,
    RunSource,
    SpanKind,
    Stream,
)
from megascope.steplog import StepLog
from megascope.stepsums import step_sums
from megascope.topology import Mesh

log = logging.getLogger(__name__)

# 2026-01-01T00:00:00Z: synthetic runs start here, so that the same arguments give the same bytes.
EPOCH_NS = 1_767_225_600_000_000_000
MS = 1_000_000.0

# H100 SXM dense bf16 peak, the device synth pretends to run on.
SYNTH_DEVICE = "NVIDIA H100 80GB HBM3 (synthetic)"
SYNTH_PEAK_FLOPS = 989e12


# Bounds that keep every simulated time inside int64 nanoseconds and every array in memory.
MAX_RANKS = 1 << 20
MAX_STEPS = 1_000_000
MAX_MICRO_BATCHES = 4096
MAX_CELLS = 1 << 24
MAX_FACTOR = 1000.0
MAX_PAUSE_MS = 3_600_000.0


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """What to simulate. Times are medians in milliseconds; noise is lognormal."""

    ranks: int
    steps: int
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: an all-gather of keys and values per forward and backward
    ep: int = 1  # expert parallel: a token all-to-all per forward and backward
    micro_batches: int | None = None  # default: max(4, pp)
    seed: int = 0
    gpus_per_host: int = 8
    faults: Faults = field(default_factory=Faults)
    fwd_ms: float = 12.0  # forward of one micro-batch on one stage
    bwd_ratio: float = 2.0
    tp_comm_ms: float = 1.2
    cp_comm_ms: float = 0.8
    ep_comm_ms: float = 1.5
    p2p_ms: float = 0.4
    dp_reduce_scatter_ms: float = 18.0
    dp_all_gather_ms: float = 12.0
    optimizer_ms: float = 6.0
    data_ms: float = 0.3
    compute_noise: float = 0.015
    comm_noise: float = 0.08
    rank_jitter: float = 0.004  # systematic per-rank speed spread (healthy machines differ a little)
    clock_skew_ms: float = 2.0  # std-dev of per-host wall-clock offsets
    compute_efficiency: float = 0.62  # share of peak FLOP/s the compute spans run at (sets model FLOPs)
    seq_len: int = 4096
    micro_batch_size: int = 1
    chunk_rows: int = 16_000_000  # rows buffered before a part per rank is written (~1 GB)

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.steps < 1:
            raise ConfigError(f"ranks and steps must be >= 1 (got ranks={self.ranks}, steps={self.steps})")
        if self.ranks > MAX_RANKS:
            raise ConfigError(f"--ranks {self.ranks}: at most {MAX_RANKS:,} ranks")
        if self.steps > MAX_STEPS:
            raise ConfigError(f"--steps {self.steps}: at most {MAX_STEPS:,} steps")
        if self.micro_batches is not None and self.micro_batches > MAX_MICRO_BATCHES:
            raise ConfigError(f"--micro-batches {self.micro_batches}: at most {MAX_MICRO_BATCHES:,}")
        if self.ranks * self.m > MAX_CELLS:
            raise ConfigError(f"--ranks {self.ranks} x --micro-batches {self.m}: more than "
                              f"{MAX_CELLS:,} (rank, micro-batch) pairs per step would not fit in memory")
        if not (math.isfinite(self.clock_skew_ms) and 0 <= self.clock_skew_ms <= MAX_PAUSE_MS):
            raise ConfigError(f"--clock-skew-ms {self.clock_skew_ms}: must be between 0 and {MAX_PAUSE_MS:g}")
        for f in self.faults.faults:
            if f.kind in PROCESS_FAULTS:
                raise ConfigError(f"--inject {f.spec()}: synth does not model a {f.kind}; plant it in "
                                  f"megascope train (hang and freeze are modelled)")
            # NaN passes "> 1" checks by failing every comparison, and a huge value overflows the
            # nanosecond clock: either would plant nothing, or garbage, without a word.
            if f.factor is not None and not (math.isfinite(f.factor) and 1 < f.factor <= MAX_FACTOR):
                raise ConfigError(f"--inject {f.kind}:rank={f.rank},factor={f.factor}: factor must be a number "
                                  f"above 1 and at most {MAX_FACTOR:g}")
            if f.ms is not None and not (math.isfinite(f.ms) and 0 < f.ms <= MAX_PAUSE_MS):
                raise ConfigError(f"--inject {f.kind}:rank={f.rank},ms={f.ms}: ms must be a number above 0 and at "
                                  f"most {MAX_PAUSE_MS:g} (an hour)")
        if min(self.tp, self.pp, self.cp, self.ep) < 1:
            raise ConfigError(f"tp, pp, cp and ep must be >= 1 (got tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep})")
        inner = self.tp * self.pp * self.cp * self.ep
        if self.ranks % inner:
            named = "*".join(a for a in ("tp", "pp", "cp", "ep") if a in ("tp", "pp") or getattr(self, a) > 1)
            sizes = "*".join(str(getattr(self, a)) for a in named.split("*"))
            raise ConfigError(f"--ranks {self.ranks} is not divisible by {named} = {sizes} = {inner}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.gpus_per_host < 1:
            raise ConfigError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")
        self.faults.validate(self.ranks, self.steps)

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp * self.cp * self.ep)

    @property
    def m(self) -> int:
        return self.micro_batches if self.micro_batches is not None else max(4, self.pp)


@dataclass
class SynthStats:
    path: Path
    spans: int = 0
    markers: int = 0
    metrics: int = 0
    files: int = 0
    seconds: float = 0.0
    hung_at_step: int | None = None

    @property
    def rows(self) -> int:
        return self.spans + self.markers + self.metrics


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The 1F1B order of ("F"|"B", micro-batch) for one pipeline stage."""
    warmup = min(stages - stage - 1, micro_batches)
    ops = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        ops.append(("F", warmup + i))
        ops.append(("B", i))
    ops.extend(("B", i) for i in range(micro_batches - warmup, micro_batches))
    return ops


class _Columns:
    """Growing column buffers for one table; categorical strings kept as codes until written."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
        self.rows = 0

    def add(self, **cols: Any) -> None:
        n = len(cols["rank"])
        if n == 0:
            return
        for name in self.names:
            self.parts[name].append(np.broadcast_to(cols[name], (n,)))
        self.rows += n

    def take(self) -> dict[str, np.ndarray]:
        out = {n: (np.concatenate(p) if p else np.empty(0)) for n, p in self.parts.items()}
        self.parts = {n: [] for n in self.names}
        self.rows = 0
        return out


def _pick(value: Any, ok: np.ndarray) -> Any:
    """The entries of a per-rank array where ``ok``; scalars pass through (broadcast later)."""
    return np.broadcast_to(value, ok.shape)[ok] if isinstance(value, np.ndarray) else value


# The simulation puts pp outermost and tp innermost (stage rows, TP columns); the axes between
# (dp, ep, cp) are the rows of a stage, in schema.AXIS_ORDER.
assert AXIS_ORDER[0] == "pp" and AXIS_ORDER[-1] == "tp"


class _Sim:
    """One synthetic job. Arrays of shape (pp, rows, tp) index ranks in mesh order; a stage's rows
    are its (dp, ep, cp) places, in ``schema.AXIS_ORDER`` (just dp without cp and ep)."""

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        self.mesh = Mesh.for_world(cfg.ranks, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep)
        # Every known axis, size 1 where the mesh lacks it: collectives along an axis reduce over it.
        self.full = tuple(self.mesh.size.get(a, 1) for a in AXIS_ORDER)
        P, T = cfg.pp, cfg.tp
        D = cfg.ranks // (P * T)  # rows per stage
        self.shape = (P, D, T)
        self.rng = np.random.default_rng(cfg.seed)
        self.rank = np.arange(cfg.ranks, dtype=np.int32).reshape(self.shape)
        place = {a: i.reshape(self.shape) for a, i in zip(AXIS_ORDER, np.indices(self.full), strict=True)}
        # Group ids as codes into self.group_names; the same enumeration as topology.Mesh.group_of
        # (row-major over the other axes; axes of size 1 add nothing).
        self.group_names: list[str] = []

        def codes(axis: str) -> np.ndarray:
            index = np.zeros(self.shape, dtype=np.int64)
            for a, size in zip(AXIS_ORDER, self.full, strict=True):
                if a != axis:
                    index = index * size + place[a]
            return self._group_codes(axis, index)

        self.tp_code = codes("tp")
        self.dp_code = codes("dp")
        self.pp_code = codes("pp")
        self.cp_code = codes("cp") if cfg.cp > 1 else None
        self.ep_code = codes("ep") if cfg.ep > 1 else None
        hosts = self.rank // cfg.gpus_per_host
        self.n_hosts = int(hosts.max()) + 1
        offsets = self.rng.normal(0.0, cfg.clock_skew_ms * MS, self.n_hosts)
        offsets[0] = 0.0  # host 0 is the reference clock
        self.host_offsets = np.round(offsets).astype(np.int64)
        # Simulated time runs from 0; recorded times are wall clock: epoch + host offset + simulated.
        self.rank_offset = self.host_offsets[hosts] + EPOCH_NS
        jitter = self.rng.lognormal(0.0, cfg.rank_jitter, self.shape)
        factor = np.array([cfg.faults.straggler_factor(r) for r in range(cfg.ranks)]).reshape(self.shape)
        self.speed = jitter * factor  # multiplies compute time
        self.skew = np.array([cfg.faults.skew_ms(r) for r in range(cfg.ranks)]).reshape(self.shape) * MS
        hang = [cfg.faults.hang_step(r) for r in range(cfg.ranks)]
        self.hang_step = np.array([h if h is not None else -1 for h in hang]).reshape(self.shape)
        self.spans = _Columns(["rank", "step", "name", "kind", "stream", "start", "dur", "mb", "group", "seq", "op", "bytes", "peer"])
        self.markers = _Columns(["rank", "group", "seq", "op", "state", "time", "step", "bytes", "peer"])
        self.tp_seq = np.zeros(P, dtype=np.int64)
        self.cp_seq = np.zeros(P, dtype=np.int64)
        self.ep_seq = np.zeros(P, dtype=np.int64)
        self.dp_seq = 0

    def _complete(self, arrive: np.ndarray, axis: str, ms: float, *, stage: bool = False) -> np.ndarray:
        """When each member's collective along ``axis`` completes: its group's last arrival plus a
        noisy transfer. ``arrive`` is shaped like the whole job, or like one stage (``stage``)."""
        full = self.full[1:] if stage else self.full
        last = arrive.reshape(full).max(axis=AXIS_ORDER.index(axis) - int(stage), keepdims=True)
        done = last + ms * MS * self._noise(self.cfg.comm_noise, last.shape)
        return np.broadcast_to(done, full).reshape(arrive.shape).copy()

    def _group_codes(self, axis: str, index: np.ndarray) -> np.ndarray:
        base = len(self.group_names)
        self.group_names.extend(f"{axis}:{i}" for i in range(int(index.max()) + 1))
        return (index + base).astype(np.int32)

    # -- emission -------------------------------------------------------------------------

    def _noise(self, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.lognormal(0.0, sigma, shape)

    def emit_span(self, sel: Any, step: int, name: int, kind: int, stream: int, start: np.ndarray,
                  end: np.ndarray, mb: int = -1, group: np.ndarray | int = -1, seq: np.ndarray | int = -1,
                  op: int = -1, nbytes: int = -1, peer: np.ndarray | int = -1) -> None:
        ok = np.isfinite(end) & np.isfinite(start)
        if not ok.any():
            return
        self.spans.add(
            rank=self.rank[sel][ok], step=np.int32(step), name=np.int16(name), kind=np.int16(kind),
            stream=np.int16(stream), start=start[ok].astype(np.int64) + self.rank_offset[sel][ok],
            dur=(end[ok] - start[ok]).astype(np.int64), mb=np.int32(mb), group=_pick(group, ok),
            seq=_pick(seq, ok), op=np.int16(op), bytes=np.int64(nbytes), peer=_pick(peer, ok),
        )

    def emit_markers(self, sel: Any, step: int, group: np.ndarray, seq: np.ndarray | int, op: int,
                     arrive: np.ndarray, done: np.ndarray, nbytes: int, peer: np.ndarray | int = -1) -> None:
        for state, t in ((_MARKER_STATES.index(MarkerState.ENQUEUED), arrive), (_MARKER_STATES.index(MarkerState.COMPLETED), done)):
            ok = np.isfinite(t)
            if not ok.any():
                continue
            self.markers.add(
                rank=self.rank[sel][ok], group=_pick(group, ok), seq=_pick(seq, ok), op=np.int16(op),
                state=np.int16(state), time=t[ok].astype(np.int64) + self.rank_offset[sel][ok],
                step=np.int32(step), bytes=np.int64(nbytes), peer=_pick(peer, ok),
            )

    # -- one step -------------------------------------------------------------------------

    def step(self, s: int, clock: np.ndarray) -> np.ndarray:
        """Simulate step ``s`` starting at ``clock`` (true ns, shape (P, rows, T)); return its end."""
        cfg, (P, D, T), M = self.cfg, self.shape, self.cfg.m
        hung_now = self.hang_step == s
        step_start = clock.copy()
        # Data loading (host): a short wait for the next batch.
        data_end = clock + cfg.data_ms * MS * self._noise(cfg.comm_noise, self.shape)
        self.emit_span(np.s_[:, :, :], s, _NAMES["data"], _KINDS[SpanKind.DATA], _STREAMS[Stream.HOST], clock, data_end)
        stage_clock = data_end.copy()
        # A hung rank never arrives at its first communication of this step.
        pending_hang = hung_now.copy()
        fwd_out = np.full((P, M, D, T), np.inf)  # when stage p finished forward of micro-batch i
        bwd_out = np.full((P, M, D, T), np.inf)
        schedules = [one_f_one_b(p, P, M) for p in range(P)]
        cursor = [0] * P
        done_f = np.zeros((P, M), dtype=bool)
        done_b = np.zeros((P, M), dtype=bool)
        remaining = sum(len(x) for x in schedules)
        while remaining:
            progressed = False
            for p in range(P):
                if cursor[p] >= len(schedules[p]):
                    continue
                phase, i = schedules[p][cursor[p]]
                if phase == "F" and p > 0 and not done_f[p - 1, i]:
                    continue
                if phase == "B" and p < P - 1 and not done_b[p + 1, i]:
                    continue
                self._op(s, p, phase, i, stage_clock, fwd_out, bwd_out, pending_hang)
                (done_f if phase == "F" else done_b)[p, i] = True
                cursor[p] += 1
                remaining -= 1
                progressed = True
            if not progressed:  # pragma: no cover - 1F1B is deadlock-free by construction
                raise RuntimeError("pipeline schedule deadlocked")
        end = self._dp_sync(s, stage_clock, pending_hang)
        self.emit_span(np.s_[:, :, :], s, _NAMES["step"], _KINDS[SpanKind.STEP], _STREAMS[Stream.HOST], step_start, end)
        return end

    def _arrive(self, p: int, clock: np.ndarray, pending_hang: np.ndarray) -> np.ndarray:
        """Arrival at a communication call: +inf (never) for a rank whose hang fires here."""
        arrive = clock.copy()
        hang = pending_hang[p]
        if hang.any():
            arrive[hang] = np.inf
            pending_hang[p] = False
        return arrive

    def _op(self, s: int, p: int, phase: str, i: int, stage_clock: np.ndarray, fwd_out: np.ndarray,
            bwd_out: np.ndarray, pending_hang: np.ndarray) -> None:
        cfg, (P, D, T) = self.cfg, self.shape
        sel: Any = np.s_[p]
        forward = phase == "F"
        src = p - 1 if forward else p + 1  # the stage that feeds this op
        if 0 <= src < P:
            arrive = self._arrive(p, stage_clock[p], pending_hang)
            sent = (fwd_out if forward else bwd_out)[src, i]
            done = np.maximum(arrive, sent) + cfg.p2p_ms * MS * self._noise(cfg.comm_noise, (D, T))
            pair_seq = s * cfg.m + i
            nbytes = cfg.micro_batch_size * cfg.seq_len * 2 * 1024  # activation slice (bf16)
            recv_peer, send_peer = self.rank[src], self.rank[p]
            group = self.pp_code[p]
            self.emit_span(sel, s, _NAMES["recv"], _KINDS[SpanKind.RECV], _STREAMS[Stream.COMM], arrive, done,
                           mb=i, group=group, seq=pair_seq, op=_OPS[CollectiveOp.RECV], nbytes=nbytes, peer=recv_peer)
            self.emit_markers(sel, s, group, pair_seq, _OPS[CollectiveOp.RECV], arrive, done, nbytes, recv_peer)
            self.emit_span(np.s_[src], s, _NAMES["send"], _KINDS[SpanKind.SEND], _STREAMS[Stream.COMM], sent, done,
                           mb=i, group=group, seq=pair_seq, op=_OPS[CollectiveOp.SEND], nbytes=nbytes, peer=send_peer)
            self.emit_markers(np.s_[src], s, group, pair_seq, _OPS[CollectiveOp.SEND], sent, np.where(np.isfinite(arrive), done, np.inf), nbytes, send_peer)
            stage_clock[p] = done
        base = cfg.fwd_ms * (1.0 if forward else cfg.bwd_ratio) * MS
        start = stage_clock[p]
        end = start + base * self.speed[p] * self._noise(cfg.compute_noise, (D, T))
        kind = SpanKind.FORWARD if forward else SpanKind.BACKWARD
        self.emit_span(sel, s, _NAMES[str(kind)], _KINDS[kind], _STREAMS[Stream.COMPUTE], start, end, mb=i)
        for code, seq, call, op, ms, nbytes in (
            (self.cp_code, self.cp_seq, "cp.all_gather", CollectiveOp.ALL_GATHER, cfg.cp_comm_ms,
             cfg.micro_batch_size * cfg.seq_len * 2 * 1024),
            (self.ep_code, self.ep_seq, "ep.all_to_all", CollectiveOp.ALL_TO_ALL, cfg.ep_comm_ms,
             cfg.micro_batch_size * cfg.seq_len * 2 * 4096),
        ):
            if code is None:
                continue
            arrive = self._arrive(p, end, pending_hang)
            done = self._complete(arrive, call.split(".")[0], ms, stage=True)
            seq[p] += 1
            self.emit_span(sel, s, _NAMES[call], _KINDS[SpanKind.COLLECTIVE], _STREAMS[Stream.COMM], arrive, done, mb=i,
                           group=code[p], seq=seq[p], op=_OPS[op], nbytes=nbytes)
            self.emit_markers(sel, s, code[p], seq[p], _OPS[op], arrive, done, nbytes)
            end = done
        if T > 1:
            arrive = self._arrive(p, end, pending_hang)
            last = arrive.max(axis=1, keepdims=True)  # the TP group completes after its last arriver
            done = np.broadcast_to(last + cfg.tp_comm_ms * MS * self._noise(cfg.comm_noise, (D, 1)), (D, T)).copy()
            self.tp_seq[p] += 1
            nbytes = cfg.micro_batch_size * cfg.seq_len * 2 * 4096
            name = _NAMES["tp.all_reduce"]
            self.emit_span(sel, s, name, _KINDS[SpanKind.COLLECTIVE], _STREAMS[Stream.COMM], arrive, done, mb=i,
                           group=self.tp_code[p], seq=self.tp_seq[p], op=_OPS[CollectiveOp.ALL_REDUCE], nbytes=nbytes)
            self.emit_markers(sel, s, self.tp_code[p], self.tp_seq[p], _OPS[CollectiveOp.ALL_REDUCE], arrive, done, nbytes)
            end = done
        stage_clock[p] = end
        (fwd_out if forward else bwd_out)[p, i] = end

    def _dp_sync(self, s: int, clock: np.ndarray, pending_hang: np.ndarray) -> np.ndarray:
        cfg, P = self.cfg, self.shape[0]
        grad_bytes = 64 * 1024 * 1024
        everyone = np.s_[:, :, :]
        if cfg.dp > 1:
            # The skew fault: a host pause (no span, like GC) right before the gradient sync.
            arrive = clock + self.skew
            for p in range(P):
                arrive[p] = self._arrive(p, arrive[p], pending_hang)
            self.dp_seq += 1
            done = self._complete(arrive, "dp", cfg.dp_reduce_scatter_ms)
            self.emit_span(everyone, s, _NAMES["dp.reduce_scatter"], _KINDS[SpanKind.COLLECTIVE], _STREAMS[Stream.COMM],
                           arrive, done, group=self.dp_code, seq=self.dp_seq, op=_OPS[CollectiveOp.REDUCE_SCATTER], nbytes=grad_bytes)
            self.emit_markers(everyone, s, self.dp_code, self.dp_seq, _OPS[CollectiveOp.REDUCE_SCATTER], arrive, done, grad_bytes)
            clock = done
        opt_end = clock + cfg.optimizer_ms * MS * self.speed * self._noise(cfg.compute_noise, self.shape)
        self.emit_span(everyone, s, _NAMES["optimizer"], _KINDS[SpanKind.OPTIMIZER], _STREAMS[Stream.COMPUTE], clock, opt_end)
        clock = opt_end
        if cfg.dp > 1:
            arrive = clock
            self.dp_seq += 1
            done = self._complete(arrive, "dp", cfg.dp_all_gather_ms)
            self.emit_span(everyone, s, _NAMES["dp.all_gather"], _KINDS[SpanKind.COLLECTIVE], _STREAMS[Stream.COMM],
                           arrive, done, group=self.dp_code, seq=self.dp_seq, op=_OPS[CollectiveOp.ALL_GATHER], nbytes=grad_bytes)
            self.emit_markers(everyone, s, self.dp_code, self.dp_seq, _OPS[CollectiveOp.ALL_GATHER], arrive, done, grad_bytes)
            clock = done
        return clock


# Categorical values as small codes while simulating; strings only when a part is written.
_NAME_LIST = ["data", "step", "recv", "send", "forward", "backward", "tp.all_reduce", "dp.reduce_scatter", "optimizer", "dp.all_gather",
              "cp.all_gather", "ep.all_to_all"]
_NAMES = {n: i for i, n in enumerate(_NAME_LIST)}
_KIND_LIST = list(SpanKind)
_KINDS = {k: i for i, k in enumerate(_KIND_LIST)}
_STREAM_LIST = list(Stream)
_STREAMS = {k: i for i, k in enumerate(_STREAM_LIST)}
_OP_LIST = list(CollectiveOp)
_OPS = {k: i for i, k in enumerate(_OP_LIST)}
_MARKER_STATES = list(MarkerState)


def _decode(codes: np.ndarray, values: Sequence[str]) -> pa.Array:
    """Codes (-1 = null) to a string array through a dictionary: cheap for millions of rows."""
    codes = codes.astype(np.int32)
    dictionary = pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), pa.array([str(v) for v in values]))
    return dictionary.cast(pa.string())


def _nullable(values: np.ndarray, dtype: pa.DataType) -> pa.Array:
    return pa.array(values, type=dtype, mask=values < 0)


def _span_table(c: dict[str, np.ndarray], group_names: list[str]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array(c["rank"], pa.int32()), pa.array(c["step"], pa.int32()), _decode(c["name"], _NAME_LIST),
            _decode(c["kind"], _KIND_LIST), _decode(c["stream"], _STREAM_LIST), pa.array(c["start"], pa.int64()),
            pa.array(c["dur"], pa.int64()), _nullable(c["mb"], pa.int32()), pa.nulls(len(c["rank"]), pa.int32()),
            _decode(c["group"], group_names), _nullable(c["seq"], pa.int64()), _decode(c["op"], _OP_LIST),
            _nullable(c["bytes"], pa.int64()), _nullable(c["peer"], pa.int32()),
        ],
        schema=SPANS,
    )


def _marker_table(c: dict[str, np.ndarray], group_names: list[str]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array(c["rank"], pa.int32()), _decode(c["group"], group_names), pa.array(c["seq"], pa.int64()),
            _decode(c["op"], _OP_LIST), _decode(c["state"], _MARKER_STATES), pa.array(c["time"], pa.int64()),
            pa.array(c["step"], pa.int32()), _nullable(c["bytes"], pa.int64()), _nullable(c["peer"], pa.int32()),
        ],
        schema=MARKERS,
    )


def _write_by_rank(pool: ThreadPoolExecutor, out: Path, table_name: str, table: pa.Table, run_id: str, *,
                   step_logs: bool = False) -> int:
    """One part per rank: sort by rank once, then slice (zero-copy) and write in parallel; with
    ``step_logs``, each spans part's sums are appended to its rank's step log first, as the
    collector's writer does."""
    if table.num_rows == 0:
        return 0
    table = table.sort_by([("rank", "ascending"), ("start_ns" if "start_ns" in table.column_names else "time_ns", "ascending")])
    ranks = table.column("rank").to_numpy()
    bounds = np.flatnonzero(np.diff(ranks)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(ranks)]])

    def write(lo: int, hi: int) -> Path:
        part, rank = table.slice(lo, hi - lo), int(ranks[lo])
        if table_name == "spans":  # with its sums, as the collector writes them
            sums = step_sums(part)
            if step_logs:
                steps = StepLog(out, rank=rank)
                steps.append(sums, run_id=run_id)
                steps.close()
            return layout.write_spans_part(out, part, rank=rank, run_id=run_id, sums=sums)
        return layout.write_part(out, table_name, part, rank=rank, run_id=run_id)

    futures = [pool.submit(write, a, b) for a, b in zip(starts, ends, strict=True)]
    for f in futures:
        f.result()
    return len(futures)


def _static_tables(sim: _Sim, out: Path, pool: ThreadPoolExecutor, run_id: str) -> int:
    """ranks/ and groups/: one small file per rank."""
    cfg, mesh = sim.cfg, sim.mesh
    futures = []
    for r in range(cfg.ranks):
        c = mesh.coords(r)
        host = f"node{r // cfg.gpus_per_host:05d}"
        ranks_row = {"rank": r, "host": host, "local_rank": r % cfg.gpus_per_host, "pid": 10_000 + r,
                     "device": f"cuda:{r % cfg.gpus_per_host}", "device_name": SYNTH_DEVICE, "coords": c,
                     "started_at_ns": EPOCH_NS}
        futures.append(pool.submit(layout.write_part, out, "ranks", pa.Table.from_pylist([ranks_row], schema=RANKS), rank=r,
                                   run_id=run_id))
        groups = [{"rank": r, "group": g.id, "kind": g.kind, "group_rank": g.index_of(r), "members": list(g.members)}
                  for g in mesh.rank_groups(r) if g.kind != GroupKind.WORLD]
        if groups:
            futures.append(pool.submit(layout.write_part, out, "groups", pa.Table.from_pylist(groups, schema=GROUPS), rank=r,
                                       run_id=run_id))
    for f in futures:
        f.result()
    return len(futures)


def _metrics(sim: _Sim, step: int, end: np.ndarray, rng: np.random.Generator) -> pa.Table | None:
    """Loss, grad norm, learning rate and tokens, logged by the last stage's TP rank 0 of each DP replica."""
    cfg = sim.cfg
    last = np.s_[cfg.pp - 1, :, 0]
    ranks = sim.rank[last]
    t = end[last]
    ok = np.isfinite(t)
    if not ok.any():
        return None
    loss = 2.0 + 8.5 * np.exp(-step / 30.0) + rng.normal(0, 0.03, ranks.shape)
    values = {
        "loss": loss,
        "grad_norm": 1.0 + 0.5 * np.exp(-step / 20.0) + np.abs(rng.normal(0, 0.05, ranks.shape)),
        "lr": np.full(ranks.shape, 3e-4 * min(1.0, (step + 1) / 10)),
        "tokens": np.full(ranks.shape, float(cfg.m * cfg.micro_batch_size * cfg.seq_len)),
    }
    rows = []
    for name, v in values.items():
        for r, val, when in zip(ranks[ok], v[ok], t[ok] + sim.rank_offset[last][ok], strict=True):
            rows.append({"rank": int(r), "step": step, "name": name, "value": float(val), "time_ns": int(when)})
    return pa.Table.from_pylist(rows, schema=METRICS)


def model_flops_per_step(cfg: SynthConfig) -> float:
    """The FLOPs the simulated model does per step, so that compute spans run at ``compute_efficiency``."""
    compute_s = cfg.m * cfg.fwd_ms * (1.0 + cfg.bwd_ratio) / 1e3
    return cfg.ranks * SYNTH_PEAK_FLOPS * cfg.compute_efficiency * compute_s


def synth_run(out: Path | str, cfg: SynthConfig, *, progress: Callable[[int, int], None] | None = None) -> SynthStats:
    """Simulate ``cfg`` and write a complete run directory at ``out``.

    The run is written to a temporary sibling directory and renamed into place at the end, so
    ``out`` is either absent or whole. An existing non-empty ``out`` is refused, never overwritten.
    """
    out = Path(out)
    layout.check_new_run_dir(out)
    t0 = time.perf_counter()
    tmp = out.with_name(f".{out.name}.synth-{os.getpid()}.tmp")
    stats = SynthStats(path=out)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        stats = _simulate(cfg, tmp, stats, progress)
        layout.check_new_run_dir(out)  # still new: nothing appeared there while we worked
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"{exc.filename or out}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stats.seconds = time.perf_counter() - t0
    return stats


def _run_id(cfg: SynthConfig) -> str:
    # The same arguments give the same id (and bytes); any other argument, a fault too, another id.
    digest = hashlib.sha1(repr(cfg).encode()).hexdigest()[:10]
    return f"synth-{cfg.ranks}r-{cfg.steps}s-seed{cfg.seed}-{digest}"


def _simulate(cfg: SynthConfig, tmp: Path, stats: SynthStats, progress: Callable[[int, int], None] | None) -> SynthStats:
    """Simulate ``cfg`` into the staging directory ``tmp``."""
    run_id = _run_id(cfg)
    sim = _Sim(cfg)
    mrng = np.random.default_rng(cfg.seed + 1)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        stats.files += _static_tables(sim, tmp, pool, run_id)
        clock = np.zeros(sim.shape)
        metric_tables = []
        for s in range(cfg.steps):
            clock = sim.step(s, clock)
            table = _metrics(sim, s, clock, mrng)
            if table is not None:
                metric_tables.append(table)
            hung = not np.isfinite(clock).all()
            last_step = hung or s == cfg.steps - 1
            if sim.spans.rows + sim.markers.rows >= cfg.chunk_rows or last_step:
                spans = _span_table(sim.spans.take(), sim.group_names)
                markers = _marker_table(sim.markers.take(), sim.group_names)
                stats.spans += spans.num_rows
                stats.markers += markers.num_rows
                stats.files += _write_by_rank(pool, tmp, "spans", spans, run_id)
                stats.files += _write_by_rank(pool, tmp, "markers", markers, run_id)
            if progress:
                progress(s + 1, cfg.steps)
            if hung:
                stats.hung_at_step = s
                break
        if metric_tables:
            metrics = pa.concat_tables(metric_tables)
            stats.metrics = metrics.num_rows
            stats.files += _write_by_rank(pool, tmp, "metrics", metrics, run_id)
    layout.write_run_meta(tmp, _run_meta(cfg, sim, run_id))
    return stats


def _run_meta(cfg: SynthConfig, sim: _Sim, run_id: str) -> RunMeta:
    return RunMeta(
        run_id=run_id,
        source=RunSource.SYNTH,
        world_size=cfg.ranks,
        mesh_axes=sim.mesh.axes,
        mesh_sizes=sim.mesh.size,
        start_ns=EPOCH_NS,
        model_flops_per_step=model_flops_per_step(cfg),
        tokens_per_step=cfg.dp * cfg.ep * cfg.m * cfg.micro_batch_size * cfg.seq_len,  # cp ranks share sequences
        device_name=SYNTH_DEVICE,
        peak_flops_per_device=SYNTH_PEAK_FLOPS,
        micro_batches=cfg.m,
        config={
            "steps": cfg.steps,  # what run state compares the last step with
            "synth": {
                "seed": cfg.seed,
                "gpus_per_host": cfg.gpus_per_host,
                "injects": cfg.faults.specs(),
                "clock_offsets_ns": {f"node{h:05d}": int(o) for h, o in enumerate(sim.host_offsets)},
            }
        },
    )


class LiveSynth:
    """A synthetic job written step by step, as the collector writes a live run: ``run.json``,
    ``ranks`` and ``groups`` when it starts, then per :meth:`write_step` (one flush of a job that
    flushes once a step) one spans part with its step sums twin (and, unless ``step_logs`` is
    off, those sums appended to the rank's step log), one markers part and, on the ranks that log
    metrics, one metrics part, per rank. What live readers (the dashboard's
    refresh, ``bench/live_refresh.py``) are measured and tested against.

    Example::

        job = LiveSynth("runs/live", SynthConfig(ranks=64, steps=1000, tp=4, pp=4))
        job.write_step()          # step 0: 64 spans parts, 64 twins, 64 markers parts, ...
    """

    def __init__(self, out: Path | str, cfg: SynthConfig, *, threads: int = 2, step_logs: bool = True) -> None:
        self.out = layout.prepare_run_dir(out)
        self.cfg = cfg
        self.step_logs = step_logs
        self.run_id = _run_id(cfg)
        self.step = 0
        self._sim = _Sim(cfg)
        self._clock = np.zeros(self._sim.shape)
        self._mrng = np.random.default_rng(cfg.seed + 1)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads))
        layout.write_run_meta(self.out, _run_meta(cfg, self._sim, self.run_id))
        _static_tables(self._sim, self.out, self._pool, self.run_id)

    def write_step(self, steps: int = 1) -> int:
        """Simulate the next ``steps`` steps and write them as one flush (a part per rank and
        table); returns the number of files written."""
        sim = self._sim
        metrics = []
        for _ in range(steps):
            if self.step >= self.cfg.steps or not np.isfinite(self._clock).all():
                raise ConfigError(f"{self.out}: the job has ended (step {self.step} of {self.cfg.steps})")
            self._clock = sim.step(self.step, self._clock)
            table = _metrics(sim, self.step, self._clock, self._mrng)
            if table is not None:
                metrics.append(table)
            self.step += 1
        files = _write_by_rank(self._pool, self.out, "spans", _span_table(sim.spans.take(), sim.group_names),
                               self.run_id, step_logs=self.step_logs) * 2
        files += _write_by_rank(self._pool, self.out, "markers", _marker_table(sim.markers.take(), sim.group_names),
                                self.run_id)
        if metrics:
            files += _write_by_rank(self._pool, self.out, "metrics", pa.concat_tables(metrics), self.run_id)
        return files

    def close(self) -> None:
        self._pool.shutdown()
