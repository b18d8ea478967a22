"""MAP's tensor layout manager (MAP §4.3): how to turn a tensor sharded one way into another.

A spec (``specs.sharding.ShardingSpec``, MAP §2.1) says which mesh axes split each tensor dim. Three
operations change it by one mesh axis each (MAP §4.3 "One-step transform"):

- all-gather along axis a: the dim split last by a is gathered (its list drops a);
- shard along an unused axis a: a local slice (no communication), a joins the end of a dim's list;
- all-to-all along axis a: a moves from the end of one dim's list to the end of another's.

Axis order within a dim. DTensor's ``Shard(i)`` on several mesh axes splits dim i in mesh-axis
order: the lowest axis cuts the outer blocks, each higher axis cuts inside them. So the only lists
DTensor expresses are ascending ("S01", never "S10"), and those are the specs this module works on.
The three operations keep lists ascending, because each touches only the *inner* (last) axis of a
list: gathering or slicing the inner axis of a block, or exchanging inner pieces among the devices
of one axis, is a collective over that axis alone. Touching an outer axis (S01 -> S1) would need
data from devices that differ on the other axis too, which is no single-axis collective.

``convert`` is exact: Dijkstra over the few valid specs, edges priced with the alpha-beta mesh
(MAP §4.2, §4.3 "Solver supports"), cached like MAP's cache dictionary. ``heuristic_path`` is
Algorithm 1 as published, kept to compare with (tests: it always arrives, never cheaper).

Pure: no I/O, no torch (executor.sharding maps a spec to DTensor placements).
"""
from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Literal

from specs.sharding import Mesh, ShardingSpec

Op = Literal["all_gather", "shard", "all_to_all"]


@dataclass(frozen=True)
class Step:
    """One operation on one mesh axis. ``src_dim`` loses ``axis`` (all_gather, all_to_all);
    ``dst_dim`` gains it (shard, all_to_all)."""

    op: Op
    axis: int
    src_dim: int | None = None
    dst_dim: int | None = None

    def __str__(self) -> str:
        if self.op == "all_gather":
            return f"all_gather(axis {self.axis}, dim {self.src_dim})"
        if self.op == "shard":
            return f"shard(axis {self.axis}, dim {self.dst_dim})"
        return f"all_to_all(axis {self.axis}, dim {self.src_dim} -> {self.dst_dim})"


@dataclass(frozen=True)
class Conversion:
    """The cheapest way from ``path[0]`` to ``path[-1]``: ``steps[k]`` turns ``path[k]`` into
    ``path[k+1]``. ``cost_s``: alpha-beta seconds, summed. ``peak_bytes``: the largest local tensor
    one device holds at any spec on the path (an all-gather grows it). ``work_bytes``: the most bytes
    one step allocates at once (step_work_bytes): its output and an all-gather's second buffer --
    what a conversion adds to the live set while it runs, its input being live already (issue 26)."""

    path: tuple[ShardingSpec, ...]
    steps: tuple[Step, ...]
    cost_s: float
    peak_bytes: int
    work_bytes: int = 0


# ---- validity ------------------------------------------------------------------------------------

def check_spec(spec: ShardingSpec, shape: tuple[int, ...], mesh_shape: tuple[int, ...], role: str = "") -> None:
    """Raise ValueError naming the spec and the offending dim unless ``spec`` can lay out a tensor
    of ``shape`` on ``mesh_shape`` as DTensor does (ascending axes, even splits)."""
    name = f"{role + ' ' if role else ''}sharding spec {spec}"
    if spec.ndim != len(shape):
        raise ValueError(f"{name}: {spec.ndim} dims, but the tensor has shape {tuple(shape)}")
    for i, axes in enumerate(spec.dims):
        for a in axes:
            if a >= len(mesh_shape):
                raise ValueError(f"{name}: dim {i} uses mesh axis {a}, "
                                 f"the mesh {tuple(mesh_shape)} has {len(mesh_shape)}")
        if list(axes) != sorted(axes):
            # DTensor splits a dim in mesh-axis order (outer = lowest axis): see the module docstring
            raise ValueError(f"{name}: dim {i} lists mesh axes {axes} out of mesh order; "
                             f"DTensor's Shard({i}) on several axes splits in ascending axis order")
        pieces = spec.shard_factor(mesh_shape, i)
        if shape[i] % pieces:
            # MAP §4.3: a dim that does not divide is invalid (DTensor would make uneven shards)
            raise ValueError(f"{name}: dim {i} of size {shape[i]} does not split evenly into {pieces} "
                             f"pieces over mesh axes {axes} of sizes {tuple(mesh_shape[a] for a in axes)}")


def _ok(spec: ShardingSpec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    try:
        check_spec(spec, shape, mesh_shape)
    except ValueError:
        return False
    return True


def valid_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[ShardingSpec]:
    """Every spec for ``shape`` on ``mesh_shape`` (each axis on one dim or unused; ascending lists
    make the assignment the spec), sorted by text."""
    ndim = len(shape)
    out = []
    for owner in itertools.product(range(-1, ndim), repeat=len(mesh_shape)):
        dims = tuple(tuple(a for a, d in enumerate(owner) if d == i) for i in range(ndim))
        spec = ShardingSpec(dims)
        if _ok(spec, tuple(shape), tuple(mesh_shape)):
            out.append(spec)
    return sorted(out, key=str)


# ---- one-step transforms (MAP §4.3) ----------------------------------------------------------------

def _with(dims: tuple[tuple[int, ...], ...], i: int, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return dims[:i] + (axes,) + dims[i + 1:]


def one_step(spec: ShardingSpec, shape: tuple[int, ...],
             mesh_shape: tuple[int, ...]) -> list[tuple[ShardingSpec, Step]]:
    """Every valid spec one operation away from ``spec`` (MAP §4.3): all-gathers by dim, then
    shards by (dim, axis), then all-to-alls by (from dim, to dim). S0R on a 2-D mesh gives
    RR, S01R, S0S1, RS0 (the paper's example)."""
    shape, mesh_shape = tuple(shape), tuple(mesh_shape)
    check_spec(spec, shape, mesh_shape, "source")
    dims, used = spec.dims, spec.mesh_axes()
    out: list[tuple[ShardingSpec, Step]] = []
    # all-gather on the inner axis of a dim (growing the shard: always valid)
    for i, axes in enumerate(dims):
        if axes:
            out.append((ShardingSpec(_with(dims, i, axes[:-1])), Step("all_gather", axes[-1], src_dim=i)))
    # shard: a local slice of the current shard by an unused axis, which becomes dim i's inner axis
    for i, axes in enumerate(dims):
        for a in range(len(mesh_shape)):
            if a not in used and (not axes or a > axes[-1]):
                out.append((ShardingSpec(_with(dims, i, axes + (a,))), Step("shard", a, dst_dim=i)))
    # all-to-all on axis a: dim i's inner axis becomes dim j's inner axis
    for i, j in itertools.permutations(range(len(dims)), 2):
        if dims[i] and (not dims[j] or dims[i][-1] > dims[j][-1]):
            a = dims[i][-1]
            moved = _with(_with(dims, i, dims[i][:-1]), j, dims[j] + (a,))
            out.append((ShardingSpec(moved), Step("all_to_all", a, src_dim=i, dst_dim=j)))
    return [(s, st) for s, st in out if _ok(s, shape, mesh_shape)]


def local_bytes(spec: ShardingSpec, shape: tuple[int, ...], dtype_bytes: int, mesh_shape: tuple[int, ...]) -> int:
    return spec.local_numel(tuple(shape), tuple(mesh_shape)) * dtype_bytes


def step_cost_s(step: Step, after: ShardingSpec, shape: tuple[int, ...], dtype_bytes: int, mesh: Mesh) -> float:
    """Alpha-beta seconds of one step (MAP §4.3 "Solver supports"): an all-gather priced on the
    shard it produces, an all-to-all on the shard it moves (same size before and after), a shard
    at 0 s (a local slice; no link is used)."""
    nbytes = local_bytes(after, shape, dtype_bytes, mesh.shape)
    if step.op == "all_gather":
        return mesh.all_gather_s(step.axis, nbytes)
    if step.op == "all_to_all":
        return mesh.all_to_all_s(step.axis, nbytes)
    return 0.0


def step_work_bytes(step: Step, before: ShardingSpec, after: ShardingSpec, shape: tuple[int, ...],
                    dtype_bytes: int, mesh_shape: tuple[int, ...]) -> int:
    """Bytes one device allocates while ``step`` runs (its input is live already): its output, and
    for an all-gather a second gathered-size buffer. torch's functional all_gather_tensor (DTensor's
    Shard -> Replicate goes through it) fills a dim-0 buffer (all_gather_into_tensor), wraps it for
    autograd and, off dim 0, cats its chunks into the output; measured with executor.memtrack
    (issue 26, hf_gpt2 on 4 CPU ranks, a (64, 256) fp32 gather on dim 1): staging + wrap, then
    staging + cat output, 2 x 64 KiB live at once each time. ``before`` is unused (kept for steps
    whose scratch depends on the input)."""
    a = local_bytes(after, shape, dtype_bytes, mesh_shape)
    return 2 * a if step.op == "all_gather" else a


def path_cost_s(path: tuple[ShardingSpec, ...], shape: tuple[int, ...], dtype_bytes: int, mesh: Mesh) -> float:
    """Price a path of specs, each one step from the last (e.g. a ``heuristic_path``)."""
    total = 0.0
    for a, b in zip(path, path[1:]):
        step = next((st for s, st in one_step(a, shape, mesh.shape) if s == b), None)
        if step is None:
            raise ValueError(f"{b} is not one step from {a}")
        total += step_cost_s(step, b, shape, dtype_bytes, mesh)
    return total


# ---- exact conversion (Dijkstra) ------------------------------------------------------------------

def _as_spec(spec: ShardingSpec | str) -> ShardingSpec:
    return ShardingSpec.parse(spec) if isinstance(spec, str) else spec


def convert(src: ShardingSpec | str, dst: ShardingSpec | str, shape: tuple[int, ...], dtype_bytes: int,
            mesh: Mesh) -> Conversion:
    """The cheapest step sequence from ``src`` to ``dst`` for a tensor of ``shape`` (elements) of
    ``dtype_bytes`` per element on ``mesh``. Cached: the same arguments return the same object
    (MAP §4.3 keeps solved pairs in a cache dictionary; the ILP asks for every edge's pairs)."""
    return _convert(_as_spec(src), _as_spec(dst), tuple(int(n) for n in shape), int(dtype_bytes), mesh)


@functools.lru_cache(maxsize=65536)
def _convert(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], dtype_bytes: int, mesh: Mesh) -> Conversion:
    mesh_shape = mesh.shape
    check_spec(src, shape, mesh_shape, "source")
    check_spec(dst, shape, mesh_shape, "target")
    # Dijkstra; ties go to fewer steps, then to the path whose spec texts sort first, so the answer
    # does not depend on dict or heap order. The space is tiny ((ndim+1)^mesh_ndim specs at most).
    heap: list = [(0.0, 0, (str(src),), (src,), ())]
    done: set[ShardingSpec] = set()
    while heap:
        cost, n, key, path, steps = heapq.heappop(heap)
        here = path[-1]
        if here in done:
            continue
        if here == dst:
            peak = max(local_bytes(s, shape, dtype_bytes, mesh_shape) for s in path)
            work = max((step_work_bytes(st, a, b, shape, dtype_bytes, mesh_shape)
                        for st, a, b in zip(steps, path, path[1:])), default=0)
            return Conversion(path=path, steps=steps, cost_s=cost, peak_bytes=peak, work_bytes=work)
        done.add(here)
        for nxt, step in one_step(here, shape, mesh_shape):
            if nxt not in done:
                c = cost + step_cost_s(step, nxt, shape, dtype_bytes, mesh)
                heapq.heappush(heap, (c, n + 1, key + (str(nxt),), path + (nxt,), steps + (step,)))
    raise AssertionError(f"no path from {src} to {dst}")  # unreachable: RR reaches every valid spec


# ---- Algorithm 1 (greedy by the dim-by-dim heuristic) -----------------------------------------------

#: MAP §4.3 gives the rule (all-gather costlier than shard, a penalty per extra step) but no numbers;
#: these are the values of MAP's code release (ColossalAI's sharding_spec.py).
ALLGATHER_COST = 20
SHARD_COST = 5
STEP_PENALTY = 6


def dim_diff(src_axes: tuple[int, ...], dst_axes: tuple[int, ...]) -> int:
    """MAP §4.3 dim difference: gather src's axes past the common prefix, shard dst's, and pay a
    penalty for every step beyond the first (S0 -> S1 = all-gather + shard + penalty)."""
    p = 0
    while p < min(len(src_axes), len(dst_axes)) and src_axes[p] == dst_axes[p]:
        p += 1
    gathers, shards = len(src_axes) - p, len(dst_axes) - p
    return gathers * ALLGATHER_COST + shards * SHARD_COST + max(gathers + shards - 1, 0) * STEP_PENALTY


def heuristic(spec: ShardingSpec, target: ShardingSpec) -> int:
    """MAP §4.3 Heuristic: the sum over dims of ``dim_diff`` (0 iff equal)."""
    return sum(dim_diff(s, t) for s, t in zip(spec.dims, target.dims))


#: Algorithm 1 has no bound; a path longer than this means it is cycling
MAX_HEURISTIC_STEPS = 32


def heuristic_path(src: ShardingSpec | str, dst: ShardingSpec | str, shape: tuple[int, ...],
                   mesh_shape: tuple[int, ...]) -> tuple[ShardingSpec, ...]:
    """MAP Algorithm 1: from ``src``, repeatedly move to the one-step transform with the least
    ``heuristic`` difference to ``dst`` (the first in ``one_step`` order on a tie) until it is dst.
    Returns the specs visited, src first, dst last."""
    src, dst, shape, mesh_shape = _as_spec(src), _as_spec(dst), tuple(shape), tuple(mesh_shape)
    check_spec(dst, shape, mesh_shape, "target")
    path = [src]
    while path[-1] != dst:
        if len(path) > MAX_HEURISTIC_STEPS:
            raise RuntimeError(f"Algorithm 1 did not reach {dst} from {src}: {' -> '.join(map(str, path[:8]))} ...")
        best = min(one_step(path[-1], shape, mesh_shape), key=lambda c: heuristic(c[0], dst))  # first on ties
        path.append(best[0])
    return tuple(path)
