"""The mapping's host-uplink term (planners/mpress/mapping.py ``host_bytes``, issue 24): what a
stage cannot place in peer memory leaves over the PCIe uplink it shares with the other GPUs behind
its switch, so heavy stages must not share a switch. Closed forms: a switch's one-way time is the
bytes of its stages over ``host.pcie_gbps``; the best pairing of the per-stage loads into the
switches' pairs minimises the largest pair sum."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from planners.mpress.mapping import search_mapping
from specs.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[3] / "conf"
GIB = float(1 << 30)


def load(name: str) -> HardwareSpec:
    return HardwareSpec.model_validate(OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{name}.yaml"),
                                                              resolve=True))


DGX1 = load("dgx1")
# every stage over capacity (GPT-15.4B on the DGX-1: no spare memory anywhere), heavy first
LOADS = [35 * GIB, 27 * GIB, 22 * GIB, 18 * GIB, 14 * GIB, 9 * GIB, 5 * GIB, 5 * GIB]


def switch_of(hw: HardwareSpec, device: int) -> int:
    return device // hw.host.gpus_per_pcie_switch


def pair_sums(hw: HardwareSpec, device_of_stage, loads) -> dict[int, float]:
    out: dict[int, float] = {}
    for s, d in enumerate(device_of_stage):
        out[switch_of(hw, d)] = out.get(switch_of(hw, d), 0.0) + loads[s]
    return out


def best_max_pair_sum(loads) -> float:
    """Brute force over the pairings of 8 stages into 4 pairs (105 of them)."""
    def pairings(items):
        if not items:
            yield []
            return
        a, rest = items[0], items[1:]
        for i, b in enumerate(rest):
            for more in pairings(rest[:i] + rest[i + 1:]):
                yield [(a, b)] + more
    return min(max(loads[a] + loads[b] for a, b in p) for p in pairings(list(range(len(loads)))))


def test_without_spare_the_search_pairs_heavy_stages_with_light_ones_behind_a_switch():
    ident = search_mapping(DGX1, range(8), [0.0] * 8, [0.0] * 8, host_bytes=LOADS, mode="identity")
    best = search_mapping(DGX1, range(8), [0.0] * 8, [0.0] * 8, host_bytes=LOADS)
    assert best.candidates == 40320 and best.exact
    # the identity puts stages 0 and 1 behind switch 0: 62 GiB one way
    assert max(ident.host_time_s) == pytest.approx((LOADS[0] + LOADS[1]) / (DGX1.host.pcie_gbps * 1e9))
    # the search reaches the best pairing's largest pair sum (brute force over pairings)
    worst = max(pair_sums(DGX1, best.device_of_stage, LOADS).values())
    assert worst == pytest.approx(best_max_pair_sum(LOADS))
    assert max(best.host_time_s) == pytest.approx(worst / (DGX1.host.pcie_gbps * 1e9))
    assert worst < LOADS[0] + LOADS[1]


def test_host_time_is_each_switchs_bytes_over_the_uplink():
    devices = (0, 2, 4, 6, 7, 5, 3, 1)
    m = search_mapping(DGX1, devices, [0.0] * 8, [0.0] * 8, host_bytes=LOADS, mode="identity")
    sums = pair_sums(DGX1, devices, LOADS)
    for s, d in enumerate(devices):
        assert m.host_time_s[s] == pytest.approx(sums[switch_of(DGX1, d)] / (DGX1.host.pcie_gbps * 1e9))


def test_placed_demand_leaves_the_host_uplink():
    # stage 0 (device 0) demands 8 GiB, stage 1 (device 4: two NVLinks) has 6 GiB spare
    m = search_mapping(DGX1, (0, 4), [8 * GIB, 0.0], [0.0, 6 * GIB], host_bytes=[0.0, 0.0], mode="identity")
    assert m.placed_bytes[0] == pytest.approx(6 * GIB)
    # devices 0 and 4 sit behind different switches: stage 0 sends only its unplaced 2 GiB
    assert m.host_time_s[0] == pytest.approx(2 * GIB / (DGX1.host.pcie_gbps * 1e9))
    assert m.host_time_s[1] == 0.0


def test_symmetric_nvswitch_still_skips_the_search():
    # MPress §III-C: on symmetric connections the search is skipped (DGX-2: Fig. 9, no mapping gain)
    hw = load("dgx2")
    m = search_mapping(hw, range(8), [0.0] * 8, [0.0] * 8, host_bytes=LOADS)
    assert m.device_of_stage == tuple(range(8)) and m.candidates == 1


def test_unplaced_demand_counts_on_the_host_uplink():
    # 32 GiB of demand, 24 GiB of spare: 8 GiB leave over PCIe whatever the mapping
    demand, spare = [8 * GIB] * 4 + [0.0] * 4, [0.0] * 4 + [6 * GIB] * 4
    assert search_mapping(DGX1, range(8), demand, spare).host_time_s == ()  # no host term asked
    m = search_mapping(DGX1, range(8), demand, spare, host_bytes=[0.0] * 8)
    bps = DGX1.host.pcie_gbps * 1e9
    unplaced = [demand[s] - m.placed_bytes[s] for s in range(8)]
    sums = pair_sums(DGX1, m.device_of_stage, unplaced)
    assert max(m.host_time_s) == pytest.approx(max(sums.values()) / bps)
    assert sum(unplaced) == pytest.approx(sum(demand) - sum(spare))


def test_bad_host_bytes_name_the_argument():
    with pytest.raises(ValueError, match="host_bytes"):
        search_mapping(DGX1, (0, 1), [GIB, 0], [0, GIB], host_bytes=[1.0])
    with pytest.raises(ValueError, match="host_bytes"):
        search_mapping(DGX1, (0, 1), [GIB, 0], [0, GIB], host_bytes=[1.0, float("nan")])


def test_same_inputs_same_mapping():
    args = (DGX1, range(8), [0.0] * 8, [0.0] * 8)
    assert search_mapping(*args, host_bytes=LOADS) == search_mapping(*args, host_bytes=LOADS)
    assert len(set(itertools.chain(search_mapping(*args, host_bytes=LOADS).device_of_stage))) == 8
