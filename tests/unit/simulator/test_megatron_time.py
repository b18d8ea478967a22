"""The time model against published Megatron-LM iteration times on Selene (issue #11's goal:
median |error| <= 5 %, max <= 10 %): Narayanan et al. SC'21 Table 1 and Korthikanti et al. 2022's
full-recompute baselines, through the analytic estimate (the simulator agrees with it, see
test_time_model.py). Nothing was fitted on these rows (docs/validation.md); this guards the model
against regressions. The numbers are printed by benchmarks/validate_megatron.py."""
from __future__ import annotations

import statistics

import pytest

from benchmarks.validate_megatron import KORTHIKANTI, TABLE1, build, korthikanti_rows, published_time_s
from simulator.analytic import iteration_time_s


def _errors() -> list[float]:
    errs = []
    for r in TABLE1:
        model, hw, plan = build(r, 1, 1, 16)
        errs.append(iteration_time_s(plan, model, hw) / published_time_s(*r[1:4], r[6], r[7], r[8]) - 1)
    for name, heads, hidden, layers, tp, pp, gpus, batch, mb, v, pub in KORTHIKANTI:
        model, hw, plan = build((name, heads, hidden, layers, tp, pp, gpus, batch, 0), mb, v, 18)
        errs.append(iteration_time_s(plan, model, hw) / pub - 1)
    return errs


def test_published_megatron_runs_within_the_goal():
    errs = [abs(e) for e in _errors()]
    assert statistics.median(errs) <= 0.05, errs
    assert max(errs) <= 0.10, errs


@pytest.fixture(scope="module")
def korthikanti_times():
    """{name: (published full s, published SP + selective s, predicted full s, predicted SP + selective s)}."""
    full = {n: iteration_time_s(p, m, h) for n, _, _, (m, h, p) in korthikanti_rows("full", False)}
    return {n: (pub_full, pub_sel, full[n], iteration_time_s(p, m, h))
            for n, pub_full, pub_sel, (m, h, p) in korthikanti_rows("selective", True)}


def test_korthikanti_sequence_parallel_selective_rows_within_the_goal(korthikanti_times):
    """Korthikanti et al. 2022 Table 5 "present work" (policy.sequence_parallel=true,
    policy.recompute=selective): issue 27's goal, median |error| <= 5 %, max <= 10 %."""
    errs = [abs(sel / pub_sel - 1) for _, pub_sel, _, sel in korthikanti_times.values()]
    assert statistics.median(errs) <= 0.05, errs
    assert max(errs) <= 0.10, errs


# 530B misses by 0.1 point (memwall +3.1 with Megatron's blocking p2p, +3.6 without):
# docs/validation.md ("Speed-ups"). It was within the goal (+1.5) only while the simulator sent the
# whole s·b·h over a sequence-parallel boundary instead of Megatron's s/t; a strict xfail, so the
# row is re-examined when the model changes.
MISSES = {"530B": "SP + selective 29.7 % faster published, memwall 32.8 % (docs/validation.md)"}


@pytest.mark.parametrize("name", [pytest.param(row[0], marks=pytest.mark.xfail(strict=True, reason=MISSES[row[0]]))
                                  if row[0] in MISSES else row[0] for row in KORTHIKANTI])
def test_korthikanti_speedup_over_full_recompute_within_3_points(korthikanti_times, name):
    """The throughput gain of SP + selective over full recompute (full / seqsel - 1) is the
    paper's within 3 percentage points (Table 5: 29-32 %)."""
    pub_full, pub_sel, full, sel = korthikanti_times[name]
    published, predicted = pub_full / pub_sel - 1, full / sel - 1
    assert abs(predicted - published) <= 0.03, (name, published, predicted)


def test_korthikanti_table4_per_layer_times():
    """Korthikanti et al. 2022 Table 4 (one 22B layer; nothing in memwall was fitted on it): every
    variant's combined forward + backward within 5 % of the published ms (measured: +1.6, +4.3,
    +0.6, 0.0, +2.5 %), and the overheads over no recompute ordered as published (full recompute
    far above selective, which is above no recompute; SP + selective at most selective alone)."""
    from benchmarks.validate_megatron import table4_rows

    rows = {(rec, sp): (sum(pub), sum(got)) for rec, sp, pub, got in table4_rows()}
    for key, (pub, got) in rows.items():
        assert abs(got / pub - 1) <= 0.05, (key, pub, got)
    none, full = rows[("none", False)][1], rows[("full", False)][1]
    sel, both = rows[("selective", False)][1], rows[("selective", True)][1]
    assert full / none - 1 > 0.3 and 0 < sel / none - 1 < 0.1 and both <= sel


def test_korthikanti_figure8_overheads_and_the_530b_dp8_run():
    """§6.2 on Figure 8 (530B, 1T: present work 2 %, full recompute 36 % per layer; 22B from Table 4:
    4 %, 39 %): memwall's per-layer overheads within 2 points (measured 0.5 ... 1.6); §6.3's 530B at
    8-way data parallelism, 39.15 s, within 5 % (measured -1.4 %) and slower than at dp 1."""
    from benchmarks.validate_megatron import (FIGURE8_OVERHEAD_PCT, KORTHIKANTI_530B_DP8_S, dp8_530b,
                                              layer_overheads)

    for name, (pub_sel, pub_full) in FIGURE8_OVERHEAD_PCT.items():
        sel, full = layer_overheads(name)
        assert abs(sel - pub_sel) <= 2 and abs(full - pub_full) <= 2, (name, sel, full)
    dp8, dp1 = dp8_530b()
    assert abs(dp8 / KORTHIKANTI_530B_DP8_S - 1) <= 0.05 and dp8 > dp1
