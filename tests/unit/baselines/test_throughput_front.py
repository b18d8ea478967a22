"""The throughput planner's exact DP (planners/baselines/throughput.py): its staircase _prune keeps
exactly the entries the pairwise dominance definition keeps, and the DP's front (built with the
per-count fit memo and the clamped-entry filter) equals a brute force over every contiguous
placement on small inputs."""
from __future__ import annotations

import random

import pytest

from planners.baselines.stage_place import Placed
from planners.baselines.stagetable import StageTable
from planners.baselines.throughput import _degrees, _prune, candidates
from specs import HardwareSpec
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, LOCAL_CPU
from tests.unit.auto.auto_cases import spec


def _pairwise(front: list[tuple]) -> list[tuple]:
    """The definition: in (sum, max, sync, count) order, keep an entry unless a kept one has max,
    sync and count all ≤ its own."""
    front = sorted(front, key=lambda e: e[:4])
    kept: list[tuple] = []
    for e in front:
        if not any(k[1] <= e[1] and k[2] <= e[2] and k[3] <= e[3] for k in kept):
            kept.append(e)
    return kept


@pytest.mark.parametrize("seed", range(4))
def test_staircase_prune_keeps_what_the_pairwise_definition_keeps(seed):
    rnd = random.Random(seed)
    for _ in range(400):
        q = rnd.choice((2, 5, 1000))  # few distinct values: ties in every coordinate
        front = [(rnd.randint(0, q) / q, rnd.randint(0, q) / q, rnd.randint(0, q) / q, n, tuple(range(n)))
                 for n in (rnd.randint(1, 5) for _ in range(rnd.randint(0, 50)))]
        assert _prune(list(front)) == _pairwise(front)


def _placements(table: StageTable) -> list[tuple[Placed, ...]]:
    """Every contiguous split of the layers onto consecutive device groups (degrees as the DP's)."""
    L, k, total = table.model.num_layers, table.hardware.devices_per_node, table.hardware.num_devices
    out = []

    def rec(layer, gpu, acc):
        if layer == L or gpu == total:
            if layer == L and gpu == total:
                out.append(tuple(acc))
            return
        for stop in range(layer + 1, L + 1):
            for d in _degrees(k):
                if d > k - gpu % k:
                    break
                for par in ("pp",) if d == 1 else ("dp", "tp"):
                    rec(stop, gpu + d, acc + [Placed(layer, stop, par, d, gpu)])
    rec(0, 0, [])
    return out


@pytest.mark.parametrize("devices,capacity_mib", [(2, None), (4, None), (4, 2.0)])
def test_exact_front_matches_brute_force(devices, capacity_mib):
    """Each plan the DP returns is undominated among all placements that fit, and each undominated
    (sum, max, sync, count) point is reached by one of them."""
    hw = HardwareSpec.model_validate({**LOCAL_CPU.model_dump(), "nodes": 1, "devices_per_node": devices})
    model = spec("gpt_tiny", CPU_TRAINING)
    table = StageTable(model, hw, CPU_TRAINING, ScheduleSpec(kind="1f1b"))
    cap = float("inf") if capacity_mib is None else capacity_mib * (1 << 20)

    def point(stages):
        costs = [table.cost(p) for p in stages]
        if any(c is None for c in costs):
            return None
        n = len(stages)
        if any(table.peak_bytes(c, n - 1 - i) > cap for i, c in enumerate(costs)):
            return None
        link = sum(table.p2p_s(a, Placed(b.start, b.start + 1, "pp", 1, b.gpu), c.out_bytes)
                   for a, b, c in zip(stages, stages[1:], costs))
        return (sum(c.work_s for c in costs) + link, max(c.work_s for c in costs), max(c.sync_s for c in costs), n)

    pts = {s: point(s) for s in _placements(table)}
    pts = {s: p for s, p in pts.items() if p is not None}
    assert pts
    # the DP adds the same floats in another association order than point(): sums tied in exact
    # arithmetic may differ in the last bits, and either order's winner is then legitimate
    tol = 1e-12

    def close(a, b):
        return abs(a - b) <= tol * max(1.0, abs(a))

    def weakly_better(q, p):  # q ≤ p in max, sync and count (up to rounding)
        return q[1] <= p[1] + tol and q[2] <= p[2] + tol and q[3] <= p[3]

    got_pts = [pts[tuple(s)] for s in candidates(table, cap)]
    assert got_pts
    for p in got_pts:  # sound: nothing beats a returned plan by more than rounding in the sum
        assert not any(q[0] < p[0] - tol and weakly_better(q, p) for q in pts.values()), p
    front = [p for p in pts.values()
             if not any(q != p and q[0] <= p[0] + tol and weakly_better(q, p) for q in pts.values())]
    assert front
    for p in front:  # complete: every undominated point is reached
        assert any(all(close(a, b) for a, b in zip(p, g)) for g in got_pts), p
