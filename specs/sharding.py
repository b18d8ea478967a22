"""Sharding specs on an N-D logical device mesh (MAP §2.1, §4.3; GSPMD's notation).

A tensor of n dims has a spec X_0 X_1 ... X_{n-1}: X_i is R (replicated) or S with the mesh axes
that split dim i, in order ("S0", "S1", "S01": split over axis 0 then axis 1). Each mesh axis splits
at most one dim. This maps one-to-one onto DTensor placements: mesh axis a is ``Shard(i)`` when
dim i lists a, else ``Replicate()`` (a dim split over two axes is DTensor's ``Shard(i)`` on both,
axis order = the spec's order). ``Partial`` sums (a contraction split over an axis) are not a
spec: a strategy that leaves one pays its all-reduce (or reduce-scatter) as intra-op communication.

Types and pure functions only (STYLE: specs/ holds no I/O and imports no torch).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: ASCII digits only: ``\d`` also matches other scripts' digits (U+FF10 "０"), which int() accepts
_DIM = re.compile(r"R|S[0-9]+")


@dataclass(frozen=True, order=True)
class ShardingSpec:
    """``dims[i]``: the mesh axes splitting tensor dim i, in order (empty: replicated)."""

    dims: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        used = [a for axes in self.dims for a in axes]
        if len(set(used)) != len(used):
            raise ValueError(f"sharding spec {self}: a mesh axis splits two dims (or one dim twice)")
        if any(a < 0 for a in used):
            raise ValueError(f"sharding spec {self}: mesh axes are >= 0")

    @classmethod
    def parse(cls, text: str) -> ShardingSpec:
        """``"S0R"``, ``"RS01"``, ``"S1S0"``, ``"RR"``; ``""`` is a 0-d tensor (a loss); spaces are ignored."""
        body = text.replace(" ", "")
        if body == "":
            return cls(())
        tokens = _DIM.findall(body)
        if "".join(tokens) != body:
            raise ValueError(f"sharding spec {text!r}: expected one R or S<axes> per tensor dim, e.g. 'S0R', 'RS01'")
        return cls(tuple(() if t == "R" else tuple(int(c) for c in t[1:]) for t in tokens))

    @classmethod
    def replicated(cls, ndim: int) -> ShardingSpec:
        return cls(((),) * ndim)

    def __str__(self) -> str:
        return "".join("R" if not axes else "S" + "".join(map(str, axes)) for axes in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def mesh_axes(self) -> set[int]:
        return {a for axes in self.dims for a in axes}

    def shard_factor(self, mesh_shape: tuple[int, ...], dim: int) -> int:
        """How many pieces dim ``dim`` is cut into."""
        return math.prod(mesh_shape[a] for a in self.dims[dim])

    def valid_for(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
        """Every axis exists and every split dim divides evenly (MAP §4.3: otherwise invalid)."""
        if len(shape) != self.ndim:
            return False
        if any(a >= len(mesh_shape) for a in self.mesh_axes()):
            return False
        return all(shape[i] % self.shard_factor(mesh_shape, i) == 0 for i in range(self.ndim))

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shard one device holds."""
        return tuple(shape[i] // self.shard_factor(mesh_shape, i) for i in range(self.ndim))

    def local_numel(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
        return math.prod(self.local_shape(shape, mesh_shape))

    def placements(self, mesh_ndim: int) -> list[tuple[str, int | None]]:
        """DTensor placements per mesh axis: ("shard", dim) or ("replicate", None)."""
        out: list[tuple[str, int | None]] = [("replicate", None)] * mesh_ndim
        for i, axes in enumerate(self.dims):
            for a in axes:
                out[a] = ("shard", i)
        return out

    @classmethod
    def from_placements(cls, placements: list[tuple[str, int | None]], ndim: int) -> ShardingSpec:
        """The inverse of :meth:`placements` (axis order within a dim: mesh axis order)."""
        dims: list[list[int]] = [[] for _ in range(ndim)]
        for axis, (kind, dim) in enumerate(placements):
            if kind == "shard":
                dims[dim].append(axis)
        return cls(tuple(tuple(d) for d in dims))


@dataclass(frozen=True)
class MeshAxis:
    """One logical mesh axis: its size and the alpha-beta of a collective among its devices
    (the cluster detector's fit, MAP §4.2; bus bandwidth, so ring collectives cost n-1/n x)."""

    size: int
    alpha_s: float
    beta_bytes_per_s: float


@dataclass(frozen=True)
class Mesh:
    axes: tuple[MeshAxis, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def all_gather_s(self, axis: int, out_bytes: float) -> float:
        """All-gather over ``axis`` producing ``out_bytes`` per device (ring: (n-1)/n of it moves)."""
        ax = self.axes[axis]
        if ax.size == 1:
            return 0.0
        return ax.alpha_s * (ax.size - 1) + out_bytes * (ax.size - 1) / ax.size / ax.beta_bytes_per_s

    def all_reduce_s(self, axis: int, nbytes: float) -> float:
        """All-reduce of ``nbytes`` per device over ``axis``: reduce-scatter + all-gather."""
        ax = self.axes[axis]
        if ax.size == 1:
            return 0.0
        return 2 * ax.alpha_s * (ax.size - 1) + 2 * nbytes * (ax.size - 1) / ax.size / ax.beta_bytes_per_s

    def reduce_scatter_s(self, axis: int, in_bytes: float) -> float:
        """Reduce-scatter of ``in_bytes`` per device over ``axis`` (half an all-reduce)."""
        return self.all_reduce_s(axis, in_bytes) / 2

    def all_to_all_s(self, axis: int, nbytes: float) -> float:
        """All-to-all of ``nbytes`` per device over ``axis``: (n-1)/n of it leaves each device."""
        ax = self.axes[axis]
        if ax.size == 1:
            return 0.0
        return ax.alpha_s * (ax.size - 1) + nbytes * (ax.size - 1) / ax.size / ax.beta_bytes_per_s


def mesh_lines(items: list, shape: tuple[int, ...], axis: int) -> list[list]:
    """The items along mesh ``axis``, one list per line, ``items`` laid out row-major on a mesh of
    ``shape`` (the last axis fastest: ``items[i]`` sits at ``unravel(i, shape)``). The executor makes
    one process group per line (executor.topology); the simulator prices one ring per line."""
    stride = math.prod(shape[axis + 1:])
    starts = [i for i in range(len(items)) if (i // stride) % shape[axis] == 0]
    return [[items[i + j * stride] for j in range(shape[axis])] for i in starts]

