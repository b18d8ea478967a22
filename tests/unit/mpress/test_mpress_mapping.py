"""MPress stage->device mapping for D2D swap (MPress §III-C, Fig. 6): closed forms for striping and
spare sharing, exactness against a plainly written brute force, symmetry, scale, determinism."""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from planners.mpress.mapping import Mapping, search_mapping
from specs.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[3] / "conf"
GIB = float(1 << 30)
MIB = float(1 << 20)


def load(name: str, **over) -> HardwareSpec:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{name}.yaml"), resolve=True)
    return HardwareSpec.model_validate({**cfg, **over})


def two_dgx1_mesh() -> HardwareSpec:
    """16 GPUs in one node: two DGX-1 hybrid cube meshes (0-7, 8-15), GPU i joined to i+8 by one NVLink."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / "dgx1.yaml"), resolve=True)
    links = cfg["intra_node"]["links"]
    links = (links + [{**ln, "a": ln["a"] + 8, "b": ln["b"] + 8} for ln in links]
             + [{**links[0], "a": i, "b": i + 8, "count": 1} for i in range(8)])
    return HardwareSpec.model_validate({**cfg, "name": "dgx1x2", "devices_per_node": 16,
                                        "intra_node": {**cfg["intra_node"], "links": links}})


DGX1 = load("dgx1")
# The MPress situation: early stages are heavy (1F1B keeps p - i microbatches in flight on stage i),
# late stages have spare memory.
HEAVY = [8 * GIB] * 4 + [0.0] * 4
LIGHT = [0.0] * 4 + [6 * GIB] * 4
BOUNDARY = [64 * MIB] * 7


def key(m: Mapping) -> tuple:
    return (-round(sum(m.placed_bytes) / MIB), round(max(m.swap_time_s) * 1e9), round(m.boundary_time_s * 1e9))


# ---- a plain reference of the documented model: loops, dicts, bisection for the stripe split ----

def reference_key(hw, dev_of_stage, demand, spare, boundary, striping):
    p = len(dev_of_stage)
    src = [i for i in range(p) if demand[i] > 0]
    tgt = [j for j in range(p) if spare[j] > 0]

    def bw(i, j):
        a, b = dev_of_stage[i], dev_of_stage[j]
        return hw.link(a, b).total_bw_gbps if i != j and hw.is_peer(a, b) else 0.0

    weight = {}
    if striping == "none":  # one target: fastest, then most unclaimed spare, then lowest stage
        unclaimed = {j: spare[j] for j in tgt}
        for i in src:
            peers = [j for j in tgt if bw(i, j) > 0]
            if peers:
                j = min(peers, key=lambda j: (-bw(i, j), -unclaimed[j], j))
                weight[i, j] = 1.0
                unclaimed[j] -= min(demand[i], unclaimed[j])
    else:
        for i in src:
            for j in tgt:
                if bw(i, j) > 0:
                    weight[i, j] = bw(i, j) if striping == "weighted" else 1.0
    need = {i: demand[i] for i in src}
    left = {j: spare[j] for j in tgt}
    x = {ij: 0.0 for ij in weight}
    active = set(src)
    for _ in range(len(src) + 1):
        offer = {}
        for j in tgt:
            nbrs = [i for i in active if (i, j) in weight]
            total_bw = sum(bw(i, j) for i in nbrs)
            for i in nbrs:
                offer[i, j] = left[j] * bw(i, j) / total_bw
        for i in sorted(active):
            mine = {j: o for (a, j), o in offer.items() if a == i}
            if sum(mine.values()) <= need[i]:
                take = mine
            else:  # sum_j min(offer_j, lam * w_j) = need, by bisection
                lo, hi = 0.0, max(o / weight[i, j] for j, o in mine.items())
                for _ in range(200):
                    lam = (lo + hi) / 2
                    short = sum(min(o, lam * weight[i, j]) for j, o in mine.items()) < need[i]
                    lo, hi = (lam, hi) if short else (lo, lam)
                take = {j: min(o, hi * weight[i, j]) for j, o in mine.items()}
            for j, t in take.items():
                x[i, j] += t
                left[j] -= t
            met = sum(mine.values()) >= need[i]
            need[i] = 0.0 if met else need[i] - sum(take.values())
            if met:
                active.discard(i)
    placed = sum(x.values())
    tmax = max([x[i, j] / (bw(i, j) * 1e9) for (i, j) in x] or [0.0])
    bnd = sum(boundary[i] / (hw.link(dev_of_stage[i], dev_of_stage[i + 1]).total_bw_gbps * 1e9)
              for i in range(len(boundary)))
    return (-round(placed / MIB), round(tmax * 1e9), round(bnd * 1e9))


CASES = {
    # spare short of demand (5.5 of 9 GiB): who shares which target decides the bytes placed
    "scarce": ([5 * GIB, 3 * GIB, 1 * GIB, 0, 0, 0], [0, 0, 0, 2 * GIB, 2.5 * GIB, 1 * GIB]),
    # spare plentiful: everything fits; the stripes' bandwidth decides
    "plentiful": ([2 * GIB, 1 * GIB, 0, 0, 0, 0], [0, 0, 4 * GIB, 4 * GIB, 4 * GIB, 4 * GIB]),
}


@pytest.mark.parametrize("striping", ["weighted", "equal", "none"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_search_is_exact_against_a_plain_brute_force(case, striping):
    devices = (0, 1, 2, 4, 5, 6)  # a DGX-1 sub-topology: 1- and 2-NVLink pairs and PCIe-only pairs
    demand, spare = CASES[case]
    boundary = [32 * MIB] * 5
    keys = {perm: reference_key(DGX1, perm, demand, spare, boundary, striping)
            for perm in itertools.permutations(devices)}
    best = min(keys.values())
    m = search_mapping(DGX1, devices, demand, spare, boundary, striping=striping)
    assert m.exact and m.candidates == 720
    assert keys[m.device_of_stage] == best
    assert m.device_of_stage == min(perm for perm, k in keys.items() if k == best)
    assert key(m) == best  # the reported placement and times are the reference's too
    for perm in list(keys)[::6]:  # and the vectorised scorer agrees with the reference mapping by mapping
        assert key(search_mapping(DGX1, perm, demand, spare, boundary, striping, mode="identity")) == keys[perm]


def test_search_beats_identity_on_dgx1_when_early_stages_are_heavy():
    ident = search_mapping(DGX1, range(8), HEAVY, LIGHT, BOUNDARY, mode="identity")
    best = search_mapping(DGX1, range(8), HEAVY, LIGHT, BOUNDARY)
    assert best.exact and best.candidates == 40320
    assert key(best) < key(ident)
    # identity: stages 0-3 fill one quad, one 2-NVLink pair each into the other (MPress §II-E Fig. 3):
    # 6 GiB over 50 GB/s. The search gives every heavy stage more than one light neighbour.
    assert max(ident.swap_time_s) == pytest.approx(6 * GIB / 50e9)
    assert max(best.swap_time_s) < 0.5 * max(ident.swap_time_s)
    assert sum(best.placed_bytes) == pytest.approx(sum(LIGHT))


def test_weighted_stripes_follow_link_bandwidth():
    demand = [4 * GIB] + [0.0] * 7
    spare = [0.0] + [8 * GIB] * 7
    m = search_mapping(DGX1, range(8), demand, spare, mode="identity")
    w = dict(m.targets[0])
    # GPU0: 1 NVLink to GPU1, GPU2; 2 to GPU3, GPU4 (MPress §III-C: "GPU0 can transfer data to GPU3
    # at a speed of 50GB/s"); GPU5-7 are PCIe-only, not D2D neighbours
    assert w == {1: 25.0, 2: 25.0, 3: 50.0, 4: 50.0}
    assert w[3] == 2 * w[1]
    stripes = dict(zip([t for t, _ in m.targets[0]], m.stripe_bytes[0]))
    assert stripes[3] == pytest.approx(2 * stripes[1])
    assert m.placed_bytes[0] == pytest.approx(4 * GIB)
    assert m.swap_time_s[0] == pytest.approx(4 * GIB / 150e9)  # all stripes finish together


def test_equal_stripes_wait_for_the_slowest_link_and_none_uses_the_fastest():
    demand = [4 * GIB] + [0.0] * 7
    spare = [0.0] + [8 * GIB] * 7
    eq = search_mapping(DGX1, range(8), demand, spare, striping="equal", mode="identity")
    assert [wt for _, wt in eq.targets[0]] == [1.0] * 4
    assert eq.swap_time_s[0] == pytest.approx(GIB / 25e9)  # 1 GiB on each link; 1 NVLink is the slowest
    one = search_mapping(DGX1, range(8), demand, spare, striping="none", mode="identity")
    assert one.targets[0] == ((3, 1.0),)  # 2 NVLinks (ties with GPU4: the lower stage)
    assert one.swap_time_s[0] == pytest.approx(4 * GIB / 50e9)


def test_a_targets_spare_is_shared_in_proportion_to_link_bandwidth():
    # stage 0 on GPU0 (2 NVLinks to GPU4), stage 1 on GPU5 (1 NVLink to GPU4), stage 2 on GPU4 the
    # only one with spare; both want more than it has: it splits 2:1
    m = search_mapping(DGX1, (0, 5, 4), [8 * GIB, 8 * GIB, 0], [0, 0, 3 * GIB], mode="identity")
    assert m.placed_bytes[:2] == pytest.approx((2 * GIB, 1 * GIB))
    # a source that needs less than its share leaves the rest to the other (progressive filling)
    m = search_mapping(DGX1, (0, 5, 4), [0.5 * GIB, 8 * GIB, 0], [0, 0, 3 * GIB], mode="identity")
    assert m.placed_bytes[:2] == pytest.approx((0.5 * GIB, 2.5 * GIB))


def test_targets_are_peer_linked_devices_with_spare():
    for striping in ("weighted", "equal", "none"):
        m = search_mapping(DGX1, range(8), HEAVY, LIGHT, BOUNDARY, striping=striping)
        for s, tgts in enumerate(m.targets):
            for t, _ in tgts:
                assert LIGHT[t] > 0 and DGX1.is_peer(m.device_of_stage[s], m.device_of_stage[t])
            if striping == "none":
                assert len(tgts) <= 1


def test_pcie_only_pairs_place_nothing():
    hw = load("map_8xa100")  # NVLink bridges only on 0-1, 2-3, 4-5, 6-7
    m = search_mapping(hw, (0, 2), [GIB, 0], [0, GIB], mode="identity")
    assert m.targets[0] == () and m.placed_bytes[0] == 0.0
    m = search_mapping(hw, (0, 2, 1), [GIB, 0, 0], [0, GIB, GIB])  # the search pairs it over the bridge
    (t, _), = m.targets[0]
    assert {m.device_of_stage[0], m.device_of_stage[t]} == {0, 1}
    assert m.placed_bytes[0] == pytest.approx(GIB)


def test_boundary_sends_break_ties_toward_fast_consecutive_links():
    # one heavy stage: every DGX-1 GPU has 6 NVLinks to 4 peers, so every mapping swaps alike and the
    # pipeline path decides. The 2-NVLink pairs form two 4-cycles (0-3-7-4, 1-2-6-5): the best path
    # crosses 6 of them and one 1-NVLink pair.
    demand = [GIB] + [0.0] * 7
    spare = [0.0] + [8 * GIB] * 7
    m = search_mapping(DGX1, range(8), demand, spare, [GIB] * 7)
    assert m.boundary_time_s == pytest.approx(GIB * (6 / 50e9 + 1 / 25e9))


@pytest.mark.parametrize("name", ["dgx2", "local_cpu"])
def test_symmetric_topologies_skip_the_search(name):
    hw = load(name)
    p = hw.num_devices
    devices = list(reversed(range(p)))
    demand = [GIB] * (p // 2) + [0.0] * (p - p // 2)
    spare = [0.0] * (p // 2) + [GIB] * (p - p // 2)
    m = search_mapping(hw, devices, demand, spare)
    assert m.device_of_stage == tuple(devices) and m.candidates == 1 and m.exact
    assert all(len(m.targets[s]) == p - p // 2 for s in range(p // 2))  # NVSwitch / shm are peer links


def test_dgx2_port_is_shared_by_stripes():
    # NVSwitch: a GPU's 300 GB/s port is shared by all its peers (specs.hardware.SWITCHED_KINDS)
    hw = load("dgx2")
    m = search_mapping(hw, range(8), HEAVY, LIGHT)
    assert max(m.swap_time_s) == pytest.approx(6 * GIB / 300e9)


def test_sixteen_devices_local_search_finishes_and_is_no_worse_than_identity():
    hw = two_dgx1_mesh()
    demand = [8 * GIB] * 8 + [0.0] * 8
    spare = [0.0] * 8 + [6 * GIB] * 8
    ident = search_mapping(hw, range(16), demand, spare, [64 * MIB] * 15, mode="identity")
    t0 = time.perf_counter()
    m = search_mapping(hw, range(16), demand, spare, [64 * MIB] * 15)
    assert time.perf_counter() - t0 < 10.0
    assert not m.exact and m.candidates > 1000
    assert sorted(m.device_of_stage) == list(range(16))
    assert key(m) <= key(ident)
    assert max(m.swap_time_s) < max(ident.swap_time_s)


def test_same_inputs_same_mapping():
    assert (search_mapping(DGX1, range(8), HEAVY, LIGHT, BOUNDARY)
            == search_mapping(DGX1, range(8), HEAVY, LIGHT, BOUNDARY))
    hw = two_dgx1_mesh()
    args = (hw, range(16), [GIB] * 6 + [0.0] * 10, [0.0] * 6 + [GIB] * 10)
    assert search_mapping(*args) == search_mapping(*args)


def test_trivial_inputs_return_identity():
    assert search_mapping(DGX1, (5,), [GIB], [0.0]).device_of_stage == (5,)
    m = search_mapping(DGX1, (7, 3, 1), [0.0] * 3, [GIB] * 3, [MIB] * 2)
    assert m.device_of_stage == (7, 3, 1) and m.candidates == 1 and sum(m.placed_bytes) == 0.0


@pytest.mark.parametrize("args, field", [
    (((0, 1), [GIB], [0.0, GIB]), "demand_bytes"),
    (((0, 1), [GIB, 0.0], [0.0]), "spare_bytes"),
    (((0, 1), [GIB, 0.0], [0.0, GIB], [1.0, 2.0]), "boundary_bytes"),
    (((0, 0), [GIB, 0.0], [0.0, GIB]), "devices"),
    (((0, 8), [GIB, 0.0], [0.0, GIB]), "devices"),
    (((0, 1), [float("nan"), 0.0], [0.0, GIB]), "demand_bytes"),
])
def test_bad_inputs_name_the_argument(args, field):
    with pytest.raises(ValueError, match=field):
        search_mapping(DGX1, *args)


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="striping"):
        search_mapping(DGX1, (0, 1), [GIB, 0], [0, GIB], striping="bogus")
    with pytest.raises(ValueError, match="mode"):
        search_mapping(DGX1, (0, 1), [GIB, 0], [0, GIB], mode="bogus")


@pytest.mark.parametrize("striping", ["weighted", "equal", "none"])
def test_no_spare_anywhere_places_nothing_in_every_striping(striping):
    # every stage over capacity (GPT-15.4B on DGX-1): striping=none once failed on the empty target set
    m = search_mapping(DGX1, list(range(8)), [4 * GIB] * 8, [0.0] * 8, BOUNDARY, striping=striping)
    assert m.placed_bytes == (0.0,) * 8 and all(not t for t in m.targets)
