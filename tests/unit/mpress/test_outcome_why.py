"""planners/mpress/outcome.py: what mpress.json and the terminal say agrees with the plan: every
layer's reason names its action, a layer on every n-th microbatch says so in words, an identity
mapping is called identity, an optimizer swap's reason does not claim layers compacted that keep.
The planner runs in-process on the paper's presets (no mocks)."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks.mpress_eval import compose_case
from planners.mpress.assign import ordinal
from planners.mpress.outcome import (is_identity, period_text, report, summary_lines,
                                     why_conflicts)
from planners.mpress.planner import mpress_search


def _search(name: str, **policy):
    case = compose_case(name)
    cfg = case.cfg
    return mpress_search(cfg.policy.model_copy(update=policy), case.model, cfg.hardware, cfg.training, cfg.schedule)


@pytest.fixture(scope="module")
def gpt_10b3():  # D2D with a searched mapping, one layer on every 2nd microbatch (2026-11 tree)
    return _search("mpress_gpt_10b3_dgx1")


@pytest.fixture(scope="module")
def gpt_15b4():  # optimizer swaps on stages whose layers partly keep
    return _search("mpress_gpt_15b4_dgx1")


@pytest.fixture(scope="module")
def gpt_15b4_identity():  # Fig. 9's default: DAPPLE's mapping (issue 24: D2D engages, mapping searched, since)
    return _search("mpress_gpt_15b4_dgx1", mapping="identity", striping="none")


def test_ordinals():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]
    assert period_text(1) == "every microbatch" and period_text(3) == "every 3rd microbatch"


@pytest.mark.parametrize("which", ["gpt_10b3", "gpt_15b4"])
def test_mpress_json_agrees_with_its_own_reasons(which, request):
    outcome = request.getfixturevalue(which)
    doc = report(outcome)
    assert doc["why_conflicts"] == [] == why_conflicts(outcome)
    for s, layers in doc["stages"].items():
        stage = outcome.plan.stages[int(s)]
        for c in layers:
            item = stage.action_of(c["layer"])
            assert c["action"] == item.action.value and c["why"].startswith(c["action"] + ":")
            assert c["microbatch_period"] == item.microbatch_period
            assert c["applies_to"] == ("" if c["action"] == "keep" else period_text(item.microbatch_period))
    assert doc["mapping"]["identity"] == (doc["mapping"]["device_of_stage"] == list(range(len(outcome.plan.stages))))
    for s, why in doc["optimizer_swap"].items():
        stage = outcome.plan.stages[int(s)]
        assert stage.offload.optimizer_swap
        kept = [l for l in stage.layers if stage.action_of(l).action.value == "keep"]
        if kept:
            assert f"layers {','.join(map(str, kept))} went back to keep" in why or f"layer {kept[0]} went" in why


def test_terminal_lines_say_identity_and_the_period_in_words(gpt_10b3, gpt_15b4, gpt_15b4_identity):
    for outcome in (gpt_10b3, gpt_15b4, gpt_15b4_identity):
        lines = summary_lines(outcome)
        mapping_line = next(ln for ln in lines if ln.startswith("  device mapping: "))
        assert ("identity" in mapping_line) == is_identity(outcome.mapping)
        periodic = [c for c in outcome.choices if c.action != "keep" and c.microbatch_period > 1]
        for c in periodic:
            assert any(f"{c.layer} ({period_text(c.microbatch_period)})" in ln for ln in lines)
        assert not any("th microbatch" in ln and ("2th" in ln or "3th" in ln) for ln in lines)
    assert is_identity(gpt_15b4_identity.mapping)
    # whatever the planner picks today, a layer on every 3rd microbatch is printed so
    some = next(c for c in gpt_15b4.choices if c.action != "keep")
    third = dataclasses.replace(some, microbatch_period=3)
    lines = summary_lines(dataclasses.replace(gpt_15b4, choices=tuple(third if c is some else c
                                                                      for c in gpt_15b4.choices)))
    assert any(f"{some.layer} (every 3rd microbatch)" in ln for ln in lines)


def test_why_conflicts_finds_a_reason_that_names_another_technique(gpt_10b3):
    """The checker is not vacuous: a D2D layer given a CPU-swap reason, or a reason with another
    microbatch period, is reported."""
    d2d = next(c for c in gpt_10b3.choices if c.action == "d2d_swap")
    wrong = dataclasses.replace(d2d, why="cpu_swap: round trip 2 x 129.33 ms over PCIe hides in its live 2457.7 ms")
    bad = dataclasses.replace(gpt_10b3, choices=tuple(wrong if c is d2d else c for c in gpt_10b3.choices))
    found = why_conflicts(bad)
    assert any("names another technique" in x for x in found) and any("over PCIe" in x for x in found)
    lying = dataclasses.replace(d2d, why=d2d.why.split(";")[0] + "; every 5th microbatch")
    bad = dataclasses.replace(gpt_10b3, choices=tuple(lying if c is d2d else c for c in gpt_10b3.choices))
    assert any("every 5" in x for x in why_conflicts(bad))
