"""zb_auto's explicit pass orders (``schedule.order``; Qi et al. 2024 §3.1's searched schedule): one
string per pipeline position over F, B, W, the k-th of each letter being microbatch k. Pure
functions on strings, imported by specs.plan (validation) and specs.schedule (the walk)."""
from __future__ import annotations

from collections.abc import Iterator


def listed_order(letters: str, i: int) -> Iterator[tuple[str, int, int]]:
    """A position's explicit order (zb_auto, Qi et al. 2024 §3.1): the k-th F, B, W is microbatch k."""
    seen = {"F": 0, "B": 0, "W": 0}
    for c in letters:
        yield (c, i, seen[c])
        seen[c] += 1


def order_problem(order: list[str], p: int, m: int) -> str | None:
    """What is wrong with an explicit zb_auto order for ``p`` positions and ``m`` microbatches, or
    None: one string per position, m of each of F, B, W, no B before its F nor W before its B, and
    no deadlock under specs.schedule's rules (F(s, k) needs F(s-1, k); B(s, k) needs B(s+1, k), the last
    stage's its own F(s, k); W(s, k) its B(s, k); each position runs its list in order)."""
    if len(order) != p:
        return f"has {len(order)} position strings; the pipeline has {p} positions"
    for i, o in enumerate(order):
        counts = {c: o.count(c) for c in "FBW"}
        if len(o) != 3 * m or any(n != m for n in counts.values()):
            return f"position {i} lists {counts['F']} F, {counts['B']} B, {counts['W']} W; needs {m} of each"
        f = b = w = 0
        for j, c in enumerate(o):
            f, b, w = f + (c == "F"), b + (c == "B"), w + (c == "W")
            if b > f or w > b:
                return f"position {i}, pass {j}: a {'B' if b > f else 'W'} of a microbatch before its {'F' if b > f else 'B'}"
    done = [{"F": 0, "B": 0, "W": 0} for _ in range(p)]  # passes of each kind done per position
    at = [0] * p
    left = 3 * m * p
    while left:
        moved = False
        for i in range(p):
            o, d = order[i], done[i]
            while at[i] < len(o):
                c, k = o[at[i]], d[o[at[i]]]
                ready = ((c == "F" and (i == 0 or done[i - 1]["F"] > k))
                         or (c == "B" and (done[i + 1]["B"] > k if i + 1 < p else d["F"] > k))
                         or (c == "W" and d["B"] > k))
                if not ready:
                    break
                d[c] += 1
                at[i] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [f"{i}: {order[i][at[i]]}{done[i][order[i][at[i]]]}" for i in range(p) if at[i] < len(order[i])]
            return f"deadlocks: every position waits ({', '.join(stuck[:4])})"
    return None
