"""``megascope diagnose``: run the self-tests on every rank, write them to a run, name the outliers.

Role in the data flow: an in-job *collector* of health (like the trainer, it writes a run
directory). Three ways to run it:

* alone: one process, one device (``run_diagnose(DiagnoseConfig(out=...))``);
* ``nproc=N``: N local ranks, forked (CPU/gloo) or spawned (CUDA/NCCL) from here;
* under ``torchrun``: every rank runs the command; ``RANK``/``WORLD_SIZE`` come from the env.

Each rank runs the per-device tests (GEMM, memory copy, and on GPUs host-to-device and a copy to
the next GPU of its host), then an all-reduce per TP, PP and DP group and the world, groups of one
axis at the same time. Rank 0 gathers the results, marks outliers against peers
(``megascope.health.outliers``) and writes ``diagnostics`` (plus ``run.json``, ``ranks`` and
``groups`` when the directory is new; an existing run only gains a diagnostics part). Only rank 0
needs to see the output directory. On CPU, ranks of one host take turns in the per-device tests so
they measure the host, not each other.

Test hook: ``slow_rank=R`` (CLI ``--slow-rank``, env ``MEGASCOPE_DIAGNOSE_SLOW_RANK``) makes rank R
repeat its device work ``slow_factor`` times and stall before each all-reduce iteration, so tests
can check that the slow rank gets named. It changes nothing else.

Example::

    from megascope.health.diagnose import DiagnoseConfig, run_diagnose
    report = run_diagnose(DiagnoseConfig(out=Path("runs/diag"), nproc=4, tp=2))
    report["suspects"]      # [{"rank": 2, "host": "node3", "coords": {...}, "reasons": [...]}]
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa

from megascope import layout
from megascope.errors import ConfigError, MegascopeError
from megascope.health import outliers
from megascope.health.datasheet import datasheet_for
from megascope.schema import DIAGNOSTICS, GROUPS, RANKS, DiagnosticTest, RunMeta, RunSource
from megascope.topology import Group, Mesh, format_coords

log = logging.getLogger(__name__)

SLOW_RANK_ENV = "MEGASCOPE_DIAGNOSE_SLOW_RANK"
BACKENDS = ("auto", "gloo", "nccl")


class DiagnoseError(MegascopeError):
    """The self-tests could not run (no process group, a rank died)."""


@dataclass(frozen=True, kw_only=True)
class DiagnoseConfig:
    out: Path
    nproc: int | None = None
    tp: int = 1
    pp: int = 1
    backend: str = "auto"
    tolerance: float = 0.25
    iters: int | None = None
    timeout_s: float = 120.0
    heartbeat: bool = True
    slow_rank: int | None = None  # test hook, see the module docstring
    slow_factor: float = 4.0
    slow_delay_s: float = 0.02
    env: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not 0 < self.tolerance < 1:
            raise ConfigError(f"tolerance must be between 0 and 1, got {self.tolerance}")
        if self.nproc is not None and self.nproc < 1:
            raise ConfigError(f"nproc must be >= 1, got {self.nproc}")
        if self.slow_factor < 1:
            raise ConfigError(f"slow factor must be >= 1, got {self.slow_factor}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"{self.out}: exists and is not a directory")


def _launch_env() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when started by torchrun (or any launcher with the env:// vars)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def run_diagnose(cfg: DiagnoseConfig) -> dict[str, Any] | None:
    """Run the self-tests; returns the report on the process that has it (rank 0 or the launcher),
    None on the other ranks of a torchrun job."""
    import torch

    slow = cfg.slow_rank
    if slow is None and os.environ.get(SLOW_RANK_ENV):
        slow = int(os.environ[SLOW_RANK_ENV])
    cfg = _replace(cfg, slow_rank=slow)
    launched = _launch_env()
    if launched is not None:
        if cfg.nproc is not None:
            raise ConfigError("--nproc cannot be used under torchrun (the launcher already started the ranks)")
        rank, world, local_rank = launched
        _check_mesh(cfg, world)
        return _rank_main(rank, world, local_rank, "env://", cfg, None)
    world = cfg.nproc or 1
    _check_mesh(cfg, world)
    with tempfile.TemporaryDirectory(prefix="megascope-diagnose-") as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        result = Path(tmp) / "report.json"
        if world == 1:
            return _rank_main(0, 1, 0, init, cfg, result)
        cuda = _backend(cfg, torch) == "nccl"
        # CUDA cannot be used in a forked child once the parent touched it; gloo ranks fork fast.
        gc.collect()  # the parent's garbage is finalized here, not in each forked rank
        torch.multiprocessing.start_processes(
            _spawned, args=(world, init, cfg, result), nprocs=world, join=True,
            start_method="spawn" if cuda else "fork")
        if not result.exists():
            raise DiagnoseError("rank 0 finished without a report")
        report: dict[str, Any] = json.loads(result.read_text())
        return report


def _replace(cfg: DiagnoseConfig, **changes: Any) -> DiagnoseConfig:
    data = asdict(cfg)
    data.update(changes)
    return DiagnoseConfig(**data)


def _check_mesh(cfg: DiagnoseConfig, world: int) -> None:
    Mesh.for_world(world, tp=cfg.tp, pp=cfg.pp)  # raises ConfigError with the reason
    if cfg.slow_rank is not None and not 0 <= cfg.slow_rank < world:
        raise ConfigError(f"slow rank {cfg.slow_rank} is outside a world of {world} ranks")


def _backend(cfg: DiagnoseConfig, torch: Any) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _spawned(rank: int, world: int, init: str, cfg: DiagnoseConfig, result: Path) -> None:
    gc.freeze()  # a forked rank never finalizes what it inherited (see trainer/launch.py)
    _rank_main(rank, world, rank, init, cfg, result)


def _rank_main(rank: int, world: int, local_rank: int, init: str, cfg: DiagnoseConfig,
               result: Path | None) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    if world > 1 and not torch.cuda.is_available():
        torch.set_num_threads(1)  # ranks share the host's cores; more threads only fight
    backend = _backend(cfg, torch)
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    host = socket.gethostname()
    mesh = Mesh.for_world(world, tp=cfg.tp, pp=cfg.pp)
    fresh = not (cfg.out / layout.RUN_JSON).exists()
    sampler = None
    if cfg.heartbeat and fresh:
        from megascope.collectors.heartbeat import HeartbeatSampler

        sampler = HeartbeatSampler(cfg.out, rank=rank, host=host, interval_s=1.0, flush_interval_s=5.0).start()
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg.timeout_s))
    except Exception as exc:
        raise DiagnoseError(f"rank {rank}: could not join the process group ({exc})") from exc
    try:
        ctrl = dist.new_group(backend="gloo") if backend == "nccl" else None
        rows, info = _run_tests(rank, world, local_rank, device, host, mesh, cfg, ctrl)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object((rows, info), gathered if rank == 0 else None, dst=0, group=ctrl)
        dist.barrier(group=ctrl)
    finally:
        if sampler is not None:
            sampler.stop()
        dist.destroy_process_group()
    if rank != 0:
        return None
    report = _finish(cfg, mesh, gathered, fresh, backend)
    if result is not None:
        result.write_text(json.dumps(report, default=str))
    return report


def _local_turns(dist: Any, local_rank: int, local_world: int, ctrl: Any) -> Any:
    """Yield when it is this rank's turn among the ranks of its host (all ranks call barrier)."""
    for turn in range(local_world):
        dist.barrier(group=ctrl)
        if turn == local_rank:
            yield


def _run_tests(rank: int, world: int, local_rank: int, device: Any, host: str, mesh: Mesh,
               cfg: DiagnoseConfig, ctrl: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from megascope.health import selftest

    sizes = selftest.Sizes.for_device(device, iters=cfg.iters)
    slowed = cfg.slow_rank == rank
    repeat = max(1, round(cfg.slow_factor)) if slowed else 1
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows: list[dict[str, Any]] = []

    def record(test: str, m: selftest.Measurement, group: str | None = None) -> None:
        rows.append({"time_ns": time.time_ns(), "host": host, "rank": rank, "test": str(test), "group": group,
                     "value": m.value, "unit": m.unit, "ok": m.ok, "outlier": False, "detail": m.detail})

    def guarded(test: str, fn: Any, group: str | None = None, unit: str = "GB/s") -> None:
        try:
            record(test, fn(), group)
        except Exception as exc:  # one broken test must not hide the others' results
            log.warning("rank %d: %s failed: %s", rank, test, exc)
            record(test, selftest.Measurement(None, unit, False, f"{type(exc).__name__}: {exc}"), group)

    # Ranks per host, from the gathered host names: the turns below must agree on every rank.
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, host, group=ctrl)
    local_world = hosts.count(host)
    local_index = [i for i, h in enumerate(hosts) if h == host].index(rank)
    turns = range(1) if device.type == "cuda" else _local_turns(dist, local_index, local_world, ctrl)
    for _ in turns:
        guarded(DiagnosticTest.GEMM, lambda: selftest.gemm(device, sizes, repeat=repeat, seed=rank), unit="TFLOP/s")
        guarded(DiagnosticTest.MEMBW, lambda: selftest.membw(device, sizes, repeat=repeat))
        if device.type == "cuda":
            guarded(DiagnosticTest.H2D, lambda: selftest.h2d(device, sizes, repeat=repeat))
            count = torch.cuda.device_count()
            if count > 1:
                peer = torch.device("cuda", (device.index + 1) % count)
                guarded(DiagnosticTest.D2D, lambda peer=peer: selftest.d2d(device, peer, sizes, repeat=repeat),
                        group=f"cuda:{device.index}->cuda:{peer.index}")
    dist.barrier(group=ctrl)

    # Every rank creates every group, in the same order (torch requires it). On GPUs the groups of
    # one axis run together, as in training; on CPU one group at a time, or ranks sharing cores
    # would measure each other.
    rounds: list[list[tuple[Group, Any]]] = []
    for axis in ("tp", "pp", "dp"):
        if mesh.size.get(axis, 1) == 1:
            continue
        created = [(group, dist.new_group(list(group.members))) for group in mesh.groups(axis)]
        rounds += [created] if device.type == "cuda" else [[pair] for pair in created]
    if world > 1 and all(mesh.size.get(a, 1) < world for a in mesh.axes):
        rounds.append([(mesh.group_of(rank, "world"), None)])
    delay = cfg.slow_delay_s if slowed else 0.0
    for round_ in rounds:
        for group, pg in round_:
            if rank in group.members:
                guarded(DiagnosticTest.ALLREDUCE,
                        lambda group=group, pg=pg: selftest.allreduce(pg, list(group.members), rank, device, sizes,
                                                                      delay_s=delay),
                        group=group.id)
        dist.barrier(group=ctrl)
    info = {"rank": rank, "host": host, "local_rank": local_rank, "pid": os.getpid(), "device": str(device),
            "device_name": device_name, "coords": mesh.coords(rank),
            "groups": [(g.id, g.kind, list(g.members)) for g in mesh.rank_groups(rank)],
            "sizes": {"gemm_n": sizes.gemm_n, "gemm_dtype": str(sizes.gemm_dtype), "copy_bytes": sizes.copy_bytes,
                      "allreduce_bytes": sizes.allreduce_bytes, "iters": sizes.iters}}
    return rows, info


def _finish(cfg: DiagnoseConfig, mesh: Mesh, gathered: list[Any], fresh: bool, backend: str) -> dict[str, Any]:
    infos = {info["rank"]: info for _, info in gathered}
    rows: list[dict[str, Any]] = []
    for rank_rows, info in gathered:
        for r in rank_rows:
            rows.append(dict(r, device_name=info["device_name"], coords=info["coords"]))
    judged = outliers.mark_outliers(rows, tolerance=cfg.tolerance)
    world = mesh.world_size
    device_name = infos[0]["device_name"]
    if fresh:
        meta = RunMeta(run_id=f"diagnose-{uuid.uuid4().hex[:8]}", source=RunSource.DIAGNOSE, world_size=world,
                       mesh_axes=mesh.axes, mesh_sizes=dict(mesh.size), start_ns=min(r["time_ns"] for r in rows),
                       device_name=device_name,
                       config={"backend": backend, "tolerance": cfg.tolerance, "sizes": infos[0]["sizes"],
                               "slow_rank": cfg.slow_rank})
        for rank, info in infos.items():
            row = {"rank": rank, "host": info["host"], "local_rank": info["local_rank"], "pid": info["pid"],
                   "device": info["device"], "device_name": info["device_name"], "coords": info["coords"],
                   "started_at_ns": meta.start_ns}
            layout.write_part(cfg.out, "ranks", pa.Table.from_pylist([row], schema=RANKS), rank=rank)
            groups = [{"rank": rank, "group": gid, "kind": kind, "group_rank": members.index(rank),
                       "members": members} for gid, kind, members in info["groups"]]
            layout.write_part(cfg.out, "groups", pa.Table.from_pylist(groups, schema=GROUPS), rank=rank)
        layout.write_run_meta(cfg.out, meta)  # last: a run.json means the directory is complete
    layout.write_part(cfg.out, "diagnostics",
                      pa.Table.from_pylist([{k: r[k] for k in DIAGNOSTICS.names} for r in judged], schema=DIAGNOSTICS))
    return build_report(judged, cfg.out, mesh, device_name, backend)


def build_report(rows: list[dict[str, Any]], out: Path, mesh: Mesh, device_name: str, backend: str) -> dict[str, Any]:
    """The JSON report: a summary per test (with the datasheet figure where known), outliers,
    failures and suspects."""
    sheet = datasheet_for(device_name)
    summary = []
    keys = sorted({(r["test"], r["group"].split(":")[0] if r["test"] == DiagnosticTest.ALLREDUCE else None)
                   for r in rows})
    for test, kind in keys:
        values = [r["value"] for r in rows if r["test"] == test and r["value"] is not None
                  and (kind is None or r["group"].split(":")[0] == kind)]
        if not values:
            continue
        unit = next(r["unit"] for r in rows if r["test"] == test)
        entry: dict[str, Any] = {"test": test, "group_kind": kind, "unit": unit, "n": len(values),
                                 "median": statistics.median(values), "min": min(values), "max": max(values)}
        peak = sheet.get(test) if sheet else None
        if isinstance(peak, float):
            entry["datasheet"] = peak
            entry["median_pct_of_datasheet"] = round(100.0 * entry["median"] / peak, 1)
        summary.append(entry)
    public = [{k: r[k] for k in (*DIAGNOSTICS.names, "coords")} for r in rows]
    return {
        "run": str(out),
        "world_size": mesh.world_size,
        "mesh": mesh.size,
        "backend": backend,
        "device_name": device_name,
        "datasheet": sheet,
        "tests": summary,
        "outliers": [r for r in public if r["outlier"]],
        "failures": [r for r in public if r["ok"] is False],
        "suspects": outliers.suspects(rows),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as an on-call engineer reads it on a terminal."""
    lines = [f"diagnose: {report['world_size']} ranks ({' '.join(f'{a}={s}' for a, s in report['mesh'].items())}), "
             f"{report['device_name']}, {report['backend']} -> {report['run']}"]
    for t in report["tests"]:
        name = t["test"] + (f" {t['group_kind']}" if t["group_kind"] else "")
        sheet = f"  ({t['median_pct_of_datasheet']}% of datasheet {t['datasheet']:g})" if "datasheet" in t else ""
        lines.append(f"  {name:<14} median {t['median']:10.3f} {t['unit']:<8} min {t['min']:.3f}  "
                     f"max {t['max']:.3f}  n={t['n']}{sheet}")
    if not report["suspects"]:
        lines.append("no outliers: every rank within tolerance of its peers, every result checked out")
    for s in report["suspects"]:
        lines.append(f"SUSPECT rank {s['rank']} on {s['host']} ({format_coords(s['coords'])}):")
        lines.extend(f"    {reason}" for reason in s["reasons"])
    return "\n".join(lines)
