"""Configuration of the bundled trainer: the model, the mesh, the run; validated before any process starts.

Role in the data flow: ``megascope train`` (and tests) build one :class:`TrainConfig`; its
``__post_init__`` rejects every inconsistent combination (mesh not matching the world size, layers
not divisible by pipeline stages, heads or vocabulary not divisible by TP, a global batch that does
not split into data-parallel micro-batches, faults on ranks that do not exist) with one
:class:`~megascope.errors.ConfigError` line, so nothing is spawned for a run that cannot work.

Example::

    cfg = TrainConfig(out=Path("runs/a"), world_size=8, tp=2, pp=2, dp=2, steps=5,
                      model=ModelConfig(layers=4, hidden=128, heads=4, vocab=512, seq_len=128))
    cfg.micro_batch_size        # sequences per micro-batch on one data-parallel rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megascope.errors import ConfigError, MegascopeError
from megascope.inject import Faults

OVERLAP_DIMS = ("tp", "pp", "dp")
LAYER_SPANS = ("all", "first", "none")
TP_COMM_SPANS = ("auto", "all", "rotate", "first")
DP_COMM_SPANS = ("auto", "all", "rotate")
# --dp-comm-spans rotate: the gradient sync's calls timed one in this many, a different one each step.
DP_SAMPLE_CALLS = 4
CPU_BIND = ("node", "slice", "none")


class TrainingError(MegascopeError):
    """A rank of the bundled trainer failed (a collective timed out, a rank crashed)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT: ``layers`` transformer blocks of width ``hidden`` over a vocabulary of ``vocab`` tokens.

    ``parallel_block`` is MegaScale's block (attention and MLP read one normalized input and their
    outputs are added once); ``False`` gives the classic serial block. ``window`` limits attention to
    the previous ``window`` tokens (sliding-window attention); ``None`` is full causal attention.
    """

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    vocab: int = 512
    seq_len: int = 128
    ffn_mult: int = 4
    parallel_block: bool = True
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_mult"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden size {self.hidden} is not divisible by {self.heads} heads")
        if self.window is not None and self.window < 1:
            raise ConfigError(f"attention window must be >= 1, got {self.window}")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_mult * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run on a ``pp x dp x tp`` mesh of ``world_size`` ranks.

    ``global_batch`` sequences per step are the same sequences for every mesh (with the same
    ``seed``), split evenly over the ``dp`` replicas and then into ``micro_batches`` micro-batches,
    so runs with different layouts are comparable step by step.
    """

    out: Path
    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    steps: int = 20
    seed: int = 0
    global_batch: int = 16
    micro_batches: int = 4
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: str = "adamw"  # "adamw" or "lamb"
    lr: float = 3e-3
    warmup_steps: int = 2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    sequence_parallel: bool = True
    bucket_mb: float = 4.0  # gradient bucket size for the overlapped data-parallel reduce-scatter
    # Which parallel dimensions overlap their communication with compute: "tp" (column-parallel
    # gather / input-gradient collective under GEMMs), "pp" (sends left in flight), "dp" (gradient
    # reduce-scatter during the backward pass). Dropping one gives the "before" of its overlap.
    overlap: frozenset[str] = frozenset(OVERLAP_DIMS)
    data: Path | None = None  # a flat uint16/uint32 token file; None = the synthetic language
    data_dtype: str = "uint16"
    faults: Faults = field(default_factory=Faults)
    collective_timeout_s: float = 60.0
    device: str = "auto"  # "auto", "cpu", "cuda"
    # Forward/backward spans per transformer block: in every micro-batch ("all"), in the first of
    # each step only ("first": the per-layer picture at a quarter of the device time on 4
    # micro-batches), or none.
    layer_spans: str = "first"
    # Spans of the TP collectives: in every micro-batch ("all") or in the first of each step only
    # ("first"; the others keep their enqueued/completed markers, so hang localization sees every
    # call). tp2 with four micro-batches issues ~400 TP calls a step, two or three timing events
    # each. "auto": first on CUDA, where each timing event costs the device ~2 us; all on CPU, where
    # a stamp is a host clock read that costs no more than the untimed call's bookkeeping.
    tp_comm_spans: str = "auto"
    # Spans of the DP calls (the gradient sync's reduce-scatters, the parameters' all-gathers, one
    # per bucket): all of them, or one in DP_SAMPLE_CALLS by their place in the step, a different
    # one each step ("rotate"; the others keep their markers; a DP group issuing fewer than 32 a
    # step keeps all). ~200 calls a step on the ~1.4B model, three timing events each. "auto":
    # rotate on CUDA, all on CPU, as for the TP calls.
    dp_comm_spans: str = "auto"
    flush_interval_s: float = 1.0
    # Steps per block of the collector A/B: the collector records blocks of this many steps and is
    # paused for the blocks between (0: always on). What the collector costs, measured in one process.
    collector_ab: int = 0
    # Python's garbage collector by hand: frozen after setup, off, and run in full every this many
    # steps on every rank at the same step (0: automatic, whenever a rank's allocations trigger it).
    gc_interval: int = 0
    # CUDA ranks on the cores of their GPU's NUMA node ("node"), on their own slice of them
    # ("slice"), or wherever the scheduler puts them ("none"); megascope.trainer.affinity.
    cpu_bind: str = "node"
    peak_flops: float | None = None  # per device; None = table (CUDA) or a short measurement (CPU)
    # Other tools on the same run (megascope.trainer.peers): PyTorch-profiler traces of the last
    # this many steps (0: none), and NVIDIA's straggler detector in the job.
    profile_steps: int = 0
    nvrx_straggler: bool = False
    # Each rank's host counters per step (megascope.trainer.hoststats) into this directory.
    host_stats: Path | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"--tp and --pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.dp is None:
            if self.world_size % (self.tp * self.pp):
                raise ConfigError(f"world size {self.world_size} is not divisible by tp*pp = {self.tp * self.pp}")
            object.__setattr__(self, "dp", self.world_size // (self.tp * self.pp))
        assert self.dp is not None
        if self.dp < 1 or self.tp * self.pp * self.dp != self.world_size:
            raise ConfigError(
                f"mesh tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.tp * self.pp * self.dp} "
                f"does not match world size {self.world_size}"
            )
        m = self.model
        if m.layers % self.pp:
            raise ConfigError(f"{m.layers} layers are not divisible by {self.pp} pipeline stages (--pp)")
        if m.heads % self.tp:
            raise ConfigError(f"{m.heads} attention heads are not divisible by tensor parallel size {self.tp}")
        if m.vocab % self.tp:
            raise ConfigError(f"vocabulary {m.vocab} is not divisible by tensor parallel size {self.tp}")
        if m.ffn_hidden % self.tp:
            raise ConfigError(f"MLP width {m.ffn_hidden} is not divisible by tensor parallel size {self.tp}")
        if self.sequence_parallel and self.tp > 1 and m.seq_len % self.tp:
            raise ConfigError(f"sequence length {m.seq_len} is not divisible by tensor parallel size {self.tp} "
                              "(needed by sequence parallelism)")
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.micro_batches < 1:
            raise ConfigError(f"micro-batches must be >= 1, got {self.micro_batches}")
        if self.global_batch % (self.dp * self.micro_batches):
            raise ConfigError(
                f"global batch {self.global_batch} does not split into {self.dp} data-parallel ranks x "
                f"{self.micro_batches} micro-batches (needs a multiple of {self.dp * self.micro_batches})"
            )
        if self.optimizer not in ("adamw", "lamb"):
            raise ConfigError(f"unknown optimizer {self.optimizer!r} (known: adamw, lamb)")
        if self.data_dtype not in ("uint16", "uint32"):
            raise ConfigError(f"token file dtype must be uint16 or uint32, got {self.data_dtype!r}")
        if self.data is not None and not Path(self.data).is_file():
            raise ConfigError(f"token file {self.data} does not exist")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r} (auto, cpu, cuda)")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"--collective-timeout must be > 0, got {self.collective_timeout_s}")
        unknown = set(self.overlap) - set(OVERLAP_DIMS)
        if unknown:
            raise ConfigError(f"unknown overlap dimension(s) {', '.join(sorted(unknown))} (known: tp, pp, dp)")
        if self.bucket_mb <= 0:
            raise ConfigError(f"gradient bucket size must be > 0 MB, got {self.bucket_mb}")
        if self.collector_ab < 0 or self.collector_ab == 1:
            raise ConfigError(f"--collector-ab needs blocks of at least 2 steps (or 0: off), got {self.collector_ab}")
        if self.layer_spans not in LAYER_SPANS:
            raise ConfigError(f"unknown --layer-spans {self.layer_spans!r} (known: {', '.join(LAYER_SPANS)})")
        if self.tp_comm_spans not in TP_COMM_SPANS:
            raise ConfigError(f"unknown --tp-comm-spans {self.tp_comm_spans!r} (known: {', '.join(TP_COMM_SPANS)})")
        if self.dp_comm_spans not in DP_COMM_SPANS:
            raise ConfigError(f"unknown --dp-comm-spans {self.dp_comm_spans!r} (known: {', '.join(DP_COMM_SPANS)})")
        if self.cpu_bind not in CPU_BIND:
            raise ConfigError(f"unknown --cpu-bind {self.cpu_bind!r} (known: {', '.join(CPU_BIND)})")
        if self.gc_interval < 0:
            raise ConfigError(f"--gc-interval must be >= 0, got {self.gc_interval}")
        if not 0 <= self.profile_steps <= self.steps:
            raise ConfigError(f"--profile takes between 0 and --steps ({self.steps}) steps, got {self.profile_steps}")
        if self.nvrx_straggler and self.profile_steps and self.steps - self.profile_steps < 3:
            raise ConfigError(f"--nvrx-straggler with --profile {self.profile_steps} needs --steps of at least "
                              f"{self.profile_steps + 3}: NVIDIA's detector times the steps before the profiler's "
                              "warm-up step")
        self.faults.validate(self.world_size, self.steps)

    def sampled_tp(self, device_type: str) -> bool:
        """Whether TP calls are timed in some micro-batches only, on a device of this type."""
        return self.tp_comm_spans_on(device_type) != "all"

    def tp_comm_spans_on(self, device_type: str) -> str:
        """Which TP calls get spans on a device of this type: ``all``, ``rotate`` (one micro-batch a
        step, a different one each step: the default on CUDA) or ``first`` (the first micro-batch)."""
        if self.tp_comm_spans == "auto":
            return "rotate" if device_type == "cuda" else "all"
        return self.tp_comm_spans

    def dp_comm_spans_on(self, device_type: str) -> str:
        """Which DP calls get spans on a device of this type: ``all`` or ``rotate`` (one in
        ``DP_SAMPLE_CALLS``, by their place in the step: the default on CUDA)."""
        if self.dp_comm_spans == "auto":
            return "rotate" if device_type == "cuda" else "all"
        return self.dp_comm_spans

    def sampled_comm(self, device_type: str) -> tuple[tuple[str, ...], int, int]:
        """The collector's sampling on a device of this type: (group kinds sampled, micro-batch
        rotation, step-level calls timed one in N)."""
        kinds = (("tp",) if self.sampled_tp(device_type) else ()) + \
            (("dp",) if self.dp_comm_spans_on(device_type) == "rotate" else ())
        every = self.micro_batches if self.tp_comm_spans_on(device_type) == "rotate" else 0
        return kinds, every, DP_SAMPLE_CALLS if "dp" in kinds else 0

    @property
    def micro_batch_size(self) -> int:
        assert self.dp is not None
        return self.global_batch // (self.dp * self.micro_batches)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    @property
    def mesh_sizes(self) -> dict[str, int]:
        assert self.dp is not None
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}
