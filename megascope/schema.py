"""The one definition of every table in a megascope run directory.

Role in the data flow: collectors, the bundled trainer, ``megascope synth`` and the importers
*write* these tables; the store, analyses, exports and the dashboard *read* them. Nothing else in
the code base spells a column name of a run directory without going through this module.

Conventions (see ARCHITECTURE.md):

* units in column names (``start_ns``, ``dur_ns``, ``bytes``); all times are host wall-clock
  nanoseconds since the Unix epoch, as each rank's host saw them (clock offsets between hosts are
  estimated later by the analysis, never baked into the data);
* nulls instead of sentinels: a span that belongs to no micro-batch has ``microbatch = NULL``;
* mesh coordinates are data (the ``ranks`` table's ``coords``, one entry per axis), never recomputed
  from rank arithmetic elsewhere; a group's kind is data too (``groups.kind``), never read out of
  its id;
* categorical columns are plain strings whose allowed values are the StrEnums below.

Example::

    import pyarrow as pa
    from megascope import schema
    table = pa.Table.from_pylist(rows, schema=schema.SPANS)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 2
"""Bumped on any incompatible change to a table below or to ``run.json``.

2: ``ranks.coords`` (axis -> coordinate) replaced the fixed ``pp``, ``dp``, ``tp`` columns of 1.
"""

SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2})

# The axes every run names (with size 1 where the job does not use one): what the analyses read
# specially (pp: pipeline stage; dp: gradient sync; tp: tensor parallel, nested in compute).
MESH_AXES = ("pp", "dp", "tp")

# Every axis megascope knows by name, outermost first: the one order in which known axes are laid
# out and shown. tp varies fastest (torch's ``init_device_mesh`` and Megatron's default both put
# it innermost), then cp, ep and dp (Megatron's "tp-cp-ep-dp-pp"). A run's own order is
# ``RunMeta.mesh_axes``; axes not known here keep the place the writer gave them.
AXIS_ORDER = ("pp", "dp", "ep", "cp", "tp")

# Schema 1's ``ranks`` columns that held the coordinates; readers fold them into ``coords``.
RANKS_V1_COORD_COLUMNS = ("pp", "dp", "tp")


def ordered_axes(axes: Iterable[str]) -> tuple[str, ...]:
    """``axes`` (names) in :data:`AXIS_ORDER`, names it does not know after them in the order given."""
    names = [str(a) for a in axes]
    known = [a for a in AXIS_ORDER if a in names]
    return tuple(known + [a for a in dict.fromkeys(names) if a not in AXIS_ORDER])


class SpanKind(enum.StrEnum):
    """What a span measured."""

    STEP = "step"  # one whole optimizer step on this rank
    FORWARD = "forward"  # forward compute (of a micro-batch, stage or module)
    BACKWARD = "backward"  # backward compute
    COMPUTE = "compute"  # other compute (e.g. a user span, loss)
    COLLECTIVE = "collective"  # all-reduce, all-gather, reduce-scatter, broadcast, all-to-all, barrier
    SEND = "send"  # point-to-point send (start_ns = arrival at the send)
    RECV = "recv"  # point-to-point receive
    DATA = "data"  # waiting for the next batch
    OPTIMIZER = "optimizer"  # optimizer step
    HOST = "host"  # host-side work with no device work behind it (GC, checkpoint, logging)
    OTHER = "other"


# Kinds whose time is communication (a rank waiting on or moving data to its peers).
COMM_KINDS = frozenset({SpanKind.COLLECTIVE, SpanKind.SEND, SpanKind.RECV})
# Kinds whose time is the rank's own compute.
COMPUTE_KINDS = frozenset({SpanKind.FORWARD, SpanKind.BACKWARD, SpanKind.COMPUTE, SpanKind.OPTIMIZER})


class Stream(enum.StrEnum):
    """Where a span ran. Device streams beyond these are written as ``"cuda:<id>"`` strings."""

    HOST = "host"  # the Python thread
    COMPUTE = "compute"  # the default / compute stream
    COMM = "comm"  # the communication stream (NCCL), or the gloo worker
    COPY = "copy"  # memcpy / memset


# A device stream beyond those above: "cuda:<stream id>" (the collector labels a communication call
# issued on a stream other than the device's default so).
DEVICE_STREAM_PREFIX = "cuda:"
# Name suffix of the span (kind "other") that times the wait on an asynchronous communication call.
WAIT_SUFFIX = ":wait"


class GroupKind(enum.StrEnum):
    """The role of a process group in the mesh."""

    TP = "tp"  # tensor parallel
    PP = "pp"  # pipeline parallel (p2p between stages)
    DP = "dp"  # data parallel (gradient sync)
    CP = "cp"  # context parallel (sequence split; key/value exchange)
    EP = "ep"  # expert parallel (token all-to-all of MoE layers)
    WORLD = "world"
    OTHER = "other"


class MarkerState(enum.StrEnum):
    """Life of one collective call on one rank, as the collector (or a flight recorder) saw it."""

    ENQUEUED = "enqueued"  # the rank reached the call (written *before* it blocks)
    STARTED = "started"  # the device began it (flight recorder with timing only)
    COMPLETED = "completed"  # the call returned / the kernel finished


class CollectiveOp(enum.StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    BARRIER = "barrier"
    REDUCE = "reduce"
    GATHER = "gather"
    SCATTER = "scatter"
    SEND = "send"
    RECV = "recv"
    OTHER = "other"


class RunSource(enum.StrEnum):
    COLLECTOR = "collector"  # a user's job with megascope.collectors
    TRAINER = "trainer"  # the bundled trainer
    SYNTH = "synth"  # megascope synth
    KINETO = "kineto"  # megascope ingest kineto
    FLIGHT_RECORDER = "flight-recorder"  # megascope ingest flight-recorder
    DIAGNOSE = "diagnose"  # megascope diagnose


class HeartbeatMetric(enum.StrEnum):
    """Values of ``heartbeats.metric`` that the sampler writes and the health analysis reads.

    Collector counters are written as ``collector_<key>`` (see ``COLLECTOR_METRIC_PREFIX``).
    ``device`` says what a row is about: null for the host or the process, ``"gpu3"`` (NVML index),
    a network interface (``"eth0"``) or an InfiniBand port (``"mlx5_0:1"``).
    """

    HEARTBEAT = "heartbeat"  # one per sample; value = the sampler's sample count (silence is data)
    INTERVAL_S = "heartbeat_interval_s"  # the sampler's period, so readers know when a rank is overdue
    FLUSH_S = "heartbeat_flush_s"  # how often it writes a part (a crash loses at most this much)
    CPU_UTIL_PCT = "cpu_util_pct"  # host CPU busy, all cores
    LOAD_1M = "load_1m"
    MEM_USED_BYTES = "mem_used_bytes"  # host: total - available
    MEM_AVAILABLE_BYTES = "mem_available_bytes"
    PROC_CPU_PCT = "proc_cpu_pct"  # this process, 100 = one core
    PROC_RSS_BYTES = "proc_rss_bytes"
    TORCH_MEM_ALLOCATED_BYTES = "torch_mem_allocated_bytes"  # caching allocator, this process's device
    TORCH_MEM_RESERVED_BYTES = "torch_mem_reserved_bytes"
    GPU_UTIL_PCT = "gpu_util_pct"
    GPU_MEM_USED_BYTES = "gpu_mem_used_bytes"
    GPU_MEM_TOTAL_BYTES = "gpu_mem_total_bytes"
    GPU_TEMP_C = "gpu_temp_c"
    GPU_TEMP_SLOWDOWN_C = "gpu_temp_slowdown_c"  # the card's own slowdown threshold
    GPU_POWER_W = "gpu_power_w"
    GPU_POWER_LIMIT_W = "gpu_power_limit_w"
    GPU_SM_CLOCK_MHZ = "gpu_sm_clock_mhz"
    GPU_SM_CLOCK_MAX_MHZ = "gpu_sm_clock_max_mhz"
    GPU_THROTTLE_REASONS = "gpu_throttle_reasons"  # NVML clock-event bitmask; text = decoded names
    GPU_ECC_CORRECTED = "gpu_ecc_corrected"  # volatile counts since driver load
    GPU_ECC_UNCORRECTED = "gpu_ecc_uncorrected"
    GPU_REMAPPED_ROWS_PENDING = "gpu_remapped_rows_pending"  # 1 = a row remap waits for a GPU reset
    GPU_XID = "gpu_xid"  # value = XID code of a critical error event; text = description
    NIC_RX_BYTES_PER_S = "nic_rx_bytes_per_s"
    NIC_TX_BYTES_PER_S = "nic_tx_bytes_per_s"
    IB_RX_BYTES_PER_S = "ib_rx_bytes_per_s"
    IB_TX_BYTES_PER_S = "ib_tx_bytes_per_s"
    IB_PORT_ACTIVE = "ib_port_active"  # 1 = ACTIVE; text = the port state as sysfs says it
    IB_LINK_DOWNED = "ib_link_downed"  # cumulative link-down count of the port
    LOG = "log"  # text = one recent line of the job's log
    SAMPLER_ERRORS = "sampler_errors"  # cumulative failed probes of this sampler


COLLECTOR_METRIC_PREFIX = "collector_"
# A ``metrics`` row per rank and step: how many stamps the collector took in the step (two per span,
# one per wait span). On a device clock each is a timing event that costs the device ~2 us.
COLLECTOR_STAMPS_METRIC = "collector_stamps"
# ``collector_calls:<group>``: a ``metrics`` row per rank, step and group whose communication the
# collector times in some micro-batches only (CollectorConfig.comm_sample_kinds): the calls issued on
# it in the step, timed or not. The analysis counts the timed ones' waits for all of them.
COLLECTOR_CALLS_METRIC = "collector_calls:"
# ``collector_step_calls:<group>``: beside it, where the group's step-level calls were timed one in
# N (CollectorConfig.comm_sample_calls): how many step-level calls it issued in the step. Such calls
# (a gradient sync's buckets) overlap and their waits do not add up: the analysis scales their wait,
# never the extent that bounds it.
COLLECTOR_STEP_CALLS_METRIC = "collector_step_calls:"
# ``step_error:<exception class>``: a ``metrics`` row (value 1) where a rank's step ended by an
# exception, at the time it did: the ranks that failed after a peer died say how (a connection
# closed, a timeout), and a rank that ended with none recorded died without a word (killed by a
# signal or the kernel's out-of-memory killer, or crashed), or was stopped from outside.
STEP_ERROR_METRIC = "step_error:"
# A ``metrics`` row per rank every CollectorConfig.host_probe_every steps: nanoseconds the training
# thread took for HOST_PROBE_LOOPS iterations of a fixed pure-Python loop at the step's end. The same
# work everywhere, so it says how fast the CPU under that thread was then: a host-bound rank on a
# slower CPU (another tenant, a busy sibling thread) reads high, one doing more host work does not.
HOST_PROBE_METRIC = "host_loop_ns"
HOST_PROBE_LOOPS = 10_000


class DiagnosticTest(enum.StrEnum):
    """Values of ``diagnostics.test`` (``megascope diagnose``)."""

    GEMM = "gemm"  # matmul throughput, TFLOP/s, checked against a checksum
    MEMBW = "membw"  # device memory copy bandwidth, GB/s (read + write)
    D2D = "d2d"  # copy to the next GPU of the same host, GB/s
    H2D = "h2d"  # pinned host to device copy, GB/s
    ALLREDUCE = "allreduce"  # all-reduce bus bandwidth per group, GB/s, result checked exactly


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

RANKS = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("host", pa.string(), nullable=False),
        pa.field("local_rank", pa.int32()),
        pa.field("pid", pa.int64()),
        pa.field("device", pa.string()),  # "cuda:3", "cpu"
        pa.field("device_name", pa.string()),  # "NVIDIA H100 80GB HBM3"
        # Mesh coordinates: axis name -> this rank's index on it, for the axes of run.json's
        # mesh_axes ({"pp": 1, "dp": 0, "cp": 1, "tp": 3}); an axis left out is unknown. Schema 1
        # had columns pp, dp, tp instead (RANKS_V1_COORD_COLUMNS); the store reads them as this.
        pa.field("coords", pa.map_(pa.string(), pa.int32())),
        pa.field("started_at_ns", pa.int64()),  # when this rank's collector started (named apart from spans.start_ns so joins stay unambiguous)
    ]
)
"""One row per rank (``ranks/rank=00017.parquet``)."""

GROUPS = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),  # the rank that is a member
        pa.field("group", pa.string(), nullable=False),  # unique group id, e.g. "tp:3", "dp:0", "world": a name, nothing is read out of it
        pa.field("kind", pa.string(), nullable=False),  # GroupKind: the only place a group's kind is said
        pa.field("group_rank", pa.int32()),  # this rank's index inside the group
        pa.field("members", pa.list_(pa.int32()), nullable=False),  # global ranks, in group order
    ]
)
"""Process-group membership, one row per (rank, group) (``groups/rank=00017.parquet``)."""

SPANS = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("step", pa.int32()),  # null outside any step
        pa.field("name", pa.string(), nullable=False),  # "forward", "layers.3", "dp.reduce_scatter"
        pa.field("kind", pa.string(), nullable=False),  # SpanKind
        pa.field("stream", pa.string(), nullable=False),  # Stream or "cuda:<id>"
        pa.field("start_ns", pa.int64(), nullable=False),  # for comm spans: the rank's ARRIVAL
        pa.field("dur_ns", pa.int64(), nullable=False),
        pa.field("microbatch", pa.int32()),
        pa.field("chunk", pa.int32()),  # virtual pipeline chunk (interleaved 1F1B)
        # Communication only (null for compute):
        pa.field("group", pa.string()),  # GROUPS.group
        pa.field("seq", pa.int64()),  # per-group sequence number (collectives), per (src,dst) pair (p2p)
        pa.field("op", pa.string()),  # CollectiveOp
        pa.field("bytes", pa.int64()),  # payload this rank contributes
        pa.field("peer", pa.int32()),  # p2p: the other global rank
    ]
)
"""Timed work (``spans/rank=00017/part-*.parquet``)."""

MARKERS = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("group", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("op", pa.string(), nullable=False),  # CollectiveOp
        pa.field("state", pa.string(), nullable=False),  # MarkerState
        pa.field("time_ns", pa.int64(), nullable=False),  # host wall clock of the transition
        pa.field("step", pa.int32()),
        pa.field("bytes", pa.int64()),
        pa.field("peer", pa.int32()),  # p2p only
    ]
)
"""Collective enqueue / completion trail for hang localization (``markers/rank=00017/part-*.parquet``)."""

METRICS = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("name", pa.string(), nullable=False),  # "loss", "grad_norm", "lr", "tokens"
        pa.field("value", pa.float64()),
        pa.field("time_ns", pa.int64()),
    ]
)
"""Scalar metrics per step (``metrics/rank=00017/part-*.parquet``)."""

HEARTBEATS = pa.schema(
    [
        pa.field("host", pa.string(), nullable=False),
        pa.field("rank", pa.int32()),  # null for host-wide samples
        pa.field("pid", pa.int64()),
        pa.field("time_ns", pa.int64(), nullable=False),
        pa.field("device", pa.string()),  # "gpu0", "ib0", "eth0"; null for the host itself
        pa.field("metric", pa.string(), nullable=False),  # "gpu_util_pct", "gpu_temp_c", "log", ...
        pa.field("value", pa.float64()),
        pa.field("text", pa.string()),  # log lines, error strings
    ]
)
"""Host, GPU and NIC samples, in long form (``heartbeats/host=NAME/part-*.parquet``)."""

DIAGNOSTICS = pa.schema(
    [
        pa.field("time_ns", pa.int64(), nullable=False),
        pa.field("host", pa.string(), nullable=False),
        pa.field("rank", pa.int32()),
        pa.field("test", pa.string(), nullable=False),  # "gemm", "membw", "d2d", "allreduce"
        pa.field("group", pa.string()),  # for collective tests
        pa.field("value", pa.float64()),
        pa.field("unit", pa.string()),  # "TFLOP/s", "GB/s"
        pa.field("ok", pa.bool_()),  # passed its correctness check
        pa.field("outlier", pa.bool_()),  # slow against its peers
        pa.field("detail", pa.string()),
    ]
)
"""Self-test results (``diagnostics/part-*.parquet``)."""

STEP_SUMS_VERSION = 1
"""Version of what ``step_sums``' columns mean, stamped into each of its files
(``layout.STEP_SUMS_VERSION_KEY``) and part of its directory's name (``layout.STEP_SUMS_DIR``):
a change bumps both, so a reader finds only twins of the version it knows and aggregates the
spans of the others, never misreading an older twin. An additive table: ``SCHEMA_VERSION`` is not
bumped for it, and older readers ignore it."""

STEP_SUMS = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),  # spans without a step are not summed
        pa.field("group", pa.string()),  # collective spans' group; null for every other span
        # Over the spans of this (rank, step, group) in the paired spans file; null where none of
        # the kind (as SQL's FILTER gives it), counts 0.
        pa.field("step_ns", pa.int64()),  # max dur_ns of step spans
        pa.field("step_start_ns", pa.int64()),  # min start_ns of step spans
        pa.field("first_start_ns", pa.int64(), nullable=False),  # min start_ns
        pa.field("last_end_ns", pa.int64(), nullable=False),  # max start_ns + dur_ns
        pa.field("forward_ns", pa.int64()),  # sum dur_ns per kind ...
        pa.field("backward_ns", pa.int64()),
        pa.field("optimizer_ns", pa.int64()),
        pa.field("compute_ns", pa.int64()),
        pa.field("data_ns", pa.int64()),
        pa.field("host_ns", pa.int64()),
        pa.field("other_ns", pa.int64()),
        pa.field("coll_ns", pa.int64()),
        pa.field("recv_ns", pa.int64()),
        pa.field("send_ns", pa.int64()),
        pa.field("top_compute_ns", pa.int64()),  # forward/backward spans named "forward" or "backward"
        pa.field("gc_ns", pa.int64()),  # host spans named "gc.*"
        # sum of start_ns - first_start_ns over collective spans: the arrivals' sum is this plus
        # coll_spans * first_start_ns (which needs more than 64 bits)
        pa.field("arrival_rel_ns", pa.int64()),
        pa.field("coll_spans", pa.int64(), nullable=False),  # collective spans
        pa.field("spans", pa.int64(), nullable=False),  # all spans
        # Gradient reductions (collectives of op all_reduce or reduce_scatter), their "<name>:wait"
        # spans, and the first start and last end of the top-level backward spans: what tells a
        # data-parallel group whose waits the backward hid (sql/base.sql, rank_step). Absent from the
        # twins of older writers.
        pa.field("reduce_spans", pa.int64()),
        pa.field("wait_spans", pa.int64()),
        pa.field("backward_start_ns", pa.int64()),
        pa.field("backward_end_ns", pa.int64()),
        # Of the gradient reductions: those issued on a stream of their own (stream "cuda:<id>", as
        # FSDP issues its reduce-scatters), their arrivals' sum relative to first_start_ns, their
        # first start and last end: the reductions of a group that also holds other calls.
        pa.field("reduce_side_spans", pa.int64()),
        pa.field("reduce_arrival_rel_ns", pa.int64()),
        pa.field("reduce_first_ns", pa.int64()),
        pa.field("reduce_last_ns", pa.int64()),
    ]
)
"""Partial per-(rank, step, collective group) sums of one spans file, written beside it by every
writer of spans (``step_sums/rank=00017/part-*.parquet``, the same name as its spans part; a
compacted spans file's under ``compacted/step_sums/``). Derived data: never the only copy of
anything, read only while its spans file is (megascope.stepsums)."""

# Table name -> (schema, partition column or None). The on-disk layout lives in megascope.store.
TABLES: dict[str, pa.Schema] = {
    "ranks": RANKS,
    "groups": GROUPS,
    "spans": SPANS,
    "markers": MARKERS,
    "metrics": METRICS,
    "heartbeats": HEARTBEATS,
    "diagnostics": DIAGNOSTICS,
}


# --------------------------------------------------------------------------------------------
# run.json
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunMeta:
    """Contents of ``run.json``.

    ``model_flops_per_step`` counts the whole job (all ranks), forward and backward, attention and
    logits included; MFU = model_flops_per_step / (step_time * world_size * peak_flops_per_device).
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str
    source: str  # RunSource
    world_size: int
    mesh_axes: tuple[str, ...] = MESH_AXES
    mesh_sizes: dict[str, int] = field(default_factory=dict)
    start_ns: int | None = None
    model_flops_per_step: float | None = None
    tokens_per_step: int | None = None
    device_name: str | None = None
    peak_flops_per_device: float | None = None
    micro_batches: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # free-form: model, inject specs, seed

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        unknown = set(self.mesh_sizes) - set(self.mesh_axes)
        if unknown:
            raise ValueError(f"mesh_sizes names axes not in mesh_axes: {sorted(unknown)}")
        if self.mesh_sizes:
            product = 1
            for size in self.mesh_sizes.values():
                product *= size
            if product != self.world_size:
                raise ValueError(f"mesh sizes {self.mesh_sizes} multiply to {product}, not world_size {self.world_size}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["mesh_axes"] = list(self.mesh_axes)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunMeta:
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "mesh_axes" in kwargs:
            kwargs["mesh_axes"] = tuple(kwargs["mesh_axes"])
        return cls(**kwargs)
