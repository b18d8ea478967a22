"""planners/map/blocks.py's factor join streamed (issue 26: on gpt_tiny with a 2x2x2 mesh at 0.9x
the free peak, one join formed the whole cross product of two Pareto factors and allocated > 1 GiB).

Checked: the streamed join returns exactly the rows of the one-shot join (same keys, times, bytes
and eliminated choices, in the same order), and its allocation peak (tracemalloc, which numpy's
allocations report to) stays a small fraction of what the cross product alone takes."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from planners.map import block_graph, blocks
from planners.map.blocks import _Table, _join


def _factor(rng, scope: list[int], size: dict, points: int, elim_node: int) -> _Table:
    """A factor over ``scope``: per key assignment ``points`` Pareto points (time falls as bytes
    rise), each carrying one eliminated node's choice."""
    keys = np.array(np.meshgrid(*[np.arange(size[v]) for v in scope], indexing="ij")).reshape(len(scope), -1).T
    rows = np.repeat(keys, points, axis=0)
    m = np.tile(np.sort(rng.choice(1 << 20, points, replace=False)), len(keys)).astype(np.int64) * 512
    t = np.tile(np.sort(rng.random(points))[::-1], len(keys))
    choice = rng.integers(0, 7, size=(len(t), 1))
    return _Table(scope, rows, t, m, [elim_node], choice, {elim_node})


def _tables(points: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    size = {0: 2, 1: 3, 2: 2}
    a = _factor(rng, [0, 1], size, points, 10)
    b = _factor(rng, [1, 2], size, points, 11)
    return a, b, size


def _same(x: _Table, y: _Table) -> None:
    assert x.scope == y.scope and x.elim == y.elim and x.placed == y.placed
    for f in ("key", "t", "m", "choice"):
        np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f)


@pytest.mark.parametrize("points, chunk", [(6, 1), (40, 7), (40, 1000), (40, 1 << 40)])
def test_streamed_join_equals_the_one_shot_join(points, chunk):
    a, b, size = _tables(points)
    min_of = {10: 0, 11: 0}
    # a cap that binds: about half the pairs cannot fit
    cap = int(np.median(a.m) + np.median(b.m))
    whole = _join(a, b, size, cap, min_of, 0, chunk_pairs=1 << 40)
    assert 0 < len(whole.t) < len(a.t) * len(b.t) // size[1]
    _same(_join(a, b, size, cap, min_of, 0, chunk_pairs=chunk), whole)


def test_join_with_nothing_fitting_is_empty():
    a, b, size = _tables(5)
    out = _join(a, b, size, -1, {10: 0, 11: 0}, 0, chunk_pairs=3)
    assert len(out.t) == 0 and out.key.shape == (0, 3) and out.choice.shape == (0, 2)


def test_join_memory_is_bounded_by_the_chunk_not_the_cross_product(monkeypatch):
    monkeypatch.setattr(blocks, "JOIN_CHUNK_PAIRS", 1 << 14)
    a, b, size = _tables(300, seed=1)
    # 12 key groups x 300 x 300 pairs = 1.08 M pairs; the one-shot join holds, per pair, at least
    # its key (3 x int64), time, bytes, choice (2 x int64) and two row indices: 64 bytes
    pairs = len(a.t) * len(b.t) // size[1]
    cross_bytes = pairs * 64
    cap = 1 << 62
    tracemalloc.start()
    out = _join(a, b, size, cap, {10: 0, 11: 0}, 0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert 0 < len(out.t) < pairs
    # a chunk's scratch, ~100 bytes a pair (see JOIN_CHUNK_PAIRS), for the chunk and for the points
    # kept before they are merged (a chunk's worth, or up to twice the last merged set: _join merges
    # geometrically), plus the result and the inputs' copies
    bound = 2 * 128 * blocks.JOIN_CHUNK_PAIRS + 64 * (3 * len(out.t) + len(a.t) + len(b.t))
    assert bound < cross_bytes / 2, "the case must be one where the cross product would not fit the bound"
    assert peak < bound, (peak, bound, cross_bytes)


def _brute_pareto(group, t, m):
    """The definition: a point stays unless another of its group is no slower and no larger, one of
    them strictly, or is the same point earlier; sorted by group, then bytes."""
    keep = [i for i in range(len(t))
            if not any(group[j] == group[i] and t[j] <= t[i] and m[j] <= m[i] and (t[j] < t[i] or m[j] < m[i] or j < i)
                       for j in range(len(t)) if j != i)]
    return np.array(sorted(keep, key=lambda i: (group[i], m[i])), dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_pareto_is_the_definition_with_ties_to_the_first(seed):
    rng = np.random.default_rng(seed)
    n = 120
    group = rng.integers(0, 4, n)
    t = rng.integers(0, 8, n) * 0.25 - (0.5 if seed % 2 else 0.0)     # exact floats: many equal times
    # seed >= 4: bytes too large to pack under the group (the dense-rank fallback)
    m = rng.integers(0, 6, n).astype(np.int64) * (1 << (60 if seed >= 4 else 20))
    np.testing.assert_array_equal(blocks._pareto(group, t, m), _brute_pareto(group, t, m))


def _tied_factor(rng, scope: list[int], size: dict, points: int, elim_node: int) -> _Table:
    """Like _factor, with times and bytes on coarse grids so that sums tie exactly across keys."""
    keys = np.array(np.meshgrid(*[np.arange(size[v]) for v in scope], indexing="ij")).reshape(len(scope), -1).T
    rows = np.repeat(keys, points, axis=0)
    m = rng.integers(0, 6, len(rows)).astype(np.int64) * 512
    t = rng.integers(0, 6, len(rows)) * 0.125
    return _Table(scope, rows, t, m, [elim_node], rng.integers(0, 7, size=(len(t), 1)), {elim_node})


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 40])
@pytest.mark.parametrize("drop", [1, 0, 2])
def test_join_exact_equals_the_join_then_the_elimination_prune(chunk, drop):
    """_join_exact (the eliminated node leaves the key as the pairs form) returns exactly what _frontier
    built before: the whole join, then the node's column moved to the choice and the rows pruned per
    the other nodes' key -- the same rows, in the same order, the same tied points kept."""
    rng = np.random.default_rng(drop)
    size = {0: 3, 1: 4, 2: 2}
    a = _tied_factor(rng, [0, 1], size, 5, 10)
    b = _tied_factor(rng, [1, 2] if drop != 0 else [0, 2], size, 4, 11)
    min_of = {10: 0, 11: 0}
    cap = int(np.median(a.m) + np.median(b.m))
    whole = _join(a, b, size, cap, min_of, 0, chunk_pairs=1 << 40)
    j = whole.scope.index(drop)
    rest = [i for i in range(len(whole.scope)) if i != j]
    want = blocks._prune(_Table([whole.scope[i] for i in rest], whole.key[:, rest], whole.t, whole.m,
                                whole.elim + [drop], np.column_stack([whole.choice, whole.key[:, j]]),
                                whole.placed), size)
    got = block_graph._join_exact(a, b, size, cap, min_of, 0, drop, chunk)
    assert 0 < len(got.t) < len(whole.t)
    _same(got, want)


@pytest.mark.parametrize("chunk", [3, 64, 1 << 40])
def test_exact_join_equals_the_row_table_join(chunk):
    """_join without a limit runs _join_exact (row indices, pairs screened against the kept points);
    with a limit no table reaches it runs the row-table loop that _coarsen needs: the same rows, in
    the same order, ties to the same pairs."""
    rng = np.random.default_rng(7)
    size = {0: 3, 1: 4, 2: 2}
    a = _tied_factor(rng, [0, 1], size, 5, 10)
    b = _tied_factor(rng, [1, 2], size, 4, 11)
    cap = int(np.median(a.m) + np.median(b.m))
    rows = _join(a, b, size, cap, {10: 0, 11: 0}, 0, chunk_pairs=chunk, limit=1 << 40)
    assert 0 < len(rows.t)
    _same(_join(a, b, size, cap, {10: 0, 11: 0}, 0, chunk_pairs=chunk), rows)


@pytest.mark.parametrize("chunk", [2, 64, 1 << 40])
def test_shifted_staircase_join_equals_the_row_table_join(chunk):
    """A factor with one row per key joined with a staircase over part of its key (_join_exact's
    sort-free path): pairs whose time the shift rounds onto the previous pair's are beaten, as in the
    row-table join; the cap cuts each row's tail."""
    size = {0: 3, 1: 4}
    keys = np.array(np.meshgrid(np.arange(3), np.arange(4), indexing="ij")).reshape(2, -1).T
    a = _Table([0, 1], keys, 1.0 + np.arange(12) * 0.5, np.arange(12, dtype=np.int64) * 512, [], None, {10})
    # per key of node 1: bytes up, time down, by steps that vanish next to a's times (1e-17 + 1.0 == 1.0)
    b = _Table([1], np.repeat(np.arange(4), 4)[:, None], np.tile([2.0, 1e-16, 1e-17, 0.0], 4),
               np.tile(np.arange(4, dtype=np.int64) * 1024, 4), [11], np.arange(16)[:, None], {11})
    assert block_graph._staircases(np.repeat(np.arange(4), 4), b.t, b.m)
    cap = 2048 + 11 * 512 - 1536          # the last rows of a lose their largest pairs
    rows = _join(a, b, size, cap, {10: 0, 11: 0}, 0, chunk_pairs=chunk, limit=1 << 40)
    assert len(a.t) < len(rows.t) < 4 * len(a.t) - len(a.t)       # ties and the cap both dropped pairs
    _same(_join(a, b, size, cap, {10: 0, 11: 0}, 0, chunk_pairs=chunk), rows)
