"""Sharding specs as DTensor placements: the one place a plan's ``ShardingSpec`` meets
``torch.distributed.tensor`` (MAP's layouts, executed by executor.map_exec)."""
from __future__ import annotations

from specs.sharding import ShardingSpec


def to_dtensor_placements(spec: ShardingSpec | str, mesh_ndim: int) -> list:
    """The ``torch.distributed.tensor`` placements of ``spec`` on a mesh of ``mesh_ndim`` axes:
    ``Shard(i)`` on each axis that splits dim i, ``Replicate()`` elsewhere. A dim over several
    axes becomes Shard(i) on each, which DTensor splits in ascending axis order, as the spec says."""
    spec = ShardingSpec.parse(spec) if isinstance(spec, str) else spec
    for i, axes in enumerate(spec.dims):
        if any(a >= mesh_ndim for a in axes) or list(axes) != sorted(axes):
            raise ValueError(f"sharding spec {spec}: dim {i} over mesh axes {axes} has no DTensor "
                             f"placements on a {mesh_ndim}-axis mesh (axes must exist and ascend)")
    from torch.distributed.tensor import Replicate, Shard  # only here: importing this module needs no torch.distributed

    return [Shard(dim) if kind == "shard" else Replicate() for kind, dim in spec.placements(mesh_ndim)]
