"""Layout-conversion costs for eq. (1)'s edge matrices (MAP §4.3, §5.1's R), one Dijkstra per source.

costs.map_layout.convert prices one (source, target) pair by Dijkstra over the valid specs and stops
at the target. An edge matrix asks for every pair of its two nodes' strategies, both ways: on a 3-D
mesh (up to (ndim+1)^3 = 64 specs per tensor, 125 strategies per linear) building
experiment=map_gpt2_delta's tables ran ~11,600 such searches, each re-deriving the same one-step
neighbours (issue 26: 55-100 s of its planning). Here the one-step graph of a tensor (shape, dtype
bytes, mesh) is built once and one Dijkstra per source settles every target.

Same numbers as convert, bit for bit: the search pushes the same heap entries (cost, steps, the
path's spec texts) in the same order and only differs in not stopping at a target, so every target
is popped with the cost convert's own search pops it with (tests/unit/map/test_map_cluster_nd.py
compares all pairs). Pure: no I/O, no torch.
"""
from __future__ import annotations

import functools
import heapq

from costs.map_layout import check_spec, one_step, step_cost_s
from specs.sharding import Mesh, ShardingSpec


@functools.lru_cache(maxsize=4096)
def _graph(src: ShardingSpec, shape: tuple[int, ...], dtype_bytes: int, mesh: Mesh) -> tuple:
    """One spec's one-step neighbours and their step costs (map_layout.one_step's order)."""
    return tuple((nxt, step_cost_s(step, nxt, shape, dtype_bytes, mesh)) for nxt, step in one_step(src, shape, mesh.shape))


@functools.lru_cache(maxsize=16384)
def costs_from(src: ShardingSpec, shape: tuple[int, ...], dtype_bytes: int, mesh: Mesh) -> dict[ShardingSpec, float]:
    """Seconds of the cheapest conversion from ``src`` to every valid spec of a ``shape`` tensor of
    ``dtype_bytes`` per element on ``mesh`` (map_layout.convert(src, dst, ...).cost_s for each dst)."""
    check_spec(src, shape, mesh.shape, "source")
    heap: list = [(0.0, 0, (str(src),), src)]
    out: dict[ShardingSpec, float] = {}
    while heap:
        cost, n, key, here = heapq.heappop(heap)
        if here in out:
            continue
        out[here] = cost
        for nxt, c in _graph(here, shape, dtype_bytes, mesh):
            if nxt not in out:
                heapq.heappush(heap, (cost + c, n + 1, key + (str(nxt),), nxt))
    return out


def round_trip_s(src: ShardingSpec, dst: ShardingSpec, shape, dtype_bytes: int, mesh: Mesh) -> float:
    """src -> dst plus dst -> src (forward activation and backward gradient), 0 when equal or of
    different rank (a view between them; the plan's _StageModel convention)."""
    if src == dst or src.ndim != dst.ndim:
        return 0.0
    shape, db = tuple(int(n) for n in shape), int(dtype_bytes)
    check_spec(dst, shape, mesh.shape, "target")
    return costs_from(src, shape, db, mesh)[dst] + costs_from(dst, shape, db, mesh)[src]
