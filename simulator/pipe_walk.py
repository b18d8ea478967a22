"""Dependency walks of pipeline pass orders (no contention): the estimator's time for orders with no
closed form — the zero-bubble schedules' F/B/W orders (Qi et al. 2024) and interleaved 1F1B with
Megatron-Core's microbatch groups — used by :func:`simulator.analytic.iteration_time_s` and the
zero-bubble order search's inputs. The discrete-event simulator walks the same orders with links
and contention (simulator.walk)."""
from __future__ import annotations

from specs.plan import Plan
from specs.schedule import plan_order


def split_pipe_s(plan: Plan, pass_s: dict[int, tuple[float, float, float]], hop_s: dict[int, float]) -> float:
    """Pipeline time of a zero-bubble order (zb_h1, zbv, dualpipev, zb_auto; and of interleaved 1F1B's
    microbatch groups, :func:`grouped_interleaved_pipe_s`) with no contention: every pass
    starts when the one before it on its position has ended and its input is there: F(s, k) after
    F(s-1, k) + ``hop_s[s-1]``, B(s, k) after B(s+1, k) + ``hop_s[s]`` (the last stage's after its
    own F), W(s, k) after B(s, k). ``pass_s[s]`` = (F, B, W) seconds of stage s. The closed forms
    of Qi et al. 2024 (ZB-H1's bubble (p-1)(F+B-W) for F = B = W) are this walk's uniform case
    (tests/unit/simulator/test_zero_bubble.py). Raises ValueError if the orders deadlock."""
    p, m = plan.pipeline_depth, plan.training.microbatches
    last = len(plan.stages) - 1
    orders = [list(plan_order(plan, i)) for i in range(p)]
    nxt, clock, end = [0] * p, [0.0] * p, {}
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for i in range(p):
            while nxt[i] < len(orders[i]):
                kind, s, k = orders[i][nxt[i]]
                if kind == "F":
                    dep = ("F", s - 1, k) if s > 0 else None
                    hop = hop_s.get(s - 1, 0.0)
                elif kind == "B":
                    dep, hop = (("B", s + 1, k), hop_s.get(s, 0.0)) if s < last else (("F", s, k), 0.0)
                else:
                    dep, hop = ("B", s, k), 0.0
                if dep is not None and dep not in end:
                    break
                start = max(clock[i], end[dep] + hop if dep is not None else 0.0)
                clock[i] = end[(kind, s, k)] = start + pass_s[s]["FBW".index(kind)]
                nxt[i] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"{plan.schedule.kind.value}: the pass orders deadlock (p {p}, m {m})")
    return max(clock)


#: passes past which grouped_interleaved_pipe_s takes the closed form instead of walking
GROUPED_WALK_PASSES = 1_000_000


def grouped_interleaved_pipe_s(plan: Plan, pass_s: dict[int, tuple[float, float, float]], hop_s: dict[int, float],
                               closed_s: float) -> float:
    """Pipeline time of interleaved 1F1B with Megatron-Core's microbatch groups of N != p
    (``schedule.microbatch_group_size``; specs.schedule._interleaved): Narayanan et al.'s closed form
    (m + (p-1)/v)·slowest holds for N = p only, so the passes are walked as :func:`split_pipe_s`
    walks them (each pass after its position's previous one and its input's hop). The walk's time
    grows by the same amount with every full group (its extra bubble is the fill and drain's, set by
    p, v, N and the last group), so past two full groups it walks the last group plus one and two
    full groups and adds the difference once per further group: exact, in O(N·v·p) passes. A walk
    past :data:`GROUPED_WALK_PASSES` passes falls back to ``closed_s``, the N = p form. At N = p
    the walk is within 0.5 % of the closed form (tests/unit/simulator/test_microbatch_group.py)."""
    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    n = plan.schedule.microbatch_group_size
    tail = m - ((m - 1) // n) * n  # the last group's microbatches
    short = min(m, tail + 2 * n)
    if 2 * short * v * p > GROUPED_WALK_PASSES:
        return closed_s

    def walk(count: int) -> float:
        training = plan.training.model_copy(update={"num_microbatches": count, "microbatch_size": None})
        return split_pipe_s(plan.model_copy(update={"training": training}), pass_s, hop_s)

    if m == short:
        return walk(m)
    one, two = walk(tail + n), walk(tail + 2 * n)
    return two + (m - tail - 2 * n) // n * (two - one)
