"""Mesh axes, each rank's coordinates and the process groups that follow from them, as data.

Role in the data flow: the writers (trainer, synth, importers) build a :class:`Mesh` once and store
its answers in the ``ranks`` and ``groups`` tables; analyses join on those tables and never redo
rank arithmetic. Axis sizes are free; the axis order says how ranks are laid out, the last axis
varying fastest (torch's ``init_device_mesh`` and Megatron's default both put TP innermost). The
order of known axes is ``schema.AXIS_ORDER``; :func:`format_coords` is how a rank's place is shown,
everywhere (reports, the dashboard, exports).

Example::

    mesh = Mesh.from_sizes(tp=2, pp=2, dp=2)          # axes ("pp", "dp", "tp")
    mesh.coords(5)                                     # {"pp": 1, "dp": 0, "tp": 1}
    mesh.group_of(5, "tp")                             # Group(id="tp:2", kind="tp", members=(4, 5))
    format_coords(mesh.coords(5))                      # "pp1 dp0 tp1"
    Mesh.for_world(16, tp=2, pp=2, cp=2).axes          # ("pp", "dp", "cp", "tp")
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any

from megascope.errors import ConfigError
from megascope.schema import AXIS_ORDER, MESH_AXES, GroupKind, ordered_axes


def coords_of(value: Any, axes: Iterable[str] = ()) -> dict[str, int]:
    """A rank's coordinates as a dict in axis order, from what a reader holds: a ``coords`` value
    of the ranks table as DuckDB (a dict), pandas (a dict or NA) or pyarrow (a list of pairs) gives
    it, or None. ``axes`` (a run's ``mesh_axes``) gives the order; axes it does not name follow in
    :data:`~megascope.schema.AXIS_ORDER`. Entries without a value are left out."""
    if value is None or isinstance(value, float) or type(value).__name__ == "NAType":  # None, NaN, pandas' NA
        return {}
    pairs = value.items() if isinstance(value, Mapping) else value
    place: dict[str, int] = {}
    for axis, index in pairs:
        if index is not None and index == index:  # NaN is not equal to itself
            place[str(axis)] = int(index)
    order = [a for a in dict.fromkeys(axes) if a in place]
    order += [a for a in ordered_axes(place) if a not in order]
    return {a: place[a] for a in order}


def ranks_text(n: int) -> str:
    """``"1 rank"``, ``"8 ranks"``: a count of ranks as a header says it."""
    return f"{int(n):,} rank" if int(n) == 1 else f"{int(n):,} ranks"


def format_coords(coords: Any, axes: Iterable[str] = ()) -> str:
    """``"pp1 dp0 cp1 tp3"``: how a rank's place in the mesh is shown, the one way.

    ``coords`` and ``axes`` as :func:`coords_of` takes them. Unknown coordinates are left out; no
    coordinates at all give ``""``.
    """
    return " ".join(f"{a}{i}" for a, i in coords_of(coords, axes).items())


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
    def from_sizes(cls, order: tuple[str, ...] | None = None, **sizes: int) -> Mesh:
        """Mesh over ``order``; axes of it not given have size 1. Without ``order``: pp, dp, tp and
        the known axes given (say cp, ep), in :data:`~megascope.schema.AXIS_ORDER`."""
        if order is None:
            unknown = set(sizes) - set(AXIS_ORDER)
            if unknown:
                raise ConfigError(f"unknown mesh axes {sorted(unknown)}; known: {', '.join(AXIS_ORDER)}")
            order = ordered_axes((*MESH_AXES, *sizes))
        unknown = set(sizes) - set(order)
        if unknown:
            raise ConfigError(f"unknown mesh axes {sorted(unknown)}; known: {', '.join(order)}")
        return cls(tuple(order), tuple(int(sizes.get(a, 1)) for a in order))

    @classmethod
    def from_mapping(cls, sizes: Mapping[str, int], order: tuple[str, ...] | None = None) -> Mesh:
        return cls.from_sizes(order=order, **dict(sizes))

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
                  ep: int = 1) -> Mesh:
        """The mesh of a job of ``world_size`` ranks; ``dp`` defaults to what is left. cp and ep
        are axes of the mesh only where their size is above 1."""
        if min(tp, pp, cp, ep) < 1:
            raise ConfigError(f"tp, pp, cp and ep must be >= 1, got tp={tp} pp={pp} cp={cp} ep={ep}")
        extra = {a: n for a, n in (("cp", cp), ("ep", ep)) if n > 1}
        inner = tp * pp * prod(extra.values())
        named = "*".join(["tp", "pp", *extra])
        if dp is None:
            if world_size % inner:
                raise ConfigError(f"world size {world_size} is not divisible by {named} = {inner}")
            dp = world_size // inner
        if inner * dp != world_size:
            raise ConfigError(f"{named}*dp = {inner}*{dp} = {inner * dp} does not match world size {world_size}")
        return cls.from_mapping({"tp": tp, "pp": pp, "dp": dp, **extra})

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
        """``"pp1 dp0 tp1"``: how a person names a rank's place in the mesh (:func:`format_coords`)."""
        return format_coords(self.coords(rank), self.axes)
