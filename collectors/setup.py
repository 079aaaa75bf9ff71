"""``Collector.from_env``: a collector with the right layout from what the launcher already says.

Role in the data flow: the first lines of a user's job. torchrun (and Slurm's ``srun``) tell each
process its rank, world size and local rank in the environment; a ``DeviceMesh`` (torchtitan,
FSDP2 + TP) names the job's axes and holds their process groups. From either, this module works out
each rank's mesh coordinates and groups once, as data, registers the groups with the collector,
writes ``run.json`` with the mesh, and (unless told not to) starts seeing every collective the job
issues (:mod:`megascope.collectors.hooks`).

Example::

    from megascope.collectors import Collector

    col = Collector.from_env("runs/job42")            # dp = world, every collective seen
    for step in range(steps):
        with col.step(step):
            ...
    col.close()

Without a mesh the whole world is one data-parallel group (``dp`` = world size), which is what a
plain DDP or FSDP job is. With ``mesh=`` (a ``torch.distributed.DeviceMesh``), the mesh's dimension
names become the axes: ``pp``, ``dp`` and ``tp`` are understood by every analysis, ``cp`` and
``ep`` are groups of their own kind (``GroupKind``), shown with the others; any other name is kept
in ``run.json`` and the rank's coordinates, its groups recorded with kind ``other``.
A job that makes its process groups itself (Megatron's ``parallel_state``) passes them by axis
instead, ``groups={"tp": ..., "pp": ..., "dp": ...}``. A collective on another group of the job
with the same members as one of these (Megatron keeps several: data-parallel with and without
context parallelism, model-parallel) is recorded as that group.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megascope.errors import ConfigError
from megascope.schema import MESH_AXES, GroupKind, RunMeta, RunSource, ordered_axes
from megascope.topology import Group

if TYPE_CHECKING:
    from megascope.collectors.collector import Collector
    from megascope.collectors.config import CollectorConfig

log = logging.getLogger(__name__)

# Where launchers put a process's place in the job: torchrun, then Slurm, then Open MPI.
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
_LOCAL_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_KINDS = {k.value for k in GroupKind}


def _first_int(names: tuple[str, ...], environ: Any) -> int | None:
    for name in names:
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    return None


def place_from_env(environ: Any = None) -> tuple[int, int, int | None]:
    """(rank, world size, local rank) from the launcher's variables; (0, 1, None) outside any launcher."""
    env = os.environ if environ is None else environ
    rank = _first_int(_RANK_VARS, env)
    world = _first_int(_WORLD_VARS, env)
    local = _first_int(_LOCAL_VARS, env)
    rank = 0 if rank is None else rank
    world = 1 if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not inside a world of {world} processes (check RANK and WORLD_SIZE)")
    return rank, world, local


class Layout:
    """Axes, sizes, this rank's coordinates and its groups, each with the torch group it maps to."""

    def __init__(self, axes: tuple[str, ...], sizes: dict[str, int], coords: dict[str, int],
                 groups: list[tuple[Any, Group]]) -> None:
        self.axes = axes
        self.sizes = sizes
        self.coords = coords
        self.groups = groups  # (torch process group or None for the default group, megascope group)


def data_parallel_layout(rank: int, world: int) -> Layout:
    """The layout of a job with no mesh: every rank a data-parallel replica, one group of all."""
    sizes = {"pp": 1, "dp": world, "tp": 1}
    group = Group("dp:0", GroupKind.DP.value, tuple(range(world)))
    return Layout(MESH_AXES, sizes, {"pp": 0, "dp": rank, "tp": 0}, [(None, group)])


def device_mesh_layout(mesh: Any, rank: int) -> Layout:
    """The layout a ``DeviceMesh`` describes: its dimension names, sizes, this rank's place and groups.

    Coordinates and group members are read from the mesh's rank tensor, not recomputed: a mesh
    may lay ranks out in any order.
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ConfigError("the DeviceMesh has no dimension names: create it with "
                          "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    ranks = mesh.mesh  # a tensor of global ranks, one dimension per axis
    shape = tuple(int(s) for s in ranks.shape)
    axes = tuple(str(n) for n in names)
    where = (ranks == rank).nonzero()
    if where.shape[0] != 1:
        raise ConfigError(f"rank {rank} is not in the DeviceMesh {ranks.tolist()}")
    position = [int(v) for v in where[0].tolist()]
    coords = dict(zip(axes, position, strict=True))
    groups: list[tuple[Any, Group]] = []
    for dim, axis in enumerate(axes):
        if shape[dim] == 1:
            continue
        # Every 1-D slice along this axis is one group; ids number them by their first member.
        slices = ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()
        slices.sort(key=lambda members: members[0])
        members = tuple(int(r) for r in ranks.movedim(dim, -1)[tuple(p for d, p in enumerate(position)
                                                                      if d != dim)].tolist())
        index = next(i for i, s in enumerate(slices) if tuple(s) == members)
        kind = axis if axis in _KINDS else GroupKind.OTHER.value
        try:
            pg = mesh.get_group(axis)
        except Exception:
            pg = None
        groups.append((pg, Group(f"{axis}:{index}", kind, members)))
    return Layout(axes, dict(zip(axes, shape, strict=True)), coords, groups)


def process_groups_layout(groups: Mapping[str, Any], rank: int, world: int) -> Layout:
    """The layout a job's own process groups describe, one per axis: ``{"tp": tp_pg, "dp": dp_pg, ...}``.

    For jobs that build their groups themselves rather than through a ``DeviceMesh`` (Megatron's
    ``parallel_state``, say). Each group's members, read from torch, give the axis's size and this
    rank's coordinate on it (its place in the group). Axes are laid out in the canonical order
    (:func:`megascope.schema.ordered_axes`), whatever the dict's. A group is numbered by this
    rank's coordinates on the other axes: every member of a group shares them, so every member
    names the group alike. The axes must tile the world: the product of their sizes is the world
    size.
    """
    import torch.distributed as dist

    if not groups:
        raise ConfigError("groups= is empty: give one process group per axis, e.g. {'tp': tp_group, 'dp': dp_group}")
    groups = {str(a): pg for a, pg in groups.items()}
    axes = ordered_axes(groups)
    members: dict[str, tuple[int, ...]] = {}
    for axis, pg in groups.items():
        try:
            members[axis] = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        except Exception as exc:
            raise ConfigError(f"groups[{axis!r}] is not a process group of this job ({exc})") from None
        if rank not in members[axis]:
            raise ConfigError(f"groups[{axis!r}] does not hold this rank ({rank}): give the groups this process is in")
    sizes = {axis: len(m) for axis, m in members.items()}
    product = math.prod(sizes.values())
    if product != world:
        raise ConfigError(f"the groups' sizes {sizes} multiply to {product}, not to the world size {world}: "
                          "give one group per axis, every axis of the job")
    coords = {axis: m.index(rank) for axis, m in members.items()}
    layout_groups: list[tuple[Any, Group]] = []
    for axis in axes:
        if sizes[axis] == 1:
            continue
        index = 0
        for other in axes:
            if other != axis:
                index = index * sizes[other] + coords[other]
        kind = axis if axis in _KINDS else GroupKind.OTHER.value
        layout_groups.append((groups[axis], Group(f"{axis}:{index}", kind, members[axis])))
    return Layout(axes, sizes, coords, layout_groups)


def from_env(run_dir: str | os.PathLike[str] | None = None, *, mesh: Any = None, groups: Mapping[str, Any] | None = None,
             config: CollectorConfig | None = None, intercept: bool = True, run_id: str | None = None,
             **settings: Any) -> Collector:
    """A collector for this process of a torchrun, Slurm or single-process job.

    ``run_dir`` (or ``MEGASCOPE_RUN_DIR``, which wins): where the run directory goes. ``mesh``: a
    ``DeviceMesh`` with named dimensions; without one, dp = world. ``groups``: instead of a mesh, the
    job's own process groups by axis (``{"tp": ..., "pp": ..., "dp": ...}``, see
    :func:`process_groups_layout`). ``intercept``: see every
    collective of the job (DDP's gradient all-reduce, FSDP2, DTensor, ``torch.distributed``
    calls) without wrapping calls by hand; ``MEGASCOPE_INTERCEPT=0`` turns it off. Other keywords
    are :class:`CollectorConfig` settings. ``run_id``: ``run.json``'s (rank 0's choice; a launcher's
    job id wins: :mod:`megascope.collectors.runid`). Bad settings raise
    :class:`megascope.errors.ConfigError` before anything starts; after that the collector never
    raises into the job.
    """
    from megascope.collectors.collector import Collector
    from megascope.collectors.config import CollectorConfig, env_bool
    from megascope.collectors.runid import new_run_id

    if config is None:
        env_dir = os.environ.get("MEGASCOPE_RUN_DIR")
        if run_dir is None and not env_dir:
            raise ConfigError("no run directory: pass one to Collector.from_env or set MEGASCOPE_RUN_DIR")
        try:
            config = CollectorConfig(run_dir=Path(env_dir or run_dir), **settings)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(f"Collector.from_env: {exc}") from None
    elif settings:
        raise ConfigError("Collector.from_env: pass settings either in config= or as keywords, not both")
    if "MEGASCOPE_INTERCEPT" in os.environ:
        intercept = env_bool("MEGASCOPE_INTERCEPT", os.environ["MEGASCOPE_INTERCEPT"])
    rank, world, _local = place_from_env()
    if mesh is not None and groups is not None:
        raise ConfigError("Collector.from_env: pass mesh= or groups=, not both")
    if mesh is not None:
        layout = device_mesh_layout(mesh, rank)
    elif groups is not None:
        layout = process_groups_layout(groups, rank, world)
    else:
        layout = data_parallel_layout(rank, world)
    if mesh is not None and int(mesh.mesh.numel()) != world:
        raise ConfigError(f"the DeviceMesh holds {int(mesh.mesh.numel())} ranks but the job has {world}")
    axes = tuple(a for a in MESH_AXES if a not in layout.axes) + layout.axes  # pp/dp/tp always named
    # run_id is rank 0's choice; where the launcher names the job (MEGASCOPE_RUN_ID, torchrun's
    # rendezvous id) that wins, so that every rank stamps the same id (megascope.collectors.runid).
    start_ns = time.time_ns()
    meta = RunMeta(run_id=run_id or new_run_id(config.run_dir, start_ns), source=RunSource.COLLECTOR.value,
                   world_size=world, mesh_axes=axes, mesh_sizes={a: layout.sizes.get(a, 1) for a in axes},
                   start_ns=start_ns, config={"flush_interval_s": config.with_env().flush_interval_for(world)})
    coords = {a: 0 for a in axes if a not in layout.coords} | layout.coords  # pp/dp/tp always placed
    col = Collector(config, rank=rank, world_size=world, coords=coords, meta=meta)
    if not col.enabled:
        return col
    try:
        for pg, group in layout.groups:
            col.register_group(pg, group)
            if pg is not None and group.members == tuple(range(world)):
                col.register_group(None, group)  # calls on the default group belong to it too
        if intercept:
            from megascope.collectors.hooks import Interception

            col._interception = Interception(col).install()
    except Exception:
        col._internal_error("from_env setup")
    return col
