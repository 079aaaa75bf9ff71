"""Configuration of the in-job collector: one keyword-only frozen dataclass.

Role in the data flow: the training script builds a :class:`CollectorConfig` and hands it to
:class:`megascope.collectors.Collector`. ``MEGASCOPE_*`` environment variables override what the
script wrote, so an operator can switch the collector off or move its output without editing code:

====================================  ===========================================
``MEGASCOPE_DISABLE=1``               ``enabled=False``
``MEGASCOPE_RUN_DIR=PATH``            ``run_dir``
``MEGASCOPE_FLUSH_INTERVAL_S=2``      ``flush_interval_s``
``MEGASCOPE_JOB_PARTS_PER_S=1024``    ``job_parts_per_s`` (0: every rank at ``flush_interval_s``)
``MEGASCOPE_MAX_BUFFERED_ROWS=N``     ``max_buffered_rows``
``MEGASCOPE_FLIGHT_RECORDER=1``       ``flight_recorder=True``
``MEGASCOPE_HEARTBEAT_S=5``           ``heartbeat_interval_s`` (0 turns it off)
``MEGASCOPE_WAIT_SPANS=0``            ``wait_spans=False``
``MEGASCOPE_CLOCK=host``              ``clock`` (``device``, ``side-stream`` or ``host``)
``MEGASCOPE_EVENT_CALLS=driver``      ``event_calls`` (``driver``, ``driver-held`` or ``torch``)
``MEGASCOPE_RECORD_CALLS=driver``     ``record_calls`` (``driver`` or ``torch``)
``MEGASCOPE_WRITER_DUTY=0.25``        ``writer_duty`` (1 turns the writer's pacing off)
``MEGASCOPE_ALIGN_PASSES=0``          ``align_passes=False``
``MEGASCOPE_SWITCH_INTERVAL_US=500``  ``switch_interval_us`` (0: left as the job set it)
``MEGASCOPE_GC_SPAN_MS=1``            ``gc_span_min_ms`` (a negative value turns GC spans off)
``MEGASCOPE_COMM_SAMPLE=tp``          ``comm_sample_kinds`` (comma-separated; ``none`` times every call)
``MEGASCOPE_COMM_SAMPLE_CALLS=4``     ``comm_sample_calls`` (0: every step-level call of those kinds)
``MEGASCOPE_MARKER_AGENT=0``          ``marker_agent=False``
``MEGASCOPE_STACKS_AFTER_S=30``       ``stacks_after_s`` (0 turns stack dumps off)
``MEGASCOPE_NCCL_FLIGHT_RECORDER=0``  ``nccl_flight_recorder=False``
``MEGASCOPE_MODEL_SPANS=0``           ``model_spans=False``
``MEGASCOPE_HOST_PROBE_EVERY=10``     ``host_probe_every`` (0 turns the probe off)
``MEGASCOPE_COMPACT_EVERY_S=60``      ``node_compact_every_s`` (0 turns it off)
``MEGASCOPE_COMPACT_MIN_AGE_S=30``    ``node_compact_min_age_s``
====================================  ===========================================

Example::

    cfg = CollectorConfig(run_dir=Path("runs/job42"), flush_interval_s=1.0)
    cfg = cfg.with_env()      # what Collector does itself
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascope.errors import ConfigError

CLOCKS = ("device", "side-stream", "host")
EVENT_CALLS = ("driver", "driver-held", "torch")
RECORD_CALLS = ("driver", "torch")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def _env_number(name: str, raw: str, kind: type) -> Any:
    try:
        return kind(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a{'n integer' if kind is int else ' number'}") from None


# comm_sample_calls samples a group's step-level calls only where it keeps at least this many
# timed a step.
SAMPLED_CALLS_MIN_TIMED = 8


@dataclass(frozen=True, kw_only=True)
class CollectorConfig:
    """Settings of one rank's collector.

    ``device=None`` picks the current CUDA device when CUDA is available, else the host clock;
    pass ``torch.device("cpu")`` to time a CPU (gloo) job on a machine that has GPUs.
    """

    run_dir: Path
    flush_interval_s: float = 1.0
    # The job's ranks together write about this many parts of a table a second at most: past that
    # many ranks, each flushes every world_size / job_parts_per_s seconds instead of every
    # flush_interval_s (see flush_interval_for; a 12,288-rank job flushes every 12 s). A part per
    # rank a second at 12,288 ranks is 12,288 files a second per table: a reader takes ~0.5 ms of
    # CPU a file, so a dashboard following the job needs 6 cores for that alone, and a file
    # system's metadata server sees 50,000 creates a second. 0: every rank at flush_interval_s.
    job_parts_per_s: float = 1024.0
    enabled: bool = True
    # Rows waiting in memory per table (and spans waiting for their device events); beyond it new
    # rows are dropped and counted, so a stalled disk never grows the job's memory.
    max_buffered_rows: int = 200_000
    device: Any = None  # torch.device | str | None
    # Device time is mapped to wall clock through anchors; a new one is taken at most this often,
    # and only when the stream is idle (a natural sync point), so taking it never waits.
    anchor_interval_s: float = 1.0
    # Copy torch's flight-recorder state (per process group: sequence ids and states) into the
    # markers table every flush. Off by default: it is a private torch API.
    flight_recorder: bool = False
    # Flush on SIGTERM (torchrun's way of stopping workers), then hand the signal on.
    handle_sigterm: bool = True
    # close() waits at most this long for device events of the last spans; never synchronizes.
    close_timeout_s: float = 5.0
    # Host, GPU and NIC heartbeats every this many seconds from a sampler thread (None: off).
    # Silence is data: the analysis flags a rank whose heartbeats stop.
    heartbeat_interval_s: float | None = None
    # A "<name>:wait" span for every wait on an asynchronous communication call (one more device
    # event per call, on the waiting stream). It is what tells exposed from overlapped
    # communication; off, asynchronous calls are analysed like blocking ones.
    wait_spans: bool = True
    # How a GPU rank timestamps. "device" records a timing event on the stream doing the work.
    # "side-stream" records a timing-free marker there and the timing event on a private stream
    # made to wait for it, so no timing event sits between the work's kernels (three API calls per
    # stamp instead of one). "host" records no device event at all, so spans say when the host
    # issued work, not when the device ran it (for telling the collector's host cost from its
    # device cost). CPU ranks always use the host clock.
    clock: str = "device"
    # How the writer thread asks the device events whether they are done and times them. "driver":
    # the CUDA driver's cuEventQuery and cuEventElapsedTime through ctypes, which let go of the
    # interpreter lock for the call, so a writer never holds it inside a driver call that waits
    # (torch's calls where the driver library cannot be loaded). "torch": torch.cuda.Event's
    # calls, which hold the lock while the driver runs them. In whole runs, the same rounds,
    # "driver" cost as much or less in every call: tp2 on 2x H200 -0.53% against +3.58%, a
    # Megatron-core job on 1x H200 -0.05% against +1.95%, then +1.13% against +1.05%
    # (docs/benchmarks-log.md, "The writer's event calls through the driver, the default").
    event_calls: str = "driver"
    # How the training thread records its spans' CUDA events. "driver": the driver's cuEventRecord
    # through ctypes, keeping the interpreter lock for the call. "torch": torch.cuda.Event.record,
    # which lets go of it, so that a writer waiting for the lock takes it at every record and the
    # training thread waits to get it back (torch's, where the driver library cannot be loaded, and
    # for any record the driver refuses).
    record_calls: str = "driver"
    # The writer thread's largest share of the interpreter lock while it works in the background:
    # it works in half-millisecond slices and sleeps between them (1: never sleeps). The training
    # thread launches the device's work from Python; a writer holding the lock for tens of
    # milliseconds at a stretch would stall it that long.
    writer_duty: float = 0.25
    # The writer's passes at the ends of the same steps on every rank (every K steps, K a power
    # of two that makes K steps about a flush interval), not at each rank's own moments: a pass
    # slows its rank, and a synchronous job goes at the pace of its slowest rank, so passes at
    # scattered moments slow nearly every step of a large job. Without steps, every interval.
    align_passes: bool = True
    # The interpreter's switch interval while the collector is open (sys.setswitchinterval), in
    # microseconds: how long a thread holding the interpreter lock keeps it once another thread
    # asks for it (Python's default: 5,000). The writer thread shares the lock with the training
    # thread, which waits for it up to that long each time. None: left as the job set it. On
    # 2x H200, tp2 whole runs of the bundled trainer (two interleaved rounds, one machine): 500
    # made the training thread wait half as often (116-132 voluntary switches a step against
    # 185-252) and read -1.46% / +0.78% (mean / p90) against the unrecorded runs, the default
    # -0.55% / +3.86% (docs/benchmarks-log.md); too few rounds to make it the default.
    switch_interval_us: int | None = None
    # A host span ("gc.gen0/1/2", kind host) for every garbage collection of the interpreter that
    # takes at least this many milliseconds (None: none). A full collection stops every thread
    # of the rank for tens of milliseconds, long enough to make one rank a straggler.
    gc_span_min_ms: float | None = 1.0
    # Communication calls on groups of these kinds (say ("tp",)) are timed only inside the
    # micro-batches listed in comm_sample_microbatches, and outside any micro-batch. The others
    # keep their enqueued and completed markers, so hang localization still sees every call, but
    # get no span: their completion is read from a timing-free event, which costs the device
    # nothing measurable, where a timed call costs it two or three timing events of ~2 us each.
    # A tp2 job with four micro-batches issues ~400 TP calls a step. Each step gets a
    # collector_calls:<group> metric (the calls issued on a sampled group), and the analysis counts
    # the untimed calls at the timed ones' mean.
    comm_sample_kinds: tuple[str, ...] = ()
    comm_sample_microbatches: tuple[int, ...] = (0,)
    # With comm_sample_every = N > 0, the timed micro-batches rotate instead: micro-batch m of step s
    # is timed where (m - s) % N == 0 (with N micro-batches, one a step, each in turn), so the timed
    # calls are a fair sample of every micro-batch. The first micro-batch alone is not: its calls
    # also absorb the ranks' misalignment at the step's start, and on a real 8-rank tp2 x pp2 x dp2
    # CPU run a straggler's TP partner waited 1.1 ms a call there against 3.6 ms in the others, so
    # the partner's own time read high and the straggler's low.
    comm_sample_every: int = 0
    # Calls of the sampled kinds made outside a micro-batch (or under step_level()) are all timed
    # by default. With comm_sample_calls = N > 0 they are timed one in N instead, by their place
    # among the group's step-level calls of the step: call i of step s where (i - s) % N == 0, a
    # different one each step, once the group issued at least N x SAMPLED_CALLS_MIN_TIMED of them
    # in the step before (fewer: all timed, so every step keeps some). For a gradient sync issued
    # in buckets (the bundled trainer's ZeRO issues ~100 reduce-scatters and ~100 all-gathers a
    # step on a 1.4B model): every member times the same calls, so arrivals still compare, and
    # the untimed ones keep their markers.
    comm_sample_calls: int = 0
    # Markers go through a shared-memory ring to a small process per rank that writes them
    # (megascope.collectors.agent), so the hang trail reaches the disk while the rank is blocked
    # anywhere, frozen holding the interpreter lock, or killed. Off (or where the process cannot
    # be started), the writer thread writes them with everything else.
    marker_agent: bool = True
    # Python stacks of every thread of the rank go to stacks/rank=N.txt when a step has not ended
    # this many seconds after it began (faulthandler's watchdog, which needs no interpreter lock).
    # None: off. Set it below the collective timeout, so the stacks are taken before an abort.
    stacks_after_s: float | None = 300.0
    # Turn on NCCL's flight recorder with a dump into RUN/flight_recorder/ on a collective
    # timeout (torch's TORCH_NCCL_* variables, set only where the job has not set them; they take
    # effect for process groups created after the collector). A second witness for `localize`.
    nccl_flight_recorder: bool = True
    # With the job's collectives intercepted (Collector.from_env), the model DistributedDataParallel
    # wraps, and an FSDP or FSDP2 model (its outermost sharded module), get a forward and a
    # backward span per call (megascope.collectors.modules.time_model), unless the job times its
    # compute itself. On a GPU they cost the backward two trips through the interpreter lock on
    # autograd's thread: about 0.1 ms a step on 1x H200 (41-212 us of a 2.3 ms host-bound step). A
    # job whose steps are that short may turn them off; its slow ranks then read ``host``.
    model_spans: bool = True
    # Every this many steps the training thread times a fixed loop of pure Python at the step's end
    # (~0.3 ms) and writes it as the host_loop_ns metric (megascope.schema.HOST_PROBE_METRIC): how
    # fast the CPU under it is. On shared machines CPUs differ: on 4x H200 virtual machines a busy
    # loop ran 16-34 M iterations a second depending on the CPU, and 15-47% slower beside another
    # busy CPU. The analysis tells a rank whose host is slow for its CPU from one doing more work.
    # 0: off.
    host_probe_every: int = 10
    # Each node compacts its own ranks' parts while the job runs: the collector of the node's first
    # local rank starts ``megascope compact RUN --ranks <the node's> --host <its> --every N`` beside
    # the job (megascope.compact.Scope), stopped with the rank. The work per node does not grow
    # with the job (4-8% of a core for 8 ranks at a 1 s flush, docs/benchmarks.md); the job's last,
    # unscoped pass (``megascope compact RUN --all``) merges what is left. None: off.
    node_compact_every_s: float | None = None
    # Parts younger than this are left to the next pass (None: 3 flush intervals, at least 10 s).
    node_compact_min_age_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        if not self.flush_interval_s > 0:
            raise ConfigError(f"flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.job_parts_per_s < 0:
            raise ConfigError(f"job_parts_per_s must be >= 0, got {self.job_parts_per_s}")
        if self.max_buffered_rows < 1:
            raise ConfigError(f"max_buffered_rows must be >= 1, got {self.max_buffered_rows}")
        if not self.anchor_interval_s > 0:
            raise ConfigError(f"anchor_interval_s must be > 0, got {self.anchor_interval_s}")
        if self.close_timeout_s < 0:
            raise ConfigError(f"close_timeout_s must be >= 0, got {self.close_timeout_s}")
        if not 0 < self.writer_duty <= 1:
            raise ConfigError(f"writer_duty must be in (0, 1], got {self.writer_duty}")
        if self.clock not in CLOCKS:
            raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if self.event_calls not in EVENT_CALLS:
            raise ConfigError(f"event_calls must be one of {', '.join(EVENT_CALLS)}, got {self.event_calls!r}")
        if self.record_calls not in RECORD_CALLS:
            raise ConfigError(f"record_calls must be one of {', '.join(RECORD_CALLS)}, got {self.record_calls!r}")
        if self.gc_span_min_ms is not None and self.gc_span_min_ms < 0:
            raise ConfigError(f"gc_span_min_ms must be >= 0 or None, got {self.gc_span_min_ms}")
        kinds = self.comm_sample_kinds
        object.__setattr__(self, "comm_sample_kinds", (kinds,) if isinstance(kinds, str) else tuple(map(str, kinds)))
        object.__setattr__(self, "comm_sample_microbatches", tuple(int(m) for m in self.comm_sample_microbatches))
        if self.comm_sample_every < 0:
            raise ConfigError(f"comm_sample_every must be >= 0, got {self.comm_sample_every}")
        if self.comm_sample_calls < 0:
            raise ConfigError(f"comm_sample_calls must be >= 0, got {self.comm_sample_calls}")
        if any(m < 0 for m in self.comm_sample_microbatches):
            raise ConfigError(f"comm_sample_microbatches must be >= 0, got {self.comm_sample_microbatches}")
        if self.stacks_after_s is not None and not self.stacks_after_s > 0:
            raise ConfigError(f"stacks_after_s must be > 0 or None, got {self.stacks_after_s}")
        if self.host_probe_every < 0:
            raise ConfigError(f"host_probe_every must be >= 0, got {self.host_probe_every}")
        if self.node_compact_every_s is not None and not self.node_compact_every_s >= 1:
            raise ConfigError(f"node_compact_every_s must be >= 1 or None, got {self.node_compact_every_s}")
        if self.node_compact_min_age_s is not None and self.node_compact_min_age_s < 0:
            raise ConfigError(f"node_compact_min_age_s must be >= 0 or None, got {self.node_compact_min_age_s}")
        if self.switch_interval_us is not None and not self.switch_interval_us > 0:
            raise ConfigError(f"switch_interval_us must be > 0 or None, got {self.switch_interval_us}")
        if self.heartbeat_interval_s is not None and not self.heartbeat_interval_s > 0:
            raise ConfigError(f"heartbeat_interval_s must be > 0 or None, got {self.heartbeat_interval_s}")

    def flush_interval_for(self, world_size: int) -> float:
        """Seconds between one rank's flushes in a job of ``world_size`` ranks: ``flush_interval_s``,
        or longer where the job's ranks would write more than ``job_parts_per_s`` parts a second."""
        if not self.job_parts_per_s:
            return self.flush_interval_s
        return max(self.flush_interval_s, world_size / self.job_parts_per_s)

    def with_env(self, environ: Mapping[str, str] | None = None) -> CollectorConfig:
        """This config with the ``MEGASCOPE_*`` overrides of ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        if "MEGASCOPE_DISABLE" in env:
            changes["enabled"] = not env_bool("MEGASCOPE_DISABLE", env["MEGASCOPE_DISABLE"])
        if env.get("MEGASCOPE_RUN_DIR"):
            changes["run_dir"] = Path(env["MEGASCOPE_RUN_DIR"])
        if "MEGASCOPE_FLUSH_INTERVAL_S" in env:
            changes["flush_interval_s"] = _env_number(
                "MEGASCOPE_FLUSH_INTERVAL_S", env["MEGASCOPE_FLUSH_INTERVAL_S"], float
            )
        if "MEGASCOPE_JOB_PARTS_PER_S" in env:
            changes["job_parts_per_s"] = _env_number("MEGASCOPE_JOB_PARTS_PER_S", env["MEGASCOPE_JOB_PARTS_PER_S"], float)
        if "MEGASCOPE_MAX_BUFFERED_ROWS" in env:
            changes["max_buffered_rows"] = _env_number(
                "MEGASCOPE_MAX_BUFFERED_ROWS", env["MEGASCOPE_MAX_BUFFERED_ROWS"], int
            )
        if "MEGASCOPE_FLIGHT_RECORDER" in env:
            changes["flight_recorder"] = env_bool("MEGASCOPE_FLIGHT_RECORDER", env["MEGASCOPE_FLIGHT_RECORDER"])
        if "MEGASCOPE_HEARTBEAT_S" in env:
            seconds = _env_number("MEGASCOPE_HEARTBEAT_S", env["MEGASCOPE_HEARTBEAT_S"], float)
            changes["heartbeat_interval_s"] = seconds if seconds > 0 else None
        if "MEGASCOPE_WAIT_SPANS" in env:
            changes["wait_spans"] = env_bool("MEGASCOPE_WAIT_SPANS", env["MEGASCOPE_WAIT_SPANS"])
        if "MEGASCOPE_CLOCK" in env:
            changes["clock"] = env["MEGASCOPE_CLOCK"].strip().lower()
        if "MEGASCOPE_EVENT_CALLS" in env:
            changes["event_calls"] = env["MEGASCOPE_EVENT_CALLS"].strip().lower()
        if "MEGASCOPE_RECORD_CALLS" in env:
            changes["record_calls"] = env["MEGASCOPE_RECORD_CALLS"].strip().lower()
        if "MEGASCOPE_WRITER_DUTY" in env:
            changes["writer_duty"] = _env_number("MEGASCOPE_WRITER_DUTY", env["MEGASCOPE_WRITER_DUTY"], float)
        if "MEGASCOPE_ALIGN_PASSES" in env:
            changes["align_passes"] = env_bool("MEGASCOPE_ALIGN_PASSES", env["MEGASCOPE_ALIGN_PASSES"])
        if "MEGASCOPE_SWITCH_INTERVAL_US" in env:
            us = _env_number("MEGASCOPE_SWITCH_INTERVAL_US", env["MEGASCOPE_SWITCH_INTERVAL_US"], int)
            changes["switch_interval_us"] = us if us > 0 else None
        if "MEGASCOPE_GC_SPAN_MS" in env:
            ms = _env_number("MEGASCOPE_GC_SPAN_MS", env["MEGASCOPE_GC_SPAN_MS"], float)
            changes["gc_span_min_ms"] = ms if ms >= 0 else None
        if "MEGASCOPE_COMM_SAMPLE" in env:
            kinds = [k.strip() for k in env["MEGASCOPE_COMM_SAMPLE"].split(",") if k.strip()]
            changes["comm_sample_kinds"] = () if kinds in ([], ["none"]) else tuple(kinds)
        if "MEGASCOPE_COMM_SAMPLE_CALLS" in env:
            changes["comm_sample_calls"] = _env_number("MEGASCOPE_COMM_SAMPLE_CALLS", env["MEGASCOPE_COMM_SAMPLE_CALLS"],
                                                       int)
        if "MEGASCOPE_MARKER_AGENT" in env:
            changes["marker_agent"] = env_bool("MEGASCOPE_MARKER_AGENT", env["MEGASCOPE_MARKER_AGENT"])
        if "MEGASCOPE_STACKS_AFTER_S" in env:
            after = _env_number("MEGASCOPE_STACKS_AFTER_S", env["MEGASCOPE_STACKS_AFTER_S"], float)
            changes["stacks_after_s"] = after if after > 0 else None
        if "MEGASCOPE_NCCL_FLIGHT_RECORDER" in env:
            changes["nccl_flight_recorder"] = env_bool("MEGASCOPE_NCCL_FLIGHT_RECORDER",
                                                        env["MEGASCOPE_NCCL_FLIGHT_RECORDER"])
        if "MEGASCOPE_MODEL_SPANS" in env:
            changes["model_spans"] = env_bool("MEGASCOPE_MODEL_SPANS", env["MEGASCOPE_MODEL_SPANS"])
        if "MEGASCOPE_HOST_PROBE_EVERY" in env:
            changes["host_probe_every"] = _env_number("MEGASCOPE_HOST_PROBE_EVERY", env["MEGASCOPE_HOST_PROBE_EVERY"], int)
        if "MEGASCOPE_COMPACT_EVERY_S" in env:
            every = _env_number("MEGASCOPE_COMPACT_EVERY_S", env["MEGASCOPE_COMPACT_EVERY_S"], float)
            changes["node_compact_every_s"] = every if every > 0 else None
        if "MEGASCOPE_COMPACT_MIN_AGE_S" in env:
            changes["node_compact_min_age_s"] = _env_number("MEGASCOPE_COMPACT_MIN_AGE_S",
                                                            env["MEGASCOPE_COMPACT_MIN_AGE_S"], float)
        return dataclasses.replace(self, **changes) if changes else self
