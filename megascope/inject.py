"""The one fault-injection grammar, shared by ``megascope train`` and ``megascope synth``.

    straggler:rank=R,factor=F[,mode=M]
                                  rank R's compute runs F times slower (F > 1); M is ``time`` (the
                                  default: each phase is stretched to F times its own duration, as
                                  a slow or throttled device is) or ``flops`` (F-1 times the phase's
                                  matrix work again, which only slows a device-bound run)
    hang:rank=R,step=S            rank R stops before its next collective in step S
    freeze:rank=R,step=S          the same, inside a C call that holds the interpreter lock, so every
                                  Python thread of rank R stops with it (the collector's too)
    skew:rank=R,ms=M              a host pause of M ms before the data-parallel gradient sync
    crash:rank=R,step=S           rank R raises an exception before its next collective in step S
                                  (``megascope train`` only), as a rank whose step fails does
    kill:rank=R,step=S            rank R's process is killed (SIGKILL) before its next collective in
                                  step S (``megascope train`` only), as the OOM killer or a lost
                                  node ends one: no exception, nothing flushed

Example::

    faults = parse_injects(["straggler:rank=5,factor=1.3", "hang:rank=2,step=7"])
    faults.straggler_factor(5)   # 1.3
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from megascope.errors import ConfigError

# kind -> {parameter: type}; every parameter is required except those in _OPTIONAL.
_GRAMMAR: dict[str, dict[str, type]] = {
    "straggler": {"rank": int, "factor": float, "mode": str},
    "hang": {"rank": int, "step": int},
    "freeze": {"rank": int, "step": int},
    "skew": {"rank": int, "ms": float},
    "crash": {"rank": int, "step": int},
    "kill": {"rank": int, "step": int},
}
# Faults a real process carries out and ``megascope synth`` does not model.
PROCESS_FAULTS = ("crash", "kill")
_OPTIONAL: dict[str, set[str]] = {"straggler": {"mode"}}
STRAGGLER_MODES = ("time", "flops")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    factor: float | None = None  # straggler
    step: int | None = None  # hang, freeze, crash, kill
    ms: float | None = None  # skew
    mode: str | None = None  # straggler: time (default) | flops

    def spec(self) -> str:
        params = {k: getattr(self, k) for k in _GRAMMAR[self.kind] if getattr(self, k) is not None}
        return f"{self.kind}:" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def parse_inject(spec: str) -> Fault:
    """Parse one ``--inject`` value; raise ConfigError with the reason on any mistake."""
    kind, sep, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in _GRAMMAR:
        raise ConfigError(f"--inject {spec!r}: unknown fault kind {kind!r} (known: {', '.join(_GRAMMAR)})")
    if not sep or not rest.strip():
        wanted = ",".join(f"{k}=..." for k in _GRAMMAR[kind] if k not in _OPTIONAL.get(kind, set()))
        raise ConfigError(f"--inject {spec!r}: expected {kind}:{wanted}")
    values: dict[str, int | float] = {}
    for item in rest.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in _GRAMMAR[kind]:
            raise ConfigError(f"--inject {spec!r}: unknown parameter {item.strip()!r} for {kind} (takes {', '.join(_GRAMMAR[kind])})")
        if key in values:
            raise ConfigError(f"--inject {spec!r}: parameter {key} given twice")
        try:
            values[key] = _GRAMMAR[kind][key](raw.strip())
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: {key}={raw.strip()!r} is not a valid {_GRAMMAR[kind][key].__name__}") from None
    missing = set(_GRAMMAR[kind]) - set(values) - _OPTIONAL.get(kind, set())
    if missing:
        raise ConfigError(f"--inject {spec!r}: missing {', '.join(sorted(missing))}")
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--inject {spec!r}: {key} must be a finite number")
    fault = Fault(kind=kind, **values)  # type: ignore[arg-type]
    if fault.rank < 0:
        raise ConfigError(f"--inject {spec!r}: rank must be >= 0")
    if fault.factor is not None and fault.factor <= 1.0:
        raise ConfigError(f"--inject {spec!r}: factor must be > 1 (a straggler is slower)")
    if fault.step is not None and fault.step < 0:
        raise ConfigError(f"--inject {spec!r}: step must be >= 0")
    if fault.ms is not None and fault.ms <= 0:
        raise ConfigError(f"--inject {spec!r}: ms must be > 0")
    if fault.mode is not None and fault.mode not in STRAGGLER_MODES:
        raise ConfigError(f"--inject {spec!r}: mode must be one of {', '.join(STRAGGLER_MODES)}")
    return fault


@dataclass(frozen=True)
class Faults:
    """All faults of a run, with the questions a writer asks of them."""

    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def validate(self, world_size: int, steps: int | None = None) -> Faults:
        for f in self.faults:
            if f.rank >= world_size:
                raise ConfigError(f"--inject {f.spec()}: rank {f.rank} outside a job of {world_size} ranks")
            if steps is not None and f.step is not None and f.step >= steps:
                raise ConfigError(f"--inject {f.spec()}: step {f.step} is past the last step ({steps - 1})")
        return self

    def straggler_factor(self, rank: int) -> float:
        factor = 1.0
        for f in self.faults:
            if f.kind == "straggler" and f.rank == rank and f.factor is not None:
                factor *= f.factor
        return factor

    def straggler_mode(self, rank: int) -> str:
        """How rank's straggler slows it: ``time`` unless a straggler fault on it says ``flops``."""
        modes = [f.mode for f in self.faults if f.kind == "straggler" and f.rank == rank and f.mode]
        return modes[0] if modes else "time"

    def hang_step(self, rank: int, kinds: tuple[str, ...] = ("hang", "freeze")) -> int | None:
        """The first step where rank stops for good by a fault of ``kinds`` (a hang or a freeze by
        default; ``crash`` and ``kill`` are asked for by name)."""
        steps = [f.step for f in self.faults if f.kind in kinds and f.rank == rank and f.step is not None]
        return min(steps) if steps else None

    def skew_ms(self, rank: int) -> float:
        return sum(f.ms for f in self.faults if f.kind == "skew" and f.rank == rank and f.ms is not None)

    def specs(self) -> list[str]:
        return [f.spec() for f in self.faults]

    def __bool__(self) -> bool:
        return bool(self.faults)


def parse_injects(specs: Iterable[str]) -> Faults:
    return Faults(tuple(parse_inject(s) for s in specs))
