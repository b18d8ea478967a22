"""planners/map/blocks.py's factor join streamed (issue 26: on gpt_tiny with a 2x2x2 mesh at 0.9x
the free peak, one join formed the whole cross product of two Pareto factors and allocated > 1 GiB).

Checked: the streamed join returns exactly the rows of the one-shot join (same keys, times, bytes
and eliminated choices, in the same order), and its allocation peak (tracemalloc, which numpy's
allocations report to) stays a small fraction of what the cross product alone takes."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from planners.map import blocks
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
