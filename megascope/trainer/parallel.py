"""Process groups of a ``pp x dp x tp`` mesh, built once per rank from :class:`megascope.topology.Mesh`.

Role in the data flow: the trainer asks this module which torch process group carries each kind of
traffic (tp, pp, dp, world) and registers each with the collector under the same id the ``groups``
table uses ("tp:3", "dp:0", ...), so every stamped collective names its group.

Plain ``new_group`` calls are used rather than ``init_device_mesh``: they behave the same on gloo
and NCCL, take the collective timeout directly, and every rank creates every group in one fixed
order (a torch requirement), which is the order of :meth:`Mesh.groups`.

Example::

    ps = ParallelState.build(mesh, rank, timeout=timedelta(seconds=60))
    ps.tp.pg, ps.tp.size, ps.tp.index, ps.pp.members
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megascope.topology import Group, Mesh


@dataclass(frozen=True)
class Axis:
    """This rank's group along one mesh axis: the torch group (None when the axis has size 1)."""

    group: Group
    pg: Any

    @property
    def size(self) -> int:
        return len(self.group.members)

    @property
    def members(self) -> tuple[int, ...]:
        return self.group.members

    @property
    def id(self) -> str:
        return self.group.id


@dataclass(frozen=True)
class ParallelState:
    rank: int
    mesh: Mesh
    coords: dict[str, int]
    tp: Axis
    pp: Axis
    dp: Axis
    world: Axis

    @classmethod
    def build(cls, mesh: Mesh, rank: int, *, timeout: timedelta) -> ParallelState:
        """Create every group of every axis (all ranks must call this in the same order)."""
        mine: dict[str, Axis] = {}
        for axis in ("pp", "dp", "tp"):
            own = mesh.group_of(rank, axis)
            pg = None
            for group in mesh.groups(axis):
                if len(group.members) == 1:
                    continue
                created = dist.new_group(list(group.members), timeout=timeout)
                if group.id == own.id:
                    pg = created
            mine[axis] = Axis(own, pg)
        world = Axis(mesh.group_of(rank, "world"), dist.group.WORLD)
        return cls(rank=rank, mesh=mesh, coords=mesh.coords(rank), tp=mine["tp"], pp=mine["pp"],
                   dp=mine["dp"], world=world)

    @property
    def tp_index(self) -> int:
        return self.coords["tp"]

    @property
    def pp_index(self) -> int:
        return self.coords["pp"]

    @property
    def dp_index(self) -> int:
        return self.coords["dp"]

    @property
    def first_stage(self) -> bool:
        return self.pp_index == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_index == self.pp.size - 1

    def groups(self) -> list[Group]:
        """This rank's groups for the ``groups`` table: axes of size > 1 and the world."""
        return [a.group for a in (self.pp, self.dp, self.tp) if a.size > 1] + [self.world.group]

    def register(self, collector: Any) -> None:
        for axis in (self.pp, self.dp, self.tp, self.world):
            if axis.pg is not None:
                collector.register_group(axis.pg, axis.group)
