"""The per-rank collector: spans, steps, communication with arrival times, metrics.

Role in the data flow: the in-job stage. A training loop (the bundled trainer or anyone's) creates
one :class:`Collector` per rank; it timestamps code segments without synchronizing the device
(:mod:`megascope.collectors.timing`), queues rows in bounded buffers, and a writer thread
(:mod:`megascope.collectors.writer`) turns them into Parquet parts of the run directory.

Example::

    col = Collector(CollectorConfig(run_dir=Path("runs/job")), rank=rank, world_size=world,
                    coords={"pp": 0, "dp": rank, "tp": 0}, meta=run_meta)
    col.register_group(None, Group("world", "world", tuple(range(world))))
    for step in range(steps):
        with col.step(step):
            with col.span("forward", kind=SpanKind.FORWARD, microbatch=0):
                loss = model(batch)
            loss.backward()
            col.dist.all_reduce(grads)            # a timed all-reduce with markers
        col.metric("loss", loss)                  # resolved later, no .item()
    col.close()

Communication spans start at the rank's *arrival* (just before launch) and end at completion, so
in one collective instance the last arriver is the straggler. Sequence numbers are counted here per
group id (per (sender, receiver) pair for point-to-point), so members that issue the same
collectives in the same order agree on them. An ``enqueued`` marker is queued before the call and
a ``completed`` marker once the end is resolved, which is what hang localization reads.

The collector never raises into the training loop: internal failures are logged once and counted
in :attr:`Collector.stats`.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any

from megascope.collectors.buffers import rows_to_table
from megascope.collectors.config import SAMPLED_CALLS_MIN_TIMED, CollectorConfig
from megascope.collectors.contexts import NOOP, CommHandle, SpanContext, StepContext, StepLevel
from megascope.collectors.evidence import AgentLink, StackWatch, enable_nccl_flight_recorder
from megascope.collectors.runid import RunId, new_run_id, resolve_run_id
from megascope.collectors.timing import CudaTimer, Timer, make_timer, resolve_device
from megascope.collectors.writer import Sink, Writer

from megascope.schema import (
    GROUPS,
    RANKS,
    CollectiveOp,
    GroupKind,
    RunMeta,
    RunSource,
    SpanKind,
    Stream,
)
from megascope.topology import Group

log = logging.getLogger(__name__)

# Calls held for their waits (Collector.hold) at most: past it, nothing waits for them, and they
# are written as they are (a job that never ends a step).
MAX_HELD = 256
_COMM_KINDS = frozenset({SpanKind.COLLECTIVE.value, SpanKind.SEND.value, SpanKind.RECV.value})
_HOST_KINDS = frozenset({SpanKind.HOST.value, SpanKind.DATA.value})
# Kinds whose spans say the job times its own forward and backward (see ``_times_compute``).
_OWN_COMPUTE_KINDS = frozenset({SpanKind.FORWARD.value, SpanKind.BACKWARD.value})
_KINDS = frozenset(k.value for k in SpanKind)
_SEND = SpanKind.SEND.value
_RECV = SpanKind.RECV.value

__all__ = ["NOOP", "Collector"]


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


class Collector:
    """One rank's collector. See the module docstring; the API is the agreed contract."""

    def __init__(
        self,
        config: CollectorConfig,
        rank: int | None = None,
        world_size: int | None = None,
        coords: dict[str, int] | None = None,
        groups: list[Group] | None = None,
        meta: RunMeta | None = None,
    ) -> None:
        self.config = config = config.with_env()
        self.rank = rank if rank is not None else _env_int("RANK") or 0
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE") or 1
        # The writer's and the marker agent's interval: longer in a big job (config.job_parts_per_s).
        self.flush_interval_s = config.flush_interval_for(self.world_size)
        self.coords = dict(coords or {})
        self.enabled = config.enabled
        self._active = False  # recording: open and not paused (what every hot path checks)
        self._open = False  # started and not closed
        self._step: int | None = None
        self._last_step: int | None = None
        self._microbatch: int | None = None
        self._chunk: int | None = None
        # Set once the job opens a forward or backward span of its own (its code, or its modules'
        # hooks): the whole-model spans of the DDP door (megascope.collectors.modules.time_model)
        # then stand aside rather than count that time twice.
        self._times_compute = False
        self._seqs: dict[Any, int] = {}
        self._comm_specs: dict[Any, tuple[str, str, Any, str, str, bool]] = {}
        self._sample_mbs = frozenset(config.comm_sample_microbatches)
        self._sample_every = config.comm_sample_every
        self._sample_calls = config.comm_sample_calls
        # A group's step-level calls are sampled once it issued this many the step before.
        self._sample_calls_floor = config.comm_sample_calls * SAMPLED_CALLS_MIN_TIMED
        self._sampled_calls: dict[str, int] = {}  # group -> calls this step, where comm_sample_kinds applies
        # group -> its step-level calls this step, and in the step before (comm_sample_calls).
        self._step_calls: dict[str, int] = {}
        self._prev_step_calls: dict[str, int] = {}
        self._groups: dict[str, Group] = {}
        self._groups_by_pg: dict[Any, Group] = {}
        self._groups_by_name: dict[str, Group] = {}  # torch group_name -> Group (flight recorder)
        self._internal_errors = 0
        # Calls held until their caller's stream waits for them (CommHandle.hold): written then,
        # or at the step's end (or close) where nothing waited.
        self._held: list[Any] = []
        self._untimed_calls = 0  # communication calls left untimed by comm_sample_kinds
        self._warned: set[str] = set()
        self._dist: Any = None
        self._heartbeat: Any = None
        self._interception: Any = None  # megascope.collectors.hooks.Interception, from from_env
        self.device: Any = None
        self._device_checked = False
        if not self.enabled:
            return
        self.device = resolve_device(config.device)
        self._timer: Timer = self._make_timer()
        self._sink = Sink(config.max_buffered_rows)
        self.start_ns = time.time_ns()
        # The id every part of this rank carries, run.json's (megascope.collectors.runid): the
        # launcher's where it gives one, else rank 0's, which the other ranks read from run.json.
        self._run_id: RunId = resolve_run_id(rank=self.rank, world_size=self.world_size, run_dir=config.run_dir,
                                             own_id=meta.run_id if meta is not None else None,
                                             start_ns=self.start_ns)
        self._writer = Writer(
            config.run_dir, rank=self.rank, sink=self._sink, timer=self._timer,
            interval_s=self.flush_interval_s, capacity=config.max_buffered_rows, duty=config.writer_duty,
            run_id=self._run_id.get, align_steps=config.align_passes,
        )
        self._gc_watch: _GcWatch | None = None  # before any thread that reads stats starts
        # config.switch_interval_us: (the job's interval, the collector's), put back at close.
        self._switch: tuple[float, float] | None = None
        self._agent: AgentLink | None = None
        self._stacks: StackWatch | None = None
        self._node_compaction: Any = None  # megascope.collectors.node_compact.NodeCompaction
        self._start_witnesses()
        self._writer.set_static("ranks", rows_to_table([self._rank_row()], RANKS))
        for group in groups or ():
            self._add_group(group)
        # Without run.json a run directory is unreadable: a plain one stands in for a missing meta.
        self._meta = meta or RunMeta(
            run_id=new_run_id(config.run_dir, self.start_ns), source=RunSource.COLLECTOR.value,
            world_size=self.world_size, start_ns=self.start_ns, device_name=None,
        )
        if self.rank == 0:
            own = self._run_id.get()
            if own is not None and own != self._meta.run_id:
                self._meta = dataclasses.replace(self._meta, run_id=own)
            # At once, not at the writer's first pass: the other ranks may be waiting to read the id.
            self._writer.set_run_meta(self._meta)
            self._writer.write_run_meta_now()
        if config.flight_recorder:
            from megascope.collectors.flight_recorder import FlightRecorderPoller

            self._writer.pollers.append(FlightRecorderPoller(self))
        self._active = self._open = True
        self._writer.start()
        if config.heartbeat_interval_s:
            from megascope.collectors.heartbeat import HeartbeatSampler

            # The same host string as the ranks table, so heartbeats join to ranks by host.
            self._heartbeat = HeartbeatSampler(
                config.run_dir, rank=self.rank, host=socket.gethostname(), interval_s=config.heartbeat_interval_s,
                stats_fn=lambda: self.stats, log_path=os.environ.get("MEGASCOPE_LOG_PATH"),
                run_id=self._run_id.get, cuda_device=self.device.index if self.device.type == "cuda" else None,
            ).start()
        if config.gc_span_min_ms is not None:
            self._gc_watch = _GcWatch(self, int(config.gc_span_min_ms * 1e6))
            gc.callbacks.append(self._gc_watch)
        if config.switch_interval_us:
            self._switch = (sys.getswitchinterval(), config.switch_interval_us / 1e6)
            sys.setswitchinterval(self._switch[1])
        if config.node_compact_every_s is not None:
            self._start_node_compaction(config.node_compact_every_s)
        self._install_exit_hooks()

    @classmethod
    def from_env(cls, run_dir: Any = None, *, mesh: Any = None, groups: Any = None, intercept: bool = True,
                 **settings: Any) -> Collector:
        """A collector laid out from the launcher's environment (torchrun, Slurm), a ``DeviceMesh`` or
        the job's own process groups, with run.json written and every collective of the job seen (see
        :mod:`megascope.collectors.setup`)::

            col = Collector.from_env("runs/job42")                 # DDP / FSDP: dp = world
            col = Collector.from_env("runs/job42", mesh=mesh)      # mesh dims named e.g. ("dp", "tp")
            col = Collector.from_env("runs/job42", groups={"tp": tp_pg, "pp": pp_pg, "dp": dp_pg})
        """
        from megascope.collectors.setup import from_env

        return from_env(run_dir, mesh=mesh, groups=groups, intercept=intercept, **settings)

    # ------------------------------------------------------------------ setup helpers
    def _start_witnesses(self) -> None:
        """The hang evidence that needs no Python of this process (megascope.collectors.evidence)."""
        config = self.config
        if config.marker_agent:
            try:
                self._agent = AgentLink.start(config.run_dir, rank=self.rank, host=socket.gethostname(),
                                              interval_s=self.flush_interval_s, run_id=self._run_id.get())
                if not self._run_id.known:  # tell the agent once this rank has read it from run.json
                    self._run_id.on_known(self._agent.set_run_id)
                self._sink.markers = self._agent.ring  # type: ignore[assignment]
                self._writer.markers_elsewhere = True
            except Exception as exc:
                log.warning("megascope collector (rank %d): no marker agent (%s); markers are written by the "
                            "writer thread, which a hang can stop", self.rank, exc)
        if config.stacks_after_s is not None:
            try:
                self._stacks = StackWatch(config.run_dir, self.rank, config.stacks_after_s)
            except OSError as exc:
                log.warning("megascope collector (rank %d): no stack dumps (%s)", self.rank, exc)
        if config.nccl_flight_recorder and self.device.type == "cuda":
            enable_nccl_flight_recorder(config.run_dir)

    def _start_node_compaction(self, every_s: float) -> None:
        """On the node's first local rank: its ranks' compaction, beside the job (config)."""
        from megascope.collectors.node_compact import NodeCompaction, node_ranks

        try:
            ranks = node_ranks(self.rank, self.world_size)
            if ranks is None:
                return
            min_age = self.config.node_compact_min_age_s
            if min_age is None:
                min_age = max(10.0, 3 * self.flush_interval_s)
            self._node_compaction = NodeCompaction.start(self.config.run_dir, ranks, socket.gethostname(), every_s,
                                                         min_age)
        except Exception as exc:
            log.warning("megascope collector (rank %d): the node's compaction is not running (%s)", self.rank, exc)

    def _rank_row(self) -> tuple[Any, ...]:
        device_name = None
        if self.device.type == "cuda":
            try:
                import torch

                device_name = torch.cuda.get_device_name(self.device)
            except Exception:
                device_name = None
        # Every axis of the mesh, in its order (run.json's mesh_axes): cp and ep as pp, dp and tp.
        coords = [(axis, int(index)) for axis, index in self.coords.items()]
        return (self.rank, socket.gethostname(), _env_int("LOCAL_RANK"), os.getpid(), str(self.device),
                device_name, coords, self.start_ns)

    def _add_group(self, group: Group) -> None:
        if group.id in self._groups and self._groups[group.id] == group:
            return
        self._groups[group.id] = group
        rows = [(self.rank, g.id, str(g.kind), g.index_of(self.rank), list(g.members))
                for g in self._groups.values() if self.rank in g.members]
        self._writer.set_static("groups", rows_to_table(rows, GROUPS))

    def _install_exit_hooks(self) -> None:
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            col = ref()
            if col is not None:
                col.close()

        self._atexit = close_at_exit
        atexit.register(close_at_exit)
        self._prev_sigterm: Any = None
        if self.config.handle_sigterm and threading.current_thread() is threading.main_thread():
            try:
                self._prev_sigterm = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._sigterm_installed = True
            except (ValueError, OSError):
                self._sigterm_installed = False
        else:
            self._sigterm_installed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Write what is ready without waiting on the device, then let the signal do what it did before.
        if self._open:
            self._writer.flush(lock_timeout_s=2.0)
            if self._agent is not None:
                self._agent.flush(timeout_s=2.0)
        prev = self._prev_sigterm
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _internal_error(self, where: str) -> None:
        self._internal_errors += 1
        if where not in self._warned:
            self._warned.add(where)
            log.warning("megascope collector (rank %d): internal error in %s; counted, training continues",
                        self.rank, where, exc_info=True)

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------------ groups
    def register_group(self, pg: Any, group: Group) -> None:
        """Map a torch process group (None: the default group) to a megascope group id."""
        if not self.enabled:
            return
        if self.rank not in group.members:
            self._warn_once(f"member:{group.id}", "megascope collector: rank %d registers group %s but is not "
                            "one of its members %s", self.rank, group.id, group.members)
        self._groups_by_pg[pg] = group
        name = getattr(pg, "group_name", None)
        if pg is None:
            name = self._default_group_name()
        if name:
            self._groups_by_name[str(name)] = group
        self._add_group(group)

    @staticmethod
    def _default_pg() -> Any:
        try:
            import torch.distributed as dist

            return dist.group.WORLD if dist.is_initialized() else None
        except Exception:
            return None

    @staticmethod
    def _default_group_name() -> str | None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                return str(dist.group.WORLD.group_name)  # type: ignore[union-attr]
        except Exception:
            pass
        return None

    def group_id(self, pg: Any) -> str:
        """The megascope group id of a torch process group (registering a fallback if unknown)."""
        group = self._groups_by_pg.get(pg)
        if group is None:
            if pg is not None and pg is self._default_pg():  # e.g. P2POp fills in the default group
                group = self._groups_by_pg.get(None)
            group = group or self._fallback_group(pg)
            self._groups_by_pg[pg] = group
            self._add_group(group)
        return group.id

    def _fallback_group(self, pg: Any) -> Group:
        if pg is None or pg is self._default_pg():
            return Group("world", GroupKind.WORLD.value, tuple(range(self.world_size)))
        try:
            import torch.distributed as dist

            members = tuple(dist.get_process_group_ranks(pg))
            name = str(getattr(pg, "group_name", "") or len(self._groups))
        except Exception:
            members, name = (self.rank,), str(len(self._groups))
        # Another communicator over the ranks of a named group (a job may keep several over the same
        # ranks, e.g. data-parallel with and without context parallelism): it is that group.
        for known in list(self._groups.values()):
            if known.members == members and known.kind != GroupKind.WORLD.value:
                return known
        self._warn_once(f"unregistered:{name}", "megascope collector: process group %s was not registered; "
                        "recording it as group 'pg:%s' (call Collector.register_group to name it)", name, name)
        return Group(f"pg:{name}", GroupKind.OTHER.value, members)

    # ------------------------------------------------------------------ spans
    def _label(self, kind: str, stream: Any) -> tuple[Any, str]:
        """(stream to record on, stream label) for a span of ``kind``."""
        if isinstance(stream, str):
            return None, stream
        if stream is None:
            if kind in _COMM_KINDS:
                return None, Stream.COMM.value
            return None, Stream.HOST.value if kind in _HOST_KINDS else Stream.COMPUTE.value
        if not self._timer.is_device:
            return None, Stream.HOST.value
        try:
            import torch

            if stream == torch.cuda.default_stream(self.device):
                return stream, Stream.COMPUTE.value
            return stream, f"cuda:{stream.stream_id}"
        except Exception:
            return stream, Stream.COMPUTE.value

    def _kind(self, kind: Any) -> str:
        value = str(kind.value if isinstance(kind, SpanKind) else kind)
        if value not in _KINDS:
            self._warn_once(f"kind:{value}", "megascope collector: unknown span kind %r, recorded as 'other'", value)
            return SpanKind.OTHER.value
        return value

    def span(self, name: str, kind: SpanKind | str = SpanKind.COMPUTE, microbatch: int | None = None,
             chunk: int | None = None, stream: Any = None) -> Any:
        """A timed span, as ``with`` block or decorator. ``stream``: a device stream or a label."""
        if not self._active:
            return NOOP
        kind_s = self._kind(kind)
        if kind_s in _OWN_COMPUTE_KINDS:
            self._times_compute = True
        return self._span(name, kind_s, microbatch, chunk, stream)

    def _span(self, name: str, kind: str, microbatch: int | None = None, chunk: int | None = None,
              stream: Any = None) -> SpanContext:
        """:meth:`span` of a known kind, without telling the collector that the job times its own
        compute (the model spans of megascope.collectors.modules use it)."""
        record_on, label = self._label(kind, stream)
        return SpanContext(self, name, kind, record_on, label, microbatch, chunk)

    def step(self, step: int) -> Any:
        """A ``step`` span; inside it every span, marker and metric belongs to ``step``."""
        if not self._active:
            return NOOP
        if not self._device_checked:
            self._check_device()
            self._note_collective_timeout()
            if self._interception is not None:
                self._interception.install_late()
        return StepContext(self, int(step), Stream.HOST.value)

    def _note_collective_timeout(self) -> None:
        """Once, at the first step, on rank 0: the job's process-group timeout into run.json
        (``config.collective_timeout_s``) where the job did not say it. It is when the job itself
        gives up on a call, the run state's hang threshold; without it a job that hangs in its
        first steps has no healthy step to measure one by."""
        if self.rank != 0 or not self.enabled or (self._meta.config or {}).get("collective_timeout_s") is not None:
            return
        try:
            import torch
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return
            group = dist.distributed_c10d._get_default_group()
            for device in (self.device, torch.device("cpu")):
                try:
                    timeout = group._get_backend(device).options._timeout  # private: torch 2.x
                except Exception:
                    continue
                seconds = float(timeout.total_seconds())
                if seconds > 0:
                    config = {**(self._meta.config or {}), "collective_timeout_s": seconds}
                    self._meta = dataclasses.replace(self._meta, config=config)
                    self._writer.set_run_meta(self._meta)
                return
        except Exception:
            log.debug("megascope: the process group's timeout is unknown", exc_info=True)

    def _check_device(self) -> None:
        """Once, at the first step: the job's CUDA device is the one the spans are stamped on, and a
        job that has put nothing on a GPU by then (a CPU job on a GPU host) is timed by the host
        clock, unless it chose the device itself: events on an idle GPU would time its host's
        launches and read as a device waiting for its host (``device_idle_frac``)."""
        self._device_checked = True
        timer = self._timer
        if not isinstance(timer, CudaTimer):
            return
        try:
            import torch

            current = torch.cuda.current_device()
            unused = (self.config.device is None and timer.untouched
                      and not any(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())))
        except Exception:
            return
        if unused:
            self._host_clock()
            return
        if current != self.device.index:
            self._warn_once("device", "megascope collector: spans are stamped on cuda:%d but the job runs on cuda:%d; "
                            "make the collector after torch.cuda.set_device, or pass device=", self.device.index, current)

    def _make_timer(self) -> Timer:
        """The timer of ``self.device``, as the config asks."""
        config = self.config
        return make_timer(self.device, anchor_interval_s=config.anchor_interval_s,
                          max_events=2 * config.max_buffered_rows + 64, clock=config.clock,
                          event_calls=config.event_calls, record_calls=config.record_calls)

    def _host_clock(self) -> None:
        """Stamp on the host clock from now on (no event was recorded yet, so nothing pending
        refers to the device's) and say so in the ranks table."""
        self.device = resolve_device("cpu")
        self._timer = self._make_timer()
        self._writer.timer = self._timer
        self._writer.set_static("ranks", rows_to_table([self._rank_row()], RANKS))
        log.info("megascope collector (rank %d): the job put nothing on a GPU before its first step; its spans "
                 "are timed by the host clock (pass device= to choose)", self.rank)

    def _close_span(self, token: Any, anchor: Any, stream: Any, step: int | None, name: str, kind: str, label: str,
                    microbatch: int | None, chunk: int | None, group: str | None, seq: int | None,
                    op: str | None, nbytes: int | None, peer: int | None, wait: Any = None,
                    end: Any = None) -> None:
        """Stamp the end and queue the span for the writer. ``wait``: the stamp where the caller
        began waiting for this communication call; the writer then also writes its wait span,
        which ends at the same stamp. ``end``: the end, stamped already (a held call's:
        :meth:`CommHandle.hold`)."""
        timer = self._timer
        if end is None:
            try:
                end = timer.stamp(stream)
            except Exception:
                self._internal_error("span end")
        if token is None or end is None:  # timer exhausted or failed: drop, keep the pool whole
            timer.release(token)
            timer.release(end)
            timer.release(wait)
            self._sink.pending_spans.dropped += 1
            return
        if not self._sink.pending_spans.put(  # PENDING_SPAN_ROW (megascope.collectors.buffers)
            (token, end, anchor, step, name, kind, label, microbatch, chunk, group, seq, op, nbytes, peer, wait)
        ):
            timer.release(token)
            timer.release(end)
            timer.release(wait)

    def hold(self, handle: Any) -> bool:
        """Keep ``handle`` (a communication call) until its caller's stream waits for it:
        :meth:`CommHandle.hold`. False where it was not held (end it now)."""
        if len(self._held) >= MAX_HELD:  # nothing waits for them: write them as they are
            self.release_held()
        if not handle.hold():
            return False
        self._held.append(handle)
        return True

    def release_held(self) -> None:
        """Write the held calls no wait came for (at a step's end, and at close)."""
        held, self._held = self._held, []
        for handle in held:
            handle.end()

    def _close_untimed(self, stream: Any, step: int | None, group: str, seq: int, op: str, nbytes: int | None,
                       peer: int | None) -> None:
        """An untimed communication call has been waited for: queue its completion for the writer,
        read from a timing-free event."""
        try:
            mark = self._timer.mark(stream)
        except Exception:
            self._internal_error("comm mark")
            mark = None
        if mark is None:
            self._sink.pending_marks.dropped += 1
        elif not self._sink.pending_marks.put((mark, step, group, seq, op, nbytes, peer)):  # PENDING_MARK_ROW
            self._timer.release_mark(mark)
        self._untimed_calls += 1

    # ------------------------------------------------------------------ communication
    def comm_begin(self, op: CollectiveOp | str, group: str = "world", bytes: int | None = None,
                   kind: SpanKind | str = SpanKind.COLLECTIVE, peer: int | None = None, stream: Any = None,
                   name: str | None = None) -> Any:
        """Arrival at a communication call: queue the ``enqueued`` marker, stamp the start.

        Returns a handle; call ``end()`` once the operation has completed (after ``work.wait()``).
        Point-to-point (``kind`` send/recv) needs ``peer``, the other global rank.
        """
        if not self._active:
            return NOOP
        try:
            # What depends only on (op, kind, group, name) is worked out once: a trainer issues
            # hundreds of calls per step from a handful of call sites.
            key = (op, kind, group, name) if stream is None else None
            spec = self._comm_specs.get(key) if key is not None else None
            if spec is None:
                spec = self._comm_spec(op, group, kind, stream, name)
                if key is not None and len(self._comm_specs) < 4096:
                    self._comm_specs[key] = spec
            kind_s, op_s, record_on, label, name, sampled = spec
            timed = True
            if sampled:
                self._sampled_calls[group] = self._sampled_calls.get(group, 0) + 1
                mb = self._microbatch
                if mb is None:
                    # A step-level call: all timed, or one in comm_sample_calls by its place in the
                    # step once the group issued enough of them the step before: the same calls on
                    # every member of the group (they issue the same calls).
                    timed = True
                    every = self._sample_calls
                    if every:
                        index = self._step_calls.get(group, 0)
                        self._step_calls[group] = index + 1
                        if self._prev_step_calls.get(group, 0) >= self._sample_calls_floor:
                            timed = (index - (self._step or 0)) % every == 0
                elif self._sample_every:
                    timed = (mb - (self._step or 0)) % self._sample_every == 0
                else:
                    timed = mb in self._sample_mbs
            seqs = self._seqs
            seq_key: Any = group
            if kind_s == _SEND:
                seq_key = (group, self.rank, peer)
            elif kind_s == _RECV:
                seq_key = (group, peer, self.rank)
            seq = seqs.get(seq_key, 0)
            seqs[seq_key] = seq + 1
            return CommHandle(self, name, kind_s, label, group, seq, op_s, None if bytes is None else int(bytes), peer,
                              record_on, timed)
        except Exception:
            self._internal_error("comm begin")
            return NOOP

    def _comm_spec(self, op: CollectiveOp | str, group: str, kind: SpanKind | str, stream: Any,
                   name: str | None) -> tuple[str, str, Any, str, str, bool]:
        """(kind, op, stream to record on, stream label, span name, timed in sampled micro-batches
        only) of a communication call."""
        kind_s = self._kind(kind)
        op_s = str(op.value if isinstance(op, CollectiveOp) else op)
        if group not in self._groups and group == GroupKind.WORLD.value:
            self._add_group(self._fallback_group(None))
        record_on, label = self._label(kind_s, stream)
        prefix = group.split(":", 1)[0]
        known = self._groups.get(group)
        sampled = (known.kind if known is not None else prefix) in self.config.comm_sample_kinds
        return kind_s, op_s, record_on, label, name if name is not None else f"{prefix}.{op_s}", sampled

    def step_level(self) -> Any:
        """A ``with`` block whose communication calls belong to the step rather than to the
        micro-batch being run: a gradient sync that a backward hook launches, say. Their spans get
        no micro-batch, and ``comm_sample_kinds`` always times them."""
        if not self._active:
            return NOOP
        return StepLevel(self)

    def comm(self, op: CollectiveOp | str, group: str = "world", bytes: int | None = None,
             kind: SpanKind | str = SpanKind.COLLECTIVE, peer: int | None = None, stream: Any = None,
             name: str | None = None) -> Any:
        """A blocking communication call as a ``with`` block: arrival at enter, completion at exit."""
        return self.comm_begin(op=op, group=group, bytes=bytes, kind=kind, peer=peer, stream=stream, name=name)

    @property
    def dist(self) -> Any:
        """A mirror of torch.distributed whose calls are timed (see :mod:`megascope.collectors.dist`)."""
        if self._dist is None:
            from megascope.collectors.dist import DistMirror

            self._dist = DistMirror(self)
        return self._dist

    # ------------------------------------------------------------------ metrics
    def metric(self, name: str, value: Any, step: int | None = None) -> None:
        """A scalar of this step. A device tensor is copied to host asynchronously, read later."""
        if not self._active:
            return
        try:
            if step is None:
                step = self._step if self._step is not None else self._last_step
            if step is None:
                self._warn_once("metric-step", "megascope collector: metric %r outside any step and without "
                                "step=; dropped", name)
                self._sink.metrics.dropped += 1
                return
            now = time.time_ns()
            if isinstance(value, int | float):
                self._sink.metrics.put((self.rank, int(step), name, float(value), now))  # METRIC_ROW
                # A Python number from a device value means the host just waited for the device:
                # a free moment to refresh the clock anchor.
                self._timer.maybe_refresh()
                return
            tensor = value.detach()
            if tensor.device.type != "cuda":
                self._sink.metrics.put((self.rank, int(step), name, float(tensor), now))  # METRIC_ROW
                return
            free = self._sink.pinned.get(tensor.dtype)
            if free:
                host = free.pop()
            else:
                import torch

                host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.reshape(()), non_blocking=True)
            mark = self._timer.mark(None)  # a pooled event: the writer never destroys one
            if mark is None:
                self._sink.pending_metrics.dropped += 1
                free_list = self._sink.pinned.setdefault(tensor.dtype, [])
                free_list.append(host)
                return
            if not self._sink.pending_metrics.put((int(step), name, None, host, mark, now)):  # PENDING_METRIC_ROW
                self._timer.release_mark(mark)
        except Exception:
            self._internal_error("metric")

    def set_model_flops(self, model: Any = None, *, tokens_per_step: int | None = None,
                        flops_per_step: float | None = None, peak_flops_per_device: float | None = None) -> None:
        """Make MFU known: the job's model FLOPs per step (given, or ``6 x parameters x tokens`` of
        ``model``), the global tokens per step and the device's peak go into run.json (rank 0).
        See :mod:`megascope.collectors.flops`."""
        if not self._open:
            return
        try:
            from megascope.collectors.flops import set_model_flops

            set_model_flops(self, model, tokens_per_step=tokens_per_step, flops_per_step=flops_per_step,
                            peak_flops_per_device=peak_flops_per_device)
        except Exception:
            self._internal_error("set_model_flops")

    def count_flops(self, *, tokens_per_step: int | None = None, peak_flops_per_device: float | None = None) -> Any:
        """A ``with`` block (one step) whose FLOPs ``torch.utils.flop_counter`` counts; this rank's
        count times the world size becomes the model FLOPs per step in run.json."""
        if not self._open:
            return NOOP
        from megascope.collectors.flops import CountFlops

        return CountFlops(self, tokens_per_step, peak_flops_per_device)

    def mark_sync_point(self) -> None:
        """Tell the collector the host just waited for the device (e.g. after ``loss.item()``)."""
        if self._open:
            try:
                self._timer.maybe_refresh()
            except Exception:
                self._internal_error("anchor refresh")

    # ------------------------------------------------------------------ lifecycle
    def pause(self) -> None:
        """Record nothing until :meth:`resume`: spans, steps, communication calls and metrics are no-ops.

        What was recorded before is still resolved and written, and a span or asynchronous call
        begun before the pause is recorded when it ends. For leaving stretches of a job out, and
        for measuring what the collector costs inside one process (``megascope train
        --collector-ab``). Call it between steps.
        """
        if self._open:
            self._active = False

    def resume(self) -> None:
        """Record again after :meth:`pause`."""
        if self._open:
            self._active = True

    @property
    def run_id(self) -> str | None:
        """The run id this rank stamps into its parts (``run.json``'s), or None while a rank other
        than 0 has not yet read it from rank 0's ``run.json`` (:mod:`megascope.collectors.runid`)."""
        return self._run_id.get() if self.enabled else None

    @property
    def paused(self) -> bool:
        return self._open and not self._active

    @property
    def recording(self) -> bool:
        """Open, enabled and not paused."""
        return self._active

    def flush(self) -> None:
        """Resolve what is ready and write it now (blocks until written; never waits on the device)."""
        if self._open:
            self._writer.flush()
            if self._agent is not None and not self._agent.flush(timeout_s=10.0):
                self._warn_once("agent-flush", "megascope collector (rank %d): the marker agent did not answer a "
                                "flush in 10 s; its markers reach the disk at its next pass", self.rank)

    def close(self) -> None:
        """Flush everything (waiting up to ``close_timeout_s`` for device events) and stop the writer."""
        if not self._open:
            return
        self._active = self._open = False
        if self._interception is not None:
            try:
                self._interception.uninstall()
            except Exception:
                self._internal_error("interception uninstall")
        try:
            atexit.unregister(self._atexit)
            if self._sigterm_installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_sigterm)
        except Exception:
            pass
        if self._gc_watch is not None and self._gc_watch in gc.callbacks:
            gc.callbacks.remove(self._gc_watch)
        if self._switch is not None and sys.getswitchinterval() == self._switch[1]:  # unless changed since
            sys.setswitchinterval(self._switch[0])
        self.release_held()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._writer.close(timeout_s=self.config.close_timeout_s)
        if self._agent is not None:
            # The agent may still be starting (a second or so): give it time before writing here.
            self._agent.close(timeout_s=max(10.0, 2 * self.flush_interval_s))
        if self._stacks is not None:
            self._stacks.close()
        if self._node_compaction is not None:
            self._node_compaction.close()
        stats = self.stats
        if stats["rows_dropped"] or stats["write_errors"]:
            log.warning("megascope collector (rank %d) closed: %d rows dropped, %d write errors",
                        self.rank, stats["rows_dropped"], stats["write_errors"])

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: rows written per table, rows dropped, write errors, spans pending, ..."""
        if not self.enabled:
            return {"enabled": False, "rows_written": 0, "rows_dropped": 0, "write_errors": 0, "spans_pending": 0}
        w = self._writer
        return {
            "enabled": True,
            "rows_written": sum(w.rows_written.values()),
            "rows_written_by_table": dict(w.rows_written),
            "rows_dropped": self._sink.dropped + w.rows_lost + w.rows_malformed
            + (self._agent.lost_rows if self._agent else 0),
            "write_errors": w.write_errors,
            "spans_pending": len(self._sink.pending_spans),
            "rows_buffered": len(self._sink.spans) + len(self._sink.markers) + len(self._sink.metrics) + w.pending_rows,
            "parts_written": w.parts_written,
            "aligned_passes": w.aligned_passes,
            "pass_every_steps": w.every_steps,
            "internal_errors": self._internal_errors + w.internal_errors,
            "anchors_taken": self._timer.anchors_taken,
            # CUDA anchors whose record call came back late (kept only as a first anchor), and the
            # latest return seen: what an anchor's wall time could have been off by, twice over.
            "anchors_loose": getattr(self._timer, "anchors_loose", 0),
            "anchor_bracket_max_ns": getattr(self._timer, "anchor_bracket_max_ns", 0),
            # How the training thread records CUDA events, and the records the driver refused
            # (made through torch instead).
            "record_calls": getattr(self._timer, "record_calls", "host"),
            "record_fallbacks": getattr(self._timer, "record_fallbacks", 0),
            "gc_spans": self._gc_watch.recorded if self._gc_watch is not None else 0,
            "untimed_calls": self._untimed_calls,
            "marker_agent": self._agent is not None,
            "device": str(self.device),
        }


class _GcWatch:
    """A ``gc.callbacks`` entry: a host span for every collection of at least ``min_ns``.

    A collection runs on whichever thread allocated last (the training thread or the writer) and
    holds the interpreter throughout, so every thread of the rank stops for its length. Collections
    never overlap one another, so one start time is enough.
    """

    __slots__ = ("_col", "_min_ns", "_t0", "recorded")

    def __init__(self, col: Collector, min_ns: int) -> None:
        self._col = weakref.ref(col)
        self._min_ns = min_ns
        self._t0 = 0
        self.recorded = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
            return
        dur = time.perf_counter_ns() - self._t0
        col = self._col()
        if dur < self._min_ns or col is None or not col._active:
            return
        end = time.time_ns()
        # SPAN_ROW (megascope.collectors.buffers)
        if col._sink.spans.put((col.rank, col._step, f"gc.gen{info.get('generation', 2)}", SpanKind.HOST.value,
                                Stream.HOST.value, end - dur, dur, None, None, None, None, None, None, None)):
            self.recorded += 1
