"""rotor's table C(s, t, m) (MAP §5.2.1, Theorem 5.1, eqs. 3-6) computed once per *distinct* sub-chain.

planners.map.rotor states the recursion; this module evaluates it fast enough for a chain of 500
identical layers (issue 22). Two exact devices, neither changes a single value of the table:

1. Repeated sub-chains share one row. C(s, t, .) reads only the stages s..t (their times, their
   slot-rounded bytes, delta^{s-1} through B^s's peak) and delta^t (or nothing when t is the last
   stage): eqs. 3-6 mention nothing else. So two ranges whose stages agree value for value have the
   same row and the same choice, and a chain of L identical layers (plus its embedding and head)
   has about 4L distinct ranges instead of L^2 / 2 (each range is named by a trie over per-stage
   type ids, built a column at a time: O(L^2) numpy work, a dictionary step per distinct range).
   A chain whose strategies alternate keeps more distinct ranges and costs more, never a different
   answer.
2. Eq. 5's minimum over the checkpoint position s' is one numpy reduction over a (t-s) x (S+1)
   array instead of a Python loop; the sums are formed in the same order as the loop formed them
   (the forward time of F_ck^s F_none^{s+1..s'-1} as a running sum, then + C(s', t, m - a^{s'-1}),
   then + C(s, s'-1, m)), and ties resolve as the loop resolved them (F_all first, then the earliest
   s': argmin's first index among the strict improvements), so times and choices are bit-identical.

Feasibility alone (:meth:`Table.threshold`) is the same recursion on the smallest feasible slot
count M(s, t) instead of the whole row (C(s, t, m) is finite exactly for M(s, t) <= m <= S, since
every term is gated by lower bounds on m): max of the gates for one choice, min over the choices.
It decides an infeasible budget without building rows, and is what min_feasible_budget bisects on.
tests/unit/planners/map_scale checks the rows, the choices and the thresholds against the plain loop.
"""
from __future__ import annotations

import numpy as np

INF = float("inf")


class Structure:
    """The chain's distinct ranges: ``key[s, t]`` a range id (equal ids: equal stages), ``reps`` one
    (row, s, t) per id a solve reads, ordered by length, so every range a row reads was computed
    before it. ``every`` > 1 allows checkpoints a^{s'-1} only at s' = every, 2 every, ... (see
    planners.map.rotor._run); the rows then exist for the ranges ending where a checkpoint may
    start the next one (t = s' - 1) or at the chain's end, the only ones the recursion reads."""

    def __init__(self, chain, every: int = 1) -> None:
        L = len(chain)
        self.chain, self.L, self.every = chain, L, every
        self.allowed = np.asarray([l > 0 and l % every == 0 for l in range(L)])   # s' = l may be chosen
        self.G = [chain.w_delta[t] if t < L - 1 else 0 for t in range(L)]   # delta^t live unless t is last
        self.of = [chain.o_f[l] + chain.o_fcomm[l] for l in range(L)]
        self.bwd = [chain.w_abar[l] + chain.w_delta[l] + chain.delta_in(l) + chain.o_b[l] + chain.o_bcomm[l]
                    for l in range(L)]
        self.tf = [chain.t_fwd(l) for l in range(L)]
        self.tb = [chain.t_bwd(l) for l in range(L)]
        types: dict[tuple, int] = {}
        typ = [types.setdefault((chain.w_a[l], chain.w_abar[l], self.of[l], self.bwd[l], self.tf[l], self.tb[l],
                                 self.G[l], bool(self.allowed[l])), len(types)) for l in range(L)]
        # range ids column by column: key[s, t] = id of (key[s, t-1], type of t); only the distinct
        # (previous id, type) pairs of a column reach the dictionary (about 4 per column for a chain
        # of identical layers)
        trie: dict[int, int] = {}
        key = np.full((L, L), -1, dtype=np.int64)
        rep_of: dict[int, tuple[int, int]] = {}
        ntyp = len(types)
        for t in range(L):
            prev = np.append(key[:t, t - 1], -1) if t else np.array([-1], dtype=np.int64)
            codes = (prev + 1) * ntyp + typ[t]
            uniq, first, inv = np.unique(codes, return_index=True, return_inverse=True)
            ids = np.empty(len(uniq), dtype=np.int64)
            ends = t == L - 1 or bool(self.allowed[t + 1])
            for i, (c, s) in enumerate(zip(uniq.tolist(), first.tolist())):
                got = trie.get(c)
                if got is None:
                    got = trie[c] = len(trie)
                if ends and got not in rep_of:
                    rep_of[got] = (s, t)
                ids[i] = got
            key[:t + 1, t] = ids[inv.ravel()]
        # rows: one per id a solve reads, numbered by length; key maps (s, t) to its row (-1: none)
        ids = sorted(rep_of, key=lambda i: rep_of[i][1] - rep_of[i][0])
        row = np.full(len(trie), -1, dtype=np.int64)
        row[ids] = np.arange(len(ids))
        self.key = np.where(key >= 0, row[np.maximum(key, 0)], -1)
        self.reps = [(r, *rep_of[i]) for r, i in enumerate(ids)]
        w_a = np.asarray([int(x) for x in chain.w_a], dtype=np.int64)
        # per j: the bytes F_none^j holds with its input (a^{j-1} + a^j + temporaries); j = s: F_ck^s's
        self.pair = np.asarray([int(w_a[j - 1] + w_a[j]) + self.of[j] if j else 0 for j in range(L)], dtype=np.int64)
        self.first = np.asarray([int(w_a[j]) + self.of[j] for j in range(L)], dtype=np.int64)
        self.tf_arr = np.asarray(self.tf, dtype=np.float64)

    def work(self, slots: int) -> int:
        """Cells :meth:`Table.build` fills: per row its checkpoint options times (slots + 1)."""
        allowed = np.concatenate(([0], np.cumsum(self.allowed)))
        return sum(int(allowed[t + 1] - allowed[s + 1]) + 1 for _, s, t in self.reps) * (slots + 1)

    def fwd_bytes(self, s: int, t: int) -> np.ndarray:
        """Per s' = s+1..t: the most bytes F_ck^s F_none^{s+1..s'-1} hold at once, delta^t included."""
        own = self.pair[s:t].copy()
        own[0] = self.first[s]
        return np.maximum.accumulate(own) + self.G[t]


class Table:
    """C and W of planners.map.rotor for one budget and slot count (see the module doc)."""

    def __init__(self, st: Structure, budget_bytes: int, slots: int) -> None:
        self.st, self.S, self.B = st, slots, budget_bytes
        chain = st.chain
        biggest = max(st.G) + max(int(st.pair.max()), int(st.first.max()))
        self._exact = biggest * max(slots, 1) >= 1 << 62       # int64 would overflow: Python ints
        self.A = [self.slots(x) for x in chain.w_a]
        self.AB = [self.slots(x) for x in chain.w_abar]
        self.A_arr = np.asarray(self.A, dtype=np.int64)
        self.C: np.ndarray | None = None
        self.W: np.ndarray | None = None

    def slots(self, nbytes: int) -> int:
        """ceil(nbytes * S / B): sizes round up, so accepted sums never exceed the budget."""
        return -(-int(nbytes) * self.S // self.B) if nbytes > 0 else 0

    def _slots_vec(self, nbytes: np.ndarray) -> np.ndarray:
        if self._exact:
            return np.asarray([self.slots(x) for x in nbytes], dtype=np.int64)
        return np.where(nbytes > 0, -((-nbytes * self.S) // self.B), 0)

    def _thr(self, s: int, t: int) -> int:
        st = self.st
        return self.slots(max(st.G[t] + self.st.chain.w_abar[s] + st.of[s], st.bwd[s]))

    def threshold(self) -> int:
        """M(0, L-1): the fewest slots (beside the input and fixed bytes) any sequence needs; S + 1
        when none fits."""
        st, S = self.st, self.S
        M = np.zeros(len(st.reps), dtype=np.int64)
        key = st.key
        for k, s, t in st.reps:
            thr = self._thr(s, t)
            if t == s:
                M[k] = min(thr, S + 1)
                continue
            best = max(thr, self.AB[s] + int(M[key[s + 1, t]]))
            on = st.allowed[s + 1:t + 1]
            if on.any():
                gate = np.maximum(self._slots_vec(st.fwd_bytes(s, t)), self.A_arr[s:t])[on]
                ck = np.maximum(np.maximum(gate, self.A_arr[s:t][on] + M[key[s + 1:t + 1, t][on]]),
                                M[key[s, s:t][on]])
                best = min(best, int(ck.min()))
            M[k] = min(best, S + 1)
        return int(M[key[0, st.L - 1]])

    def build(self) -> None:
        """Every distinct row C(s, t, 0..S) and its choice W (-1: F_all at s; s' - s: checkpoint a^{s'-1})."""
        st, S = self.st, self.S
        n = len(st.reps)
        C = np.empty((n, S + 1))
        W = np.empty((n, S + 1), dtype=np.int32)
        m = np.arange(S + 1)
        key = st.key
        for k, s, t in st.reps:
            thr = self._thr(s, t)
            base = st.tf[s] + st.tb[s]
            if t == s:
                C[k] = np.where(m >= thr, base, INF)
                W[k] = -1
                continue
            best = np.where(m >= max(thr, self.AB[s]), base + self._shift(C[key[s + 1, t]], self.AB[s]), INF)
            choice = np.full(S + 1, -1, dtype=np.int32)
            # eq. 5's checkpoint options, one row per allowed s' in s+1..t
            on = np.nonzero(st.allowed[s + 1:t + 1])[0]
            if len(on) == 0:
                C[k], W[k] = best, choice
                continue
            A = self.A_arr[s:t][on]
            gate = np.maximum(self._slots_vec(st.fwd_bytes(s, t))[on], A)
            rows = C[key[s + 1:t + 1, t][on]]                        # C(s', t, m - a^{s'-1}), shifted by
            val = np.full_like(rows, INF)                            # a^{s'-1} (few distinct sizes)
            for a in (int(A[0]),) if A.min() == A.max() else np.unique(A).tolist():
                if a <= S:
                    sel = slice(None) if A.min() == A.max() else A == a
                    val[sel, a:] = rows[sel, :S + 1 - a]
            val += np.cumsum(st.tf_arr[s:t])[on][:, None]           # u_f^s + ... + u_f^{s'-1}, in order
            val += C[key[s, s:t][on]]                                # then + C(s, s'-1, m)
            np.putmask(val, m[None, :] < gate[:, None], INF)
            at = val.argmin(axis=0)
            low = val[at, m]
            better = low < best
            C[k] = np.where(better, low, best)
            W[k] = np.where(better, on[at] + 1, choice)  # s' - s: rows are shared across s
        self.C, self.W = C, W

    def _shift(self, arr: np.ndarray, k: int) -> np.ndarray:
        out = np.full_like(arr, INF)
        if k <= self.S:
            out[k:] = arr[:len(arr) - k] if k > 0 else arr
        return out

    def value(self, s: int, t: int, m: int) -> float:
        return float(self.C[self.st.key[s, t], m])

    def choice(self, s: int, t: int, m: int) -> int:
        """-1: F_all at s; else s', the checkpoint a^{s'-1}."""
        w = int(self.W[self.st.key[s, t], m])
        return w if w < 0 else s + w
