"""``policy.recompute=null`` (conf/policy's default for even, balanced and manual): the recompute a
Megatron or torchtitan user would pick by hand, chosen by the memory model instead.

No recompute when the plan fits: that is the fastest plan, and the plan is then byte for byte the
one ``policy.recompute=none`` gives. Otherwise every setting memwall can express on the same
layout is priced, and the fastest that fits wins (a tie goes to the one priced first, the one with
less recompute work):

* ``selective``: the attention core only (Korthikanti et al. 2022 §5);
* ``op_sac``: torchtitan's op-level selective AC (LLaMA blocks, a user model's profiled layers);
* ``full`` on the first N blocks of each stage (Megatron's ``--recompute-method block
  --recompute-num-layers N``), the smallest N that fits: each block recomputed adds its forward
  to the backward, so the smallest fitting N is the fastest of them (Korthikanti §5 and Table 4:
  full recompute's overhead is per block);
* ``full``: every block (``--recompute-granularity full``).

Peaks are the analytic memory model's (``planners.verdict.peaks``, the same closed forms the
verdict and the simulator's memory follow); times are the analytic estimator's
(``simulator.analytic.iteration_time_s``). When nothing fits, the lowest peak is returned and the
verdict says so. Pure: the shell prints :attr:`Choice.note`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from planners.layout import PlanningError
from planners.verdict import peaks
from simulator.analytic import iteration_time_s
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, PlanError
from specs.units import size_text

#: the settings tried when ``policy.recompute`` is null, in order of the recompute work they add
LADDER = ("none", "selective", "op_sac", "full")


@dataclass(frozen=True)
class Tried:
    what: str            # the setting in words ("none", "full on the first 2 blocks of each stage")
    update: dict         # the policy fields it sets
    peak_bytes: int      # highest per-device peak (analytic)
    time_s: float        # analytic iteration time
    fits: bool
    policy: object       # the policy it was planned with
    plan: Plan


@dataclass(frozen=True)
class Choice:
    policy: object                 # the policy with recompute (and recompute_num_layers) resolved
    plan: Plan
    tried: tuple[Tried, ...]       # every setting priced, in the order priced (LADDER's, then full's N)
    note: str                      # what was chosen and what else was priced; "" when no recompute was needed


def needs_choice(policy) -> bool:
    """True for an even/balanced/manual policy whose ``recompute`` is null."""
    return getattr(policy, "kind", None) in ("even", "balanced", "manual") and policy.recompute is None


def choose_recompute(policy, model: ModelSpec, hardware: HardwareSpec,
                     make: Callable[[object], Plan]) -> Choice:
    """Resolve ``policy.recompute=null``. ``make(policy) -> Plan`` runs the planner (validated).

    With ``recompute_num_layers`` or ``recompute_every`` set, null means full (those knobs pick
    which blocks a full recompute covers). A setting the planner refuses for this model (selective
    without an attention core, op_sac off LLaMA or at cp > 1) is skipped; the planner's error for
    ``none`` is the user's and is raised."""
    if policy.recompute_num_layers is not None or policy.recompute_every is not None:
        resolved = policy.model_copy(update={"recompute": "full"})
        return Choice(resolved, make(resolved), (), "")
    capacity = hardware.device.memory_bytes
    tried: list[Tried] = []

    def price(what: str, update: dict) -> Tried | None:
        pol = policy.model_copy(update=update)
        try:
            plan = make(pol)
        except (PlanningError, PlanError):
            if update["recompute"] == "none":
                raise
            return None  # a setting this model or layout cannot take: not a candidate
        top = max(peaks(plan, model, hardware).values())
        t = Tried(what, update, top, iteration_time_s(plan, model, hardware), top <= capacity, pol, plan)
        tried.append(t)
        return t

    base = price("none", {"recompute": "none"})
    if base.fits:
        return Choice(base.policy, base.plan, tuple(tried), "")
    price("selective", {"recompute": "selective"})
    price("op_sac", {"recompute": "op_sac"})
    full = price("full", {"recompute": "full"})
    if full is not None and full.fits:
        _fewest_blocks(full.plan, price)
    fitting = [i for i, t in enumerate(tried) if t.fits]
    if fitting:  # fastest, then the earlier setting (less recompute work) on a tie
        best = min(fitting, key=lambda i: (tried[i].time_s, i))
    else:
        best = min(range(len(tried)), key=lambda i: (tried[i].peak_bytes, i))
    return Choice(tried[best].policy, tried[best].plan, tuple(tried), _note(tried, best, capacity))


def _fewest_blocks(full_plan: Plan, price) -> None:
    """Price ``full`` on the first N blocks of each stage for the smallest N that fits, by
    bisection over 1 .. (most blocks on a stage) − 1 (fewer blocks recomputed hold more: each
    block kept holds its whole activations instead of its input). Full recompute's plan has one
    memory action per block, so its stages count the blocks."""
    most = max(len(s.memory) for s in full_plan.stages)
    lo, hi = 1, most - 1
    while lo <= hi:  # every N priced goes into ``tried``; the caller picks the fastest that fits
        n = (lo + hi) // 2
        words = f"full on the first {n} blocks of each stage" if n > 1 else "full on the first block of each stage"
        t = price(words, {"recompute": "full", "recompute_num_layers": n})
        if t is not None and t.fits:
            hi = n - 1
        else:
            lo = n + 1


def _ladder_order(t: Tried) -> tuple[int, int]:
    """LADDER's order, full on the first N blocks (by N) before full on every block."""
    return LADDER.index(t.update["recompute"]), t.update.get("recompute_num_layers", 1 << 30)


def _note(tried: list[Tried], best: int, capacity: int) -> str:
    chosen = tried[best]
    flag = "policy.recompute=" + chosen.update["recompute"] + (
        f" policy.recompute_num_layers={chosen.update['recompute_num_layers']}"
        if "recompute_num_layers" in chosen.update else "")
    head = (f"policy.recompute=null: without recompute the peak is {size_text(tried[0].peak_bytes, 1)}, over the "
            f"{size_text(capacity, 1)} of device memory; ")
    if not chosen.fits:
        every = "; ".join(f"{t.what} {size_text(t.peak_bytes, 1)}" for t in sorted(tried[1:], key=_ladder_order))
        return (head + f"no recompute setting fits ({every}); the plan below takes the lowest peak, {chosen.what} "
                f"({flag})")
    others = "; ".join(f"{t.what} {size_text(t.peak_bytes, 1)}" + (f" {t.time_s:.3f} s" if t.fits else " over")
                       for t in sorted((t for i, t in enumerate(tried) if i not in (0, best)), key=_ladder_order))
    return (head + f"chose {chosen.what} ({flag}): {size_text(chosen.peak_bytes, 1)}, {chosen.time_s:.3f} s per "
            f"iteration (analytic), the fastest that fits" + (f" (also priced: {others})" if others else "")
            + "; set policy.recompute to pin one")


__all__ = ["Choice", "LADDER", "Tried", "choose_recompute", "needs_choice"]
