"""benchmarks/mpress_table_iii.py (printed by mpress_eval.py) Table III: each row's costs come from memwall's cost model (the
planner's LayerFacts on the simulated base pipeline), so changing an input of that model changes
the row by the closed form's amount; the paper's columns are quoted from mpress_paper.py."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks import mpress_table_iii as mpress_eval
from benchmarks import mpress_paper as paper


@pytest.fixture(scope="module")
def gpt():
    case = mpress_eval.compose_case(mpress_eval.TABLE_III_CASES["gpt"])
    facts = mpress_eval.base_facts(case)
    return case, facts, mpress_eval.table_iii_rows(case, facts=facts, per_tensor=False)  # the per-block fallback


def _one_way_s(nbytes: float, bw_gbps: float, latency_s: float) -> float:
    return latency_s + nbytes / (bw_gbps * 1e9)


def test_rows_are_the_papers_tensors_with_its_numbers(gpt):
    case, _, rows = gpt
    assert [r.tensor for r in rows] == ["t4", "t5", "t6"]
    assert [(r.series, r.tensor, *r.paper) for r in rows] == [x for x in paper.TABLE_III if x[0] == "gpt"]
    assert [r.paper_pick for r in rows] == [paper.TABLE_III_PICKS[r.tensor][0] for r in rows]
    assert len({(r.stage, r.layer) for r in rows}) == 3  # three different blocks


def test_costs_are_the_closed_forms_of_the_hardware(gpt):
    case, facts, rows = gpt
    hw = case.cfg.hardware
    nvlink = next(link for link in hw.intra_node.links if link.kind.value == "nvlink")
    share = min(hw.host.gpus_per_pcie_switch, hw.num_devices)
    for r in rows:
        f = facts[(r.stage, r.layer)]
        assert r.size_mb == f.saved_bytes / 1e6 and r.live_ms == f.live_s * 1e3 and r.recompute_ms == f.fwd_s * 1e3
        assert r.cpu_ms == pytest.approx(2e3 * _one_way_s(f.saved_bytes, hw.host.pcie_gbps / share,
                                                          hw.host.pcie_latency_s), rel=1e-12)
        assert r.d2d_ms == pytest.approx(2e3 * _one_way_s(f.saved_bytes, 4 * nvlink.bw_gbps, nvlink.latency_s),
                                         rel=1e-12)
        assert r.pick == paper.table_iii_pick(r.live_ms, r.recompute_ms, r.cpu_ms, r.d2d_ms)[0]


def test_a_changed_input_changes_the_row(gpt):
    case, facts, rows = gpt
    hw = case.cfg.hardware
    faster = hw.model_copy(update={"host": hw.host.model_copy(update={"pcie_gbps": 2 * hw.host.pcie_gbps})})
    case2 = dataclasses.replace(case, cfg=case.cfg.model_copy(update={"hardware": faster}))
    rows2 = mpress_eval.table_iii_rows(case2, per_tensor=False)
    lat_ms = 2e3 * hw.host.pcie_latency_s
    for a, b in zip(rows, rows2):
        assert (b.stage, b.layer, b.size_mb, b.live_ms, b.d2d_ms) == (a.stage, a.layer, a.size_mb, a.live_ms, a.d2d_ms)
        assert b.cpu_ms - lat_ms == pytest.approx((a.cpu_ms - lat_ms) / 2, rel=1e-12)  # twice the PCIe rate
    two = mpress_eval.table_iii_rows(case, nvlinks=2, facts=facts, per_tensor=False)
    for a, b in zip(rows, two):
        assert b.d2d_ms > a.d2d_ms and b.cpu_ms == a.cpu_ms


def test_every_differing_column_has_a_computed_why(gpt):
    _, _, rows = gpt
    for r in rows:
        differ = [c for c, a in r.agree.items() if c != "pick" and not a.startswith("agrees")]
        heads = [w.split(":")[0] for w in r.why]
        want = {"size MB": "size", "live ms": "live", "recompute ms": "recompute", "GPU-CPU swap ms": "GPU-CPU",
                "D2D swap ms": "D2D"}
        assert [want[c] for c in differ] == [h for h in heads if h != "pick"]
        assert ("pick" in heads) == (r.pick != r.paper_pick)
        for w in r.why:
            if w.startswith("GPU-CPU"):  # the rate it quotes is the row's own
                assert f"ours moves {2 * r.size_mb / r.cpu_ms:.1f} GB/s" in w


def test_per_tensor_rows_are_saved_tensors_with_their_own_facts(gpt):
    # MPress §III-D / Table III: where the model lists its blocks' saved tensors, a row is one tensor
    case, facts, _ = gpt
    if not any(f.tensors for f in facts.values()):
        pytest.skip("the GPT closed form lists no saved tensors")
    hw = case.cfg.hardware
    share = min(hw.host.gpus_per_pcie_switch, hw.num_devices)
    rows = mpress_eval.table_iii_rows(case, facts=facts)
    assert [r.tensor for r in rows] == ["t4", "t5", "t6"]
    for r in rows:
        f = facts[(r.stage, r.layer)]
        t = next(t for t in f.tensors if t.name == r.tensor_name)
        assert r.size_mb == t.nbytes / 1e6 and r.live_ms == t.live_s * 1e3 and r.recompute_ms == f.fwd_s * 1e3
        assert t.live_s >= f.live_s  # a tensor lives at least its block's forward-end -> backward-start
        assert r.cpu_ms == pytest.approx(2e3 * _one_way_s(t.nbytes, hw.host.pcie_gbps / share,
                                                          hw.host.pcie_latency_s), rel=1e-12)
