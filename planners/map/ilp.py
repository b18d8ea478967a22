"""MAP's intra-op parallelism ILP (MAP §5.1, eq. 1), generic and pure.

Every node picks one sharding strategy; the objective is the sum of the chosen strategies' costs
(compute + intra-op communication, C_n + B_n) plus, per edge, the layout-conversion cost R from the
producer's strategy to the consumer's; the bytes the chosen strategies keep must fit the budget:

    min  sum_n S_n^T c_n + sum_(u,v) S_u^T R_uv S_v      s.t.  sum_n S_n^T M_n <= budget    (eq. 1)

The quadratic edge term is linearised with one variable per strategy pair, e_ij, tied to the
one-hot node vectors by the *marginal* (transportation) constraints

    sum_j e_ij = s_u,i      sum_i e_ij = s_v,j      e >= 0

rather than the textbook ``e_ij >= s_i + s_j - 1``. Why: with binary s they force e = s_u s_v^T
exactly (whatever the sign of R), they are k_u + k_v rows per edge instead of k_u * k_v, and their
LP relaxation is the local marginal polytope, which is integral on a tree (Wainwright & Jordan 2008,
§4.1) -- a transformer's op graph is a chain with residual shortcuts, so the relaxation is nearly
integral and HiGHS closes the few fractional nodes the single budget row leaves in a few branches.
The product form's relaxation is weak (s = 1/2 everywhere puts every e at 0) and needs heavy
branching; benchmarks/map_solve_time.py times both (GPT-3 2.7B-class graph, 10 s limit: the product
form hits the limit even at a loose budget with a 73% gap, the marginal form solves it in 1.2 s).
One of the k_v column rows per edge is dropped (it follows from the others and the one-hot rows):
the redundancy made the simplex degenerate (LP at a binding budget 11.6 s -> 4.6 s).
The LP relaxation is first solved without the budget row: when it is integral and fits, it is the
optimum (loose budgets: no branch and bound at all).

Exact reductions before the solve (none can change the optimum or the feasibility):
* parallel edges between the same two nodes are summed into one matrix;
* a strategy is dropped when another of the same node is no worse in cost, in memory and in every
  incident edge's row/column (ties keep the lower index): any solution using it can swap to the
  dominating one without costing time or bytes; pruning repeats until nothing changes, since a
  neighbour's pruning shortens the rows compared;
* a node left with one strategy is fixed: its edges fold into its neighbours' costs, its cost and
  bytes become constants.

When the problem carries ``blocks`` (a chain of layers), :func:`solve` hands it to the exact block DP
of planners/map/blocks.py instead (the problem types and reductions both use live in
planners/map/problem.py): one budget row over 32 repeated layers is where branch and bound
stalls (GPT-3 2.7B-class graph at a binding 20 GiB: 67% gap after 10 s), while a DP over Pareto sets
of (time, bytes) per boundary state prices the repeated layer once and proves the optimum in < 0.5 s.
solve dispatches by itself, not the callers, so MAP §5.3's integrate (which calls solve up to 11
times per budget) gets it without a change.

Memory is additive over nodes, so the smallest achievable memory is the sum of per-node minima:
an infeasible budget is reported with that minimum (no second solve). Deterministic: same input,
same choice (single-threaded HiGHS, fixed options; the reductions keep the lowest index on ties).
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from planners.map.blocks import solve_blocks
from planners.map.problem import IlpProblem, IlpSolution, Reduced, evaluate, min_memory_choice


def solve(problem: IlpProblem, time_limit_s: float = 60.0, mip_rel_gap: float = 0.0,
          formulation: str = "marginal", method: str = "auto") -> IlpSolution:
    """Solve eq. (1). ``method``: "auto" (the block DP when ``problem.blocks`` is given, else the
    ILP), "ilp" or "blocks"; the block DP is exact and ignores the time limit, gap and formulation.
    ``formulation``: "marginal" (default, see the module doc) or "product" (e_ij >= s_i + s_j - 1,
    only for non-negative edge costs; kept to compare). Returns the choice per node in original
    strategy indices, its time (s) and bytes recomputed exactly from the input."""
    if method not in ("auto", "ilp", "blocks"):
        raise ValueError(f"method {method!r}: 'auto', 'ilp' or 'blocks'")
    if method == "blocks" or (method == "auto" and problem.blocks is not None):
        return solve_blocks(problem)
    min_choice = min_memory_choice(problem)
    min_mem = evaluate(problem, min_choice)[1]
    if min_mem > problem.budget_bytes:
        t, m = evaluate(problem, min_choice)
        return IlpSolution(min_choice, t, m, "infeasible", min_mem)

    red = Reduced(problem)
    free = [n for n in range(len(problem.nodes)) if n not in red.fixed]
    choice_pos = {n: 0 for n in red.fixed}
    status, bound = "optimal", None
    if free:
        fixed_mem = sum(int(red.mem[n][0]) for n in red.fixed)
        rhs = problem.budget_bytes - fixed_mem
        over = 0
        # Fast path: the LP relaxation without the budget row (about 4x faster than with it: the
        # dense row makes the simplex degenerate). Integral and within budget -> the optimum.
        pos, st, bound = _solve_reduced(red, free, None, time_limit_s, mip_rel_gap, formulation, relax=True)
        if pos is None or sum(int(red.mem[n][pos[n]]) for n in free) > rhs:
            pos = None
        for _ in range(0 if pos is not None else 4):   # retry tighter if HiGHS's tolerance let bytes slip over
            pos, st, bound = _solve_reduced(red, free, rhs, time_limit_s, mip_rel_gap, formulation)
            if pos is None:
                break
            over = sum(int(red.mem[n][pos[n]]) for n in free) - (problem.budget_bytes - fixed_mem)
            if over <= 0:
                break
            rhs -= over
        if pos is None or over > 0:      # no incumbent in time: the min-memory choice is feasible
            choice = min_choice
            status = "time_limit"
        else:
            choice_pos.update(pos)
            status = st
            choice = tuple(int(red.keep[n][choice_pos[n]]) for n in range(len(problem.nodes)))
        if bound is not None:
            bound += sum(float(red.cost[n][0]) for n in red.fixed)   # fixed nodes carry their folded edges
    else:
        choice = tuple(int(red.keep[n][0]) for n in range(len(problem.nodes)))
    t, m = evaluate(problem, choice)
    return IlpSolution(choice, t, m, status, min_mem, t if status == "optimal" else bound)


def _solve_reduced(red: Reduced, free: list[int], rhs_bytes: int | None, time_limit_s: float, gap: float,
                   formulation: str, relax: bool = False) -> tuple[dict[int, int] | None, str, float | None]:
    """One HiGHS call on the reduced problem; ``rhs_bytes`` None: no budget row; ``relax``: the LP
    relaxation, returned only when its one-hot part is integral. Returns (position per free node,
    status, lower bound on the reduced objective in seconds)."""
    col = {}                      # node -> first column of its one-hot block
    c: list[np.ndarray] = []
    ncol = 0
    for n in free:
        col[n] = ncol
        c.append(red.cost[n])
        ncol += len(red.cost[n])
    n_bin = ncol
    rows, cols, vals, lb, ub = [], [], [], [], []
    r = 0

    def row(cs, vs, lo, hi):
        nonlocal r
        rows.extend([r] * len(cs)); cols.extend(cs); vals.extend(vs); lb.append(lo); ub.append(hi)
        r += 1

    for n in free:                                        # one strategy per node
        k = len(red.cost[n])
        row(range(col[n], col[n] + k), [1.0] * k, 1.0, 1.0)
    for (u, v), R in sorted(red.edges.items()):
        ku, kv = R.shape
        if formulation == "marginal":
            base = ncol
            c.append(R.ravel())
            ncol += ku * kv
            for i in range(ku):                           # sum_j e_ij = s_u,i
                row([base + i * kv + j for j in range(kv)] + [col[u] + i], [1.0] * kv + [-1.0], 0.0, 0.0)
            for j in range(kv - 1):                       # sum_i e_ij = s_v,j; the last follows from the others
                row([base + i * kv + j for i in range(ku)] + [col[v] + j], [1.0] * ku + [-1.0], 0.0, 0.0)
        elif formulation == "product":
            if (R < 0).any():
                raise ValueError("the product linearisation needs non-negative edge costs")
            for i, j in zip(*np.nonzero(R > 0)):          # zero-cost pairs need no variable
                c.append(R[i:i + 1, j])
                row([ncol, col[u] + i, col[v] + j], [1.0, -1.0, -1.0], -1.0, np.inf)
                ncol += 1
        else:
            raise ValueError(f"formulation {formulation!r}: 'marginal' or 'product'")
    # Memory row, shifted by each node's minimum (better scaled) and dropped when it cannot bind.
    mins = {n: int(red.mem[n].min()) for n in free}
    slack = rhs_bytes - sum(mins.values()) if rhs_bytes is not None else 0
    extra = sum(int(red.mem[n].max()) - mins[n] for n in free)
    if rhs_bytes is not None and extra > slack:
        scale = float(max(slack, 1))
        cs, vs = [], []
        for n in free:
            d = (red.mem[n] - mins[n]).astype(float) / scale
            nz = np.nonzero(d)[0]
            cs.extend(col[n] + nz); vs.extend(d[nz])
        row(cs, vs, -np.inf, slack / scale)
    cost = np.concatenate(c)
    # Objective scaled so its largest coefficient is 1e3: HiGHS's absolute tolerances (dual
    # feasibility 1e-7, MIP absolute gap 1e-6) then sit far below any cost difference that matters.
    peak = float(np.abs(cost).max()) if cost.size else 0.0
    cost = cost * (1e3 / peak) if peak > 0 else cost
    integrality = np.zeros(ncol)
    integrality[:n_bin] = 0 if relax else 1
    A = coo_matrix((vals, (rows, cols)), shape=(r, ncol)).tocsr()
    res = milp(cost, integrality=integrality, bounds=Bounds(0.0, 1.0),
               constraints=LinearConstraint(A, lb, ub),
               options={"presolve": True, "time_limit": time_limit_s, "mip_rel_gap": gap, "disp": False})
    unscale = peak / 1e3 if peak > 0 else 1.0
    if res.x is None:
        return None, "time_limit", None
    if relax and (res.status != 0 or np.abs(res.x[:n_bin] - np.round(res.x[:n_bin])).max() > 1e-9):
        return None, "fractional", None
    pos = {n: int(np.argmax(res.x[col[n]:col[n] + len(red.cost[n])])) for n in free}
    bound = res.fun if relax else getattr(res, "mip_dual_bound", None)
    return pos, ("optimal" if res.status == 0 else "time_limit"), (None if bound is None else float(bound) * unscale)
