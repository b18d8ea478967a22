"""policy.find: the two questions users ask after "how fast?", answered with the same search
(issue 23):

* ``fewest_nodes``: the fewest nodes of this hardware on which some plan trains the model within
  the capacity. Node counts double from one until a search fits, then bisect between the last
  failure and the first fit. Bisection assumes that more nodes never hurt the fit, which holds for
  the search itself (a plan on n nodes, idle devices left over, is a plan on n + 1), though the
  planners pick their layouts by speed; the counts tried are reported.
* ``largest_model``: the largest model of this family (``policy.scale``: more layers, or a wider
  hidden size in steps of 64 × heads, as the family's presets grow) that trains on this hardware.
  Sizes double from the configured one until a search fails, then bisect.

Each probe runs the fastest-plan search (auto_search) without MPress's improve rounds: those take
only candidates that already fit and make them faster (search._improve), so a probe's verdict (fits
or not) is the same without them, and on long models they are most of a search (a 384-layer BERT:
62 of 73 s). The answer's size is then searched whole, improve rounds included; that outcome is
returned, with the probes in its notes. ``grow(size) -> ModelSpec`` comes from the shell (it builds model specs
from configs), so this module stays pure.
"""
from __future__ import annotations

import time

from collections.abc import Callable

from planners.auto.report import size_text
from planners.auto.search import AutoOutcome, auto_search
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec


def with_nodes(hardware: HardwareSpec, nodes: int) -> HardwareSpec:
    return HardwareSpec.model_validate({**hardware.model_dump(), "nodes": nodes})


def _frontier(probe: Callable[[int], AutoOutcome | None], start: int, limit: int, grow_fits: bool
              ) -> tuple[int | None, AutoOutcome | None, list[str]]:
    """Doubling then bisection over sizes from ``start`` up to ``limit``: the smallest size that fits
    (``grow_fits``: fewest nodes) or the largest that fits (largest model). Returns (size, its
    outcome, one note per probe)."""
    notes: list[str] = []
    cache: dict[int, AutoOutcome | None] = {}

    def fits(n: int) -> bool:
        if n not in cache:
            cache[n] = probe(n)
            out = cache[n]
            notes.append(f"{n}: " + ("cannot be built" if out is None else
                                     f"fits, {out.winner.time_s:.3f} s per iteration (before improve rounds)"
                                     if out.fits else
                                     f"does not fit (closest peak {size_text(out.winner.peak)})"))
        return cache[n] is not None and cache[n].fits

    lo, hi = None, None  # lo: a size on the failing side, hi: on the fitting side (fewest nodes)
    n = start
    while n <= limit:
        ok = fits(n)
        if ok == grow_fits:  # fewest nodes: found a fit; largest model: found a failure
            hi = n
            break
        lo = n
        n *= 2
    if grow_fits:
        if hi is None:
            return None, None, notes
        hi = _split(lo if lo is not None else hi - 1, hi, fits)[1]  # fits(hi), not fits(lo)
        return hi, cache[hi], notes
    if lo is None:  # the configured size already fails
        return None, cache.get(start), notes
    lo = _split(lo, hi if hi is not None else limit + 1, fits)[0]  # fits(lo), not fits(upper)
    return lo, cache[lo], notes


def _split(a: int, b: int, fits: Callable[[int], bool]) -> tuple[int, int]:
    """Bisection between sizes ``a`` and ``b`` on opposite sides of the fit (``fits(b)`` is never
    asked, nor ``fits(a)`` when a + 1 = b): the adjacent pair where the answer changes."""
    while b - a > 1:
        mid = (a + b) // 2
        if fits(mid) == fits(a):
            a = mid
        else:
            b = mid
    return a, b


def _verdict(out: AutoOutcome, yes: str, no: str) -> str:
    return f"{yes} ({out.winner.result.samples_per_s:.4g} samples/s)" if out.fits else no


def find(policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
         profile=None, progress=None, phase=None,
         grow: tuple[int, Callable[[int], ModelSpec]] | None = None) -> AutoOutcome:
    """``policy.find``'s answer (module doc); ``fastest`` is auto_search itself. ``grow``: (the
    configured size in policy.scale's units, size -> model spec), for largest_model."""
    if policy.find == "fastest":
        return auto_search(policy, model, hardware, training, schedule, profile, progress, phase)
    say = phase or (lambda name, s: None)
    # the probes leave out the singles that need the shell's per-model inputs (CAPTURE's profile,
    # MAP's operator graphs: planning.PROBE_SKIPS); the joint search and the other singles run
    quiet = policy.model_copy(update={"singles": [s for s in policy.singles if s not in ("capture", "map")]})
    probing = quiet.model_copy(update={"improve_layouts": 0})  # the verdict without the rounds (module doc)
    if policy.find == "fewest_nodes":
        def probe(n: int) -> AutoOutcome | None:
            try:
                hw = with_nodes(hardware, n)
            except ValueError:
                return None  # a one-node spec without inter_node links cannot grow
            start = time.perf_counter()
            out = auto_search(probing, model, hw, training, schedule, None, progress, None)
            say(f"fewest_nodes: {n} node(s) {_verdict(out, 'fit', 'do not fit')}", time.perf_counter() - start)
            return out

        size, outcome, notes = _frontier(probe, 1, policy.max_nodes, grow_fits=True)
        what = (f"fewest nodes: {size} (of {hardware.devices_per_node} devices each)" if size is not None else
                f"no node count up to policy.max_nodes={policy.max_nodes} fits")
    else:
        if grow is None:
            raise ValueError("policy.find=largest_model needs the shell's model builder")
        start, build = grow

        def probe(n: int) -> AutoOutcome | None:
            try:
                m = build(n)
            except ValueError:
                return None
            start = time.perf_counter()
            out = auto_search(probing, m, hardware, training, schedule, None, progress, None)
            say(f"largest_model: {policy.scale}={n} {_verdict(out, 'fits', 'does not fit')}",
                time.perf_counter() - start)
            return out

        size, outcome, notes = _frontier(probe, start, start * 64, grow_fits=False)
        unit = "layers" if policy.scale == "layers" else "x 64·heads hidden"
        what = (f"largest model: {size} {unit} ({outcome.model.name}, {outcome.model.total_params:,} "
                f"parameters)" if size is not None else
                f"the configured model ({start} {unit}) already does not fit")
    if outcome is None:  # nothing could be probed: the configured inputs' own search, reported as such
        outcome = auto_search(quiet, model, hardware, training, schedule, None, progress, phase)
    elif outcome.fits and policy.improve_layouts:  # the answer's size searched whole (module doc)
        t0 = time.perf_counter()
        outcome = auto_search(quiet, outcome.model, outcome.hardware, training, schedule, None, progress, None)
        say(f"{policy.find}: the answer's search with MPress's improve rounds", time.perf_counter() - t0)
    outcome.notes += [what] + [f"probe {n}" for n in notes]
    outcome.find_answer = what
    return outcome

