"""rotor's chain and operation semantics (MAP §5.2, Tables 1-2; Herrmann et al. 2019): the
chain's per-stage quantities, a checkpoint segment tree, the sequence it stands for and the live
bytes of walking a sequence op by op. A cost model: the simulator prices a planned checkpoint tree
with it and the planner's DP (planners.map.rotor) is checked against it. Pure: no I/O, no torch.

Operations (MAP Table 1), each costing u_f + u_fcomm (forward) or u_b + u_bcomm (backward) seconds:

* F_all^l keeps its input and stores a-bar^l (everything its backward needs, a^l included);
* F_ck^l  keeps its input and stores a^l only (the first forward of a checkpointed segment);
* F_none^l frees its input a^{l-1} and stores a^l (the other forwards of a segment);
* B^l needs delta^l, a-bar^l and a^{l-1}; it frees delta^l and a-bar^l (and a^{l-1} when that was a
  checkpoint, not part of a-bar^{l-1}) and leaves delta^{l-1}. delta^{L-1} appears when the loss is
  taken, right before B^{L-1}.
A forward's peak is what is live plus its output plus o_f + o_fcomm; a backward's is what is live
plus delta^{l-1} plus o_b + o_bcomm (MAP Table 2 adds the communication buffers to rotor's o_f/o_b).
"""
from __future__ import annotations

from dataclasses import dataclass

INF = float("inf")


@dataclass(frozen=True)
class Chain:
    """Per stage l (tuples of length L): times (s) u_f, u_b, u_fcomm, u_bcomm; bytes w_a (a^l),
    w_abar (a-bar^l, what F_all keeps, >= w_a), w_delta (delta^l), and the temporaries o_f, o_b,
    o_fcomm, o_bcomm. ``w_input``: bytes of the chain's input a^{-1}; ``w_delta_input``: bytes of
    delta^{-1} (0 when the input needs no gradient); ``fixed_bytes``: bytes live throughout
    (parameters, gradients, optimizer state of the chosen strategies)."""

    u_f: tuple[float, ...]
    u_b: tuple[float, ...]
    u_fcomm: tuple[float, ...]
    u_bcomm: tuple[float, ...]
    w_a: tuple[int, ...]
    w_abar: tuple[int, ...]
    w_delta: tuple[int, ...]
    o_f: tuple[int, ...]
    o_b: tuple[int, ...]
    o_fcomm: tuple[int, ...]
    o_bcomm: tuple[int, ...]
    w_input: int = 0
    w_delta_input: int = 0
    fixed_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.u_f)
        fields = ("u_b", "u_fcomm", "u_bcomm", "w_a", "w_abar", "w_delta", "o_f", "o_b", "o_fcomm", "o_bcomm")
        if n == 0 or any(len(getattr(self, f)) != n for f in fields):
            raise ValueError(f"chain: every per-stage tuple needs the same length >= 1 (u_f has {n})")
        if any(b < a for a, b in zip(self.w_a, self.w_abar)):
            raise ValueError("chain: w_abar (everything F_all keeps) includes a^l, so w_abar >= w_a")

    def __len__(self) -> int:
        return len(self.u_f)

    def t_fwd(self, l: int) -> float:
        return self.u_f[l] + self.u_fcomm[l]

    def t_bwd(self, l: int) -> float:
        return self.u_b[l] + self.u_bcomm[l]

    def delta_in(self, l: int) -> int:
        """Bytes of delta^{l-1}, what B^l leaves."""
        return self.w_delta[l - 1] if l > 0 else self.w_delta_input


@dataclass(frozen=True)
class Segment:
    """Stages [start, stop). ``checkpointed``: run under torch.utils.checkpoint (only the input is
    saved); ``children`` then cover [start, stop) and say how the recomputation itself is split
    (nested checkpoints, realised by nesting torch.utils.checkpoint calls)."""

    start: int
    stop: int
    checkpointed: bool
    children: tuple["Segment", ...] = ()


def simulate_peak(chain: Chain, sequence: tuple[tuple[str, int], ...]) -> int:
    """Peak live bytes of ``sequence`` by Table 1, walked op by op (independent of the DP). Raises
    ValueError when an op's inputs are not live."""
    return max((peak for _, peak in walk(chain, sequence)), default=chain.fixed_bytes + chain.w_input)


def walk(chain: Chain, sequence: tuple[tuple[str, int], ...],
         held: tuple[tuple[int, int, int], ...] = ()) -> list[tuple[int, int]]:
    """Per op of ``sequence``: (live bytes after it, peak bytes during it), both including the fixed
    bytes and the chain's input (Table 1). Raises ValueError when an op's inputs are not live.

    ``held``: (reader, owner, bytes) per parameter gradient that outlives its own backward: a tied
    copy read by stage ``reader`` of a parameter stored by an earlier stage ``owner`` (a GPT head
    tied to the word embedding). Autograd keeps the reader's gradient (brought to the owner's
    layout) in the owner's input buffer from B^reader until B^owner adds its own (issue 26,
    measured with executor.memtrack): live after B^reader, through B^owner's peak, freed after it.
    Not part of Table 1 (the DP does not see it; the simulator adds it, the planner re-plans on
    the simulated peak)."""
    live: dict[tuple[str, int], int] = {}
    opened = {r: (o, b) for r, o, b in held}
    closing = {o: r for r, o, _ in held}
    base = chain.fixed_bytes + chain.w_input
    out = []

    def has_input(l: int) -> bool:
        return l == 0 or ("a", l - 1) in live or ("abar", l - 1) in live

    for op, l in sequence:
        cur = base + sum(live.values())
        peak = cur
        if op in ("F_all", "F_ck", "F_none"):
            if not has_input(l):
                raise ValueError(f"{op}^{l}: a^{l - 1} is not live")
            size = chain.w_abar[l] if op == "F_all" else chain.w_a[l]
            peak = max(peak, cur + size + chain.o_f[l] + chain.o_fcomm[l])
            if op == "F_none" and l > 0:
                live.pop(("a", l - 1), None)
            live[("abar", l) if op == "F_all" else ("a", l)] = size
            if op == "F_all":
                live.pop(("a", l), None)
        elif op == "B":
            if l == len(chain) - 1 and ("delta", l) not in live:
                live[("delta", l)] = chain.w_delta[l]        # the loss's gradient
                cur += chain.w_delta[l]
                peak = max(peak, cur)
            if ("delta", l) not in live or ("abar", l) not in live or not has_input(l):
                raise ValueError(f"B^{l}: needs delta^{l}, a-bar^{l} and a^{l - 1} live")
            peak = max(peak, cur + chain.delta_in(l) + chain.o_b[l] + chain.o_bcomm[l])
            del live[("delta", l)], live[("abar", l)]
            live.pop(("a", l - 1), None)
            live[("delta", l - 1)] = chain.delta_in(l)
            if l in opened:
                live[("held", l)] = opened[l][1]
            if l in closing:
                live.pop(("held", closing[l]), None)
        else:
            raise ValueError(f"unknown op {op!r}")
        after = base + sum(live.values())
        out.append((after, max(peak, after)))
    return out


def sequence_of(segments: tuple[Segment, ...] | list[Segment], length: int) -> tuple[tuple[str, int], ...]:
    """The op sequence a segment tree runs (the inverse of the DP's backtrack): a stored segment
    runs F_all per stage, the rest, then B per stage in reverse; a checkpointed one F_ck, F_none...,
    the rest, then its recomputation as its ``children`` say (none: recompute storing everything).
    An empty tree stores everything. Segments must tile 0..length-1."""
    segs = list(segments) or [Segment(0, length, False)]

    def run(items: list[Segment]) -> list[tuple[str, int]]:
        if not items:
            return []
        g, rest = items[0], items[1:]
        if not g.checkpointed:
            return ([("F_all", l) for l in range(g.start, g.stop)] + run(rest)
                    + [("B", l) for l in reversed(range(g.start, g.stop))])
        fwd = [("F_ck", g.start)] + [("F_none", l) for l in range(g.start + 1, g.stop)]
        return fwd + run(rest) + run(list(g.children) or [Segment(g.start, g.stop, False)])

    at = 0
    for g in segs:
        if g.start != at:
            raise ValueError(f"segments must tile 0..{length - 1}: [{g.start}, {g.stop}) starts at {g.start}, not {at}")
        at = g.stop
    if at != length:
        raise ValueError(f"segments end at {at}, the chain has {length} stages")
    return tuple(run(segs))
