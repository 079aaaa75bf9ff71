"""Mesh axes, each rank's coordinates and the process groups that follow from them, as data.

Role in the data flow: the writers (trainer, synth, importers) build a :class:`Mesh` once and store
its answers in the ``ranks`` and ``groups`` tables; analyses join on those tables and never redo
rank arithmetic. Axis sizes are free; the axis order says how ranks are laid out, the last axis
varying fastest (torch's ``init_device_mesh`` and Megatron's default both put TP innermost).

Example::

    mesh = Mesh.from_sizes(tp=2, pp=2, dp=2)          # axes ("pp", "dp", "tp")
    mesh.coords(5)                                     # {"pp": 1, "dp": 0, "tp": 1}
    mesh.group_of(5, "tp")                             # Group(id="tp:2", kind="tp", members=(4, 5))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from math import prod

from megascope.errors import ConfigError
from megascope.schema import MESH_AXES, GroupKind


@dataclass(frozen=True)
class Group:
    """One process group: a unique id, the axis it spans and its members in group order."""

    id: str
    kind: str
    members: tuple[int, ...]

    def index_of(self, rank: int) -> int:
        return self.members.index(rank)


@dataclass(frozen=True)
class Mesh:
    """A named, ordered grid of ranks. ``axes[-1]`` varies fastest."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.sizes):
            raise ConfigError(f"mesh has {len(self.axes)} axes but {len(self.sizes)} sizes")
        if len(set(self.axes)) != len(self.axes):
            raise ConfigError(f"mesh axes repeat: {self.axes}")
        for axis, size in zip(self.axes, self.sizes, strict=True):
            if size < 1:
                raise ConfigError(f"mesh axis {axis} must have size >= 1, got {size}")

    @classmethod
    def from_sizes(cls, order: tuple[str, ...] = MESH_AXES, **sizes: int) -> Mesh:
        """Mesh over ``order`` (default pp, dp, tp); axes not given have size 1."""
        unknown = set(sizes) - set(order)
        if unknown:
            raise ConfigError(f"unknown mesh axes {sorted(unknown)}; known: {', '.join(order)}")
        return cls(tuple(order), tuple(int(sizes.get(a, 1)) for a in order))

    @classmethod
    def from_mapping(cls, sizes: Mapping[str, int], order: tuple[str, ...] = MESH_AXES) -> Mesh:
        return cls.from_sizes(order=order, **dict(sizes))

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None) -> Mesh:
        """The mesh of a job of ``world_size`` ranks; ``dp`` defaults to what is left."""
        if tp < 1 or pp < 1:
            raise ConfigError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        if dp is None:
            if world_size % (tp * pp):
                raise ConfigError(f"world size {world_size} is not divisible by tp*pp = {tp * pp}")
            dp = world_size // (tp * pp)
        if tp * pp * dp != world_size:
            raise ConfigError(f"tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} does not match world size {world_size}")
        return cls.from_sizes(tp=tp, pp=pp, dp=dp)

    @property
    def world_size(self) -> int:
        return prod(self.sizes)

    @property
    def size(self) -> dict[str, int]:
        return dict(zip(self.axes, self.sizes, strict=True))

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        strides = []
        acc = 1
        for size in reversed(self.sizes):
            strides.append(acc)
            acc *= size
        return tuple(reversed(strides))

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        return {a: (rank // st) % sz for a, st, sz in zip(self.axes, self._strides, self.sizes, strict=True)}

    def rank_of(self, **coords: int) -> int:
        return sum(coords.get(a, 0) * st for a, st in zip(self.axes, self._strides, strict=True))

    def group_of(self, rank: int, axis: str) -> Group:
        """The group of ranks that differ from ``rank`` only along ``axis``."""
        if axis == GroupKind.WORLD:
            return Group("world", GroupKind.WORLD, tuple(range(self.world_size)))
        if axis not in self.axes:
            raise ConfigError(f"unknown mesh axis {axis!r}; this mesh has {', '.join(self.axes)}")
        c = self.coords(rank)
        members = tuple(self.rank_of(**{**c, axis: i}) for i in range(self.size[axis]))
        # Index the group by the coordinates of the other axes, row-major: ids are dense 0..n-1.
        index = 0
        for a, sz in zip(self.axes, self.sizes, strict=True):
            if a != axis:
                index = index * sz + c[a]
        kind = axis if axis in GroupKind.__members__.values() else GroupKind.OTHER
        return Group(f"{axis}:{index}", str(kind), members)

    def groups(self, axis: str) -> Iterator[Group]:
        """Every group along ``axis``, each once, in id order."""
        seen: set[str] = set()
        for rank in range(self.world_size):
            group = self.group_of(rank, axis)
            if group.id not in seen:
                seen.add(group.id)
                yield group

    def rank_groups(self, rank: int) -> list[Group]:
        """The groups ``rank`` belongs to: one per axis of size > 1, and the world."""
        out = [self.group_of(rank, a) for a, sz in zip(self.axes, self.sizes, strict=True) if sz > 1]
        out.append(self.group_of(rank, GroupKind.WORLD))
        return out

    def describe(self, rank: int) -> str:
        """``"pp=1 dp=0 tp=1"``: how a person names a rank's place in the mesh."""
        return " ".join(f"{a}={v}" for a, v in self.coords(rank).items())
