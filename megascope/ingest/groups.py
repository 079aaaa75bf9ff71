"""Process groups of a foreign trace -> megascope group ids, mesh axes and each rank's coordinates.

Role in the data flow: both importers (Kineto, flight recorder) see torch process groups as
``(name, description, ranks)``; analyses need megascope groups (``"tp:3"``, ``"dp:0"``,
``"world"``) and mesh coordinates in the ``ranks`` table. This module does that mapping once per
ingest, from every rank's groups together.

How a group gets its axis, in order:

1. the whole world (or ``default_pg``) -> ``world``;
2. ``--mesh`` given -> the axis whose mesh group has exactly these members;
3. words in the description: Megatron's ``TENSOR_MODEL_PARALLEL_GROUP``,
   ``PIPELINE_MODEL_PARALLEL_GROUP``, ``DATA_PARALLEL_GROUP`` and torch DeviceMesh's ``mesh_tp``,
   ``mesh_pp``, ``mesh_dp`` name their axis. An axis is accepted only if its groups partition the
   world into equal parts; anything else is kept as an ``other`` group named after its description.

Coordinates are each rank's index inside its tp / pp / dp group (data, not rank arithmetic); with
no named groups the job is taken as pure data parallel (dp = rank).

Example::

    pgs = [ProcessGroup("0", "default_pg", (0, 1, 2, 3))]
    plan = plan_groups(pgs, world_size=4)
    plan.group_id[("default_pg", (0, 1, 2, 3))]   # "world"
    plan.coords[3]                                 # {"pp": 0, "dp": 3, "tp": 0}
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from megascope.errors import ConfigError
from megascope.schema import AXIS_ORDER, MESH_AXES, GroupKind, ordered_axes
from megascope.topology import Mesh

log = logging.getLogger(__name__)

_AXIS_WORDS = {
    "tp": {"tp", "tensor"},
    "pp": {"pp", "pipeline", "pipe"},
    "dp": {"dp", "data", "fsdp", "ddp"},
    "cp": {"cp", "context"},
}
# Words that make a group something else even if an axis word appears (Megatron's
# DATA_MODULO_EXPERT_PARALLEL_GROUP, DATA_PARALLEL_GROUP_WITH_CP, MODEL_PARALLEL_GROUP...). Expert
# groups are not an axis of the grid: Megatron carves them out of data parallelism, so they do
# not tile the world with the others (a --mesh with ep lays them out).
_NOT_AXIS_WORDS = {"expert", "modulo", "with", "embedding", "position", "amax", "mp"}
_SLUG = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class ProcessGroup:
    """One torch process group as a trace describes it."""

    name: str
    desc: str
    ranks: tuple[int, ...]

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.desc, self.ranks)


@dataclass
class GroupPlan:
    """Where every process group of the job goes, and the mesh it implies."""

    world_size: int
    mesh_sizes: dict[str, int]
    coords: dict[int, dict[str, int]]
    # (desc, ranks) -> megascope group id; and id -> (kind, members)
    group_id: dict[tuple[str, tuple[int, ...]], str] = field(default_factory=dict)
    groups: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    mesh_source: str = "default"  # "option", "names", "default"

    def id_for(self, desc: str, ranks: Iterable[int]) -> str | None:
        return self.group_id.get((desc, tuple(ranks)))

    def rank_groups(self, rank: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(group id, kind, members) of every group ``rank`` belongs to."""
        return [(gid, kind, members) for gid, (kind, members) in self.groups.items() if rank in members]


def parse_ranks(value: object) -> tuple[int, ...]:
    """Ranks as traces spell them: a list, or a string like ``"[0, 1]"``."""
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    if isinstance(value, str):
        text = value.strip().strip("[]").strip()
        if not text:
            return ()
        return tuple(int(v) for v in text.split(","))
    raise ValueError(f"cannot read ranks from {value!r}")


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """``"tp=2,pp=2,dp=2"`` -> ``{"tp": 2, "pp": 2, "dp": 2}``."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        axis, sep, value = part.partition("=")
        axis = axis.strip().lower()
        if not sep or axis not in AXIS_ORDER:
            raise ConfigError(f"--mesh {spec!r}: expected AXIS=SIZE pairs with AXIS in {', '.join(AXIS_ORDER)}")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"--mesh {spec!r}: {axis} size {value!r} is not an integer") from None
        if size < 1:
            raise ConfigError(f"--mesh {spec!r}: {axis} size must be >= 1")
        sizes[axis] = size
    if not sizes:
        raise ConfigError(f"--mesh {spec!r}: no axes given")
    return sizes


def axis_from_desc(desc: str) -> str | None:
    words = set(_SLUG.split(desc.lower())) - {""}
    if words & _NOT_AXIS_WORDS:
        return None
    hits = [axis for axis, names in _AXIS_WORDS.items() if words & names]
    return hits[0] if len(hits) == 1 else None


def _partitions(groups: list[tuple[int, ...]], world_size: int) -> bool:
    if not groups:
        return False
    size = len(groups[0])
    if any(len(g) != size for g in groups):
        return False
    seen = [m for g in groups for m in g]
    return len(seen) == len(set(seen)) == world_size and set(seen) == set(range(world_size))


def _slug(desc: str, name: str) -> str:
    slug = _SLUG.sub("_", desc.lower()).strip("_")
    return slug or f"pg{name}"


def plan_groups(
    pgs: Iterable[ProcessGroup], *, world_size: int, mesh: dict[str, int] | None = None
) -> GroupPlan:
    """Map every distinct process group to a megascope group and derive the mesh."""
    distinct: dict[tuple[str, tuple[int, ...]], ProcessGroup] = {}
    for pg in pgs:
        if pg.ranks:
            distinct.setdefault(pg.key, pg)
    world = tuple(range(world_size))
    axis_of: dict[tuple[str, tuple[int, ...]], str] = {}

    mesh_obj: Mesh | None = None
    if mesh:
        mesh_obj = Mesh.from_mapping(mesh)
        if mesh_obj.world_size != world_size:
            raise ConfigError(f"--mesh {mesh} has {mesh_obj.world_size} ranks but the job has {world_size}")
        by_members = {}
        for axis in mesh_obj.axes:
            if mesh_obj.size[axis] > 1:
                for g in mesh_obj.groups(axis):
                    by_members[g.members] = axis
        for key, pg in distinct.items():
            if pg.ranks == world or pg.desc == "default_pg":
                axis_of[key] = GroupKind.WORLD
            elif tuple(sorted(pg.ranks)) in by_members:
                axis_of[key] = by_members[tuple(sorted(pg.ranks))]
    else:
        candidates: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        for key, pg in distinct.items():
            if pg.ranks == world or pg.desc == "default_pg":
                axis_of[key] = GroupKind.WORLD
                continue
            named = axis_from_desc(pg.desc)
            if named:
                candidates[named].append(key)
        for axis, keys in candidates.items():
            # Several descriptions may claim one axis; keep the one whose groups partition the world.
            by_desc: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
            for key in keys:
                by_desc[key[0]].append(key)
            for desc_keys in by_desc.values():
                if _partitions([k[1] for k in desc_keys], world_size):
                    for key in desc_keys:
                        axis_of[key] = axis
                    break

    plan = GroupPlan(world_size=world_size, mesh_sizes={}, coords={})
    # Ids: "world"; "<axis>:<i>" numbered by smallest member; other groups by their description.
    per_axis: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    others: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for key, pg in distinct.items():
        kind = axis_of.get(key)
        if kind == GroupKind.WORLD:
            plan.group_id[key] = "world"
            plan.groups["world"] = (str(GroupKind.WORLD), pg.ranks)
        elif kind:
            per_axis[kind].append(key)
        else:
            others[_slug(pg.desc, pg.name)].append(key)
    for axis, keys in per_axis.items():
        for i, key in enumerate(sorted(keys, key=lambda k: (min(k[1]), k[1]))):
            gid = f"{axis}:{i}"
            plan.group_id[key] = gid
            plan.groups[gid] = (axis, key[1])
    for slug, keys in others.items():
        for i, key in enumerate(sorted(keys, key=lambda k: (min(k[1]), k[1]))):
            gid = f"{slug}:{i}"
            plan.group_id[key] = gid
            plan.groups[gid] = (str(GroupKind.OTHER), key[1])

    _derive_mesh(plan, per_axis, mesh_obj)
    if "world" not in plan.groups:
        plan.groups["world"] = (str(GroupKind.WORLD), world)
    return plan


def _derive_mesh(
    plan: GroupPlan,
    per_axis: dict[str, list[tuple[str, tuple[int, ...]]]],
    mesh_obj: Mesh | None,
) -> None:
    world_size = plan.world_size
    if mesh_obj is not None:
        plan.mesh_sizes = dict(mesh_obj.size)
        plan.coords = {r: mesh_obj.coords(r) for r in range(world_size)}
        plan.mesh_source = "option"
        # Mesh groups the trace did not list still exist for analyses (localize follows them).
        for axis in mesh_obj.axes:
            if mesh_obj.size[axis] > 1 and axis not in per_axis:
                for g in mesh_obj.groups(axis):
                    if g.id not in plan.groups:
                        plan.groups[g.id] = (axis, g.members)
        return
    sizes = {axis: len(keys[0][1]) for axis, keys in per_axis.items()}
    named = 1
    for size in sizes.values():
        named *= size
    if not sizes or world_size % named:
        plan.mesh_sizes = {"pp": 1, "dp": world_size, "tp": 1}
        plan.coords = {r: {"pp": 0, "dp": r, "tp": 0} for r in range(world_size)}
        if sizes:
            log.warning("process groups %s do not tile %d ranks; treating the job as data parallel", sizes, world_size)
        return
    coords: dict[int, dict[str, int]] = {r: {} for r in range(world_size)}
    for axis, keys in per_axis.items():
        for _, members in keys:
            for index, member in enumerate(members):
                coords[member][axis] = index
    missing = [a for a in MESH_AXES if a not in sizes]
    rest = world_size // named
    for axis in missing:
        sizes[axis] = 1
    if rest > 1:
        # One unnamed axis absorbs what the named ones leave: dp if free, else the first free axis.
        free = [a for a in ("dp", "pp", "tp") if a in missing]
        if not free:
            plan.mesh_sizes = {"pp": 1, "dp": world_size, "tp": 1}
            plan.coords = {r: {"pp": 0, "dp": r, "tp": 0} for r in range(world_size)}
            return
        axis = free[0]
        sizes[axis] = rest
        # Index among the ranks that share every named coordinate, in rank order.
        buckets: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for r in range(world_size):
            buckets[tuple(coords[r].get(a, 0) for a in per_axis)].append(r)
        for bucket in buckets.values():
            for index, member in enumerate(sorted(bucket)):
                coords[member][axis] = index
    axes = ordered_axes((*MESH_AXES, *sizes))
    for r in range(world_size):
        for axis in axes:
            coords[r].setdefault(axis, 0)
    plan.mesh_sizes = {a: sizes[a] for a in axes}
    plan.coords = coords
    plan.mesh_source = "names"
