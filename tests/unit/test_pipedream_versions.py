"""PipeDream's stashed weight versions counted as the executor holds them (executor.pipedream):
DISTINCT versions that in-flight microbatches' forwards used, other than the live one, for any
number of microbatches m and depth p, not the steady state's p - i - 1 (PipeDream §3.3).

The oracle is a tiny event replay written here, apart from the simulator: it walks the passes the
simulator ran (read off its trace, in time order) with version OBJECTS and the executor's rules:
an update after every backward; a forward takes the live version; an update replaces the live
version (out of place) only when an in-flight microbatch holds it; a backward lets its version go
when no other in-flight microbatch holds it."""
from __future__ import annotations

import pytest

import costs.static
from simulator import simulate
from simulator.analytic import estimate
from simulator.memory import CATEGORIES, STASHED
from simulator.stash_peak import max_stashed_versions, stashed_version_counts

from tests.unit.simulator.test_simulator import hardware, model, plan

CASES = [(p, m) for p in range(2, 6) for m in range(1, 3 * p + 1)]


def replay(passes: list[tuple[str, int]]) -> list[int]:
    """Stashed versions held during each pass of ``passes`` ((kind, microbatch) in run order)."""
    live = object()
    used: dict[int, object] = {}  # in-flight microbatch -> the version object its forward took
    counts = []
    for kind, k in passes:
        if kind == "F":
            used[k] = live
        counts.append(len({id(v) for v in used.values() if v is not live}))
        if kind == "B":
            del used[k]
            live = object()  # the update; in place when no one holds the old one: either way a new version
    return counts


def simulated(p: int, m: int):
    """(model, plan, its simulation) of a toy PipeDream pipeline with one stage per position."""
    mdl = model(layers=2 * p)
    pl = plan("pipedream_async", p, m, mdl=mdl)
    return mdl, pl, simulate(pl, mdl, hardware(p))


def passes_and_stash(trace: dict, pid: int) -> tuple[list[tuple[str, int]], list[int]]:
    """Device ``pid``'s compute passes in time order and the STASHED bytes at each one's middle."""
    slices = sorted((e["ts"], e["dur"], e["name"]) for e in trace["traceEvents"]
                    if e.get("ph") == "X" and e["pid"] == pid and e["name"][:2] in ("F ", "B "))
    series = sorted((e["ts"], e["args"]["bytes"]) for e in trace["traceEvents"]
                    if e.get("ph") == "C" and e["pid"] == pid and e["name"] == CATEGORIES[STASHED])
    passes, stash = [], []
    for ts, dur, name in slices:
        assert dur > 0
        kind, _, mb = name.split()
        passes.append((kind, int(mb[2:])))
        mid = ts + dur / 2
        stash.append(next((b for t, b in reversed(series) if t <= mid), 0))
    return passes, stash


@pytest.mark.parametrize("p,m", CASES)
def test_simulated_stash_counts_distinct_versions(p, m):
    mdl, pl, sim = simulated(p, m)
    for i, stage in enumerate(pl.stages):
        weights = costs.static.stage_static(mdl, pl, stage)[0].parameters_bytes
        passes, stash = passes_and_stash(sim.trace, stage.devices[0])
        assert len(passes) == 2 * m
        want = replay(passes)
        assert [b // weights for b in stash] == want, (p, m, i)
        assert all(b % weights == 0 for b in stash)
        assert stashed_version_counts(p, m, i) == want  # the closed form's count, pass by pass
        assert max_stashed_versions(p, m, i) == max(want)


@pytest.mark.parametrize("p,m", CASES)
def test_closed_form_peak_equals_the_simulator(p, m):
    mdl, pl, sim = simulated(p, m)
    ana = estimate(pl, mdl, hardware(p))
    assert [d.peak_bytes for d in sim.result.devices] == [d.peak_bytes for d in ana.devices]
    assert ([d.breakdown.stashed_weights_bytes for d in sim.result.devices]
            == [d.breakdown.stashed_weights_bytes for d in ana.devices])


def test_few_microbatches_stash_fewer_than_the_steady_state():
    # p = 4, m = 4: stage 0's four warm-up forwards share version 0; after backward 0's update
    # microbatches 1-3 still hold it and no forward follows: one stashed version, not p - i - 1 = 3
    assert [max_stashed_versions(4, 4, i) for i in range(4)] == [1, 2, 1, 0]
    # the steady state's p - i - 1 from m = 2(p - i) - 2 on (and 1 for a stage with 2 in flight)
    for p in range(2, 7):
        for i in range(p):
            w = p - i
            for m in range(1, 6 * p):
                full = max(w - 1, 0)
                assert (max_stashed_versions(p, m, i) == full) == (m >= max(2 * w - 2, 2) or full == 0), (p, i, m)


def test_capped_walk_equals_the_whole_walk():
    # max_stashed_versions walks min(m, 4p) passes: the same as every pass of a long iteration
    for p in range(2, 6):
        for i in range(p):
            assert max_stashed_versions(p, 40 * p, i) == max(stashed_version_counts(p, 40 * p, i))
