"""Every conf/hardware/*.yaml validates, and the topologies say what the papers say."""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from costs.collectives import group_link, ring_allreduce_s
from specs.hardware import HardwareSpec, LinkKind

ROOT = Path(__file__).resolve().parents[3]
CONF = ROOT / "conf"
HARDWARE_FILES = sorted((CONF / "hardware").glob("*.yaml"))
FIELDS = set(HardwareSpec.model_fields)


def load(name: str, **over) -> HardwareSpec:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{name}.yaml"), resolve=True)
    return HardwareSpec.model_validate({**cfg, **over})


def test_the_expected_configs_exist():
    names = {p.stem for p in HARDWARE_FILES}
    assert names >= {"dgx1", "dgx2", "capture_cluster", "map_8xa100", "v100_single", "a10_cluster",
                     "selene", "h100_node", "local_cpu"}


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=lambda p: p.stem)
def test_every_yaml_validates_with_exactly_the_spec_fields(path):
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert set(cfg) == FIELDS, f"{path.name}: top-level keys must be HardwareSpec's fields"
    hw = HardwareSpec.model_validate(cfg)
    assert hw.name == path.stem  # `+hardware=<file>` and the spec's name agree
    for a, b in itertools.permutations(range(hw.num_devices), 2):
        assert hw.link(a, b).total_bw_gbps > 0


# ---- dgx1: the NVLink 2.0 hybrid cube-mesh (MPress Fig. 3) -----------------------------------

def test_dgx1_every_gpu_has_six_nvlinks():
    hw = load("dgx1")
    links = Counter()
    for link in hw.intra_node.links:
        if link.kind is LinkKind.nvlink:
            links[link.a] += link.count
            links[link.b] += link.count
    assert dict(links) == {g: 6 for g in range(8)}


def test_dgx1_pairs_without_nvlink_use_pcie():
    hw = load("dgx1")
    assert hw.link(0, 5).kind is LinkKind.pcie
    assert hw.link(3, 4).kind is LinkKind.pcie
    assert hw.link(0, 3).kind is LinkKind.nvlink and hw.link(0, 3).count == 2
    assert hw.link(0, 3).total_bw_gbps == 50.0  # "GPU0 to GPU3 at 50GB/s" (MPress §III-C)
    assert hw.link(0, 1).total_bw_gbps == 25.0
    non_nvlink = [(a, b) for a, b in itertools.combinations(range(8), 2) if not hw.is_peer(a, b)]
    assert len(non_nvlink) == 28 - 16


def test_dgx1_is_peer_follows_nvlink():
    hw = load("dgx1")
    assert hw.is_peer(0, 3) and hw.is_peer(3, 0) and hw.is_peer(1, 5) and hw.is_peer(6, 7)
    assert not hw.is_peer(0, 5) and not hw.is_peer(3, 4) and not hw.is_peer(2, 7)


# ---- other topologies -----------------------------------------------------------------------

def test_map_nvlink_pairs_numa_pcie_and_cross_numa():
    hw = load("map_8xa100")
    assert [p for p in itertools.combinations(range(8), 2) if hw.is_peer(*p)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert hw.link(0, 2).kind is LinkKind.pcie and hw.link(0, 2).total_bw_gbps == 20.0
    assert hw.link(3, 4).total_bw_gbps == 10.0 and hw.link(7, 0).total_bw_gbps == 10.0
    # MAP §7: an 8-GPU ring is bounded by the cross-NUMA PCIe, a 4-GPU one by PCIe in a NUMA node
    assert group_link(hw, list(range(8))).total_bw_gbps == 10.0
    assert group_link(hw, [0, 1, 2, 3]).total_bw_gbps == 20.0


@pytest.mark.parametrize("name, per_gpu_gbps", [("dgx2", 300.0), ("selene", 300.0), ("h100_node", 450.0)])
def test_nvswitch_nodes_give_every_pair_the_full_port(name, per_gpu_gbps):
    hw = load(name)
    for a, b in itertools.permutations(range(hw.devices_per_node), 2):
        assert hw.is_peer(a, b) and hw.link(a, b).total_bw_gbps == per_gpu_gbps


def test_selene_scales_to_128_nodes_through_hydra():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["+hardware=selene", "hardware.nodes=128"])
    hw = HardwareSpec.model_validate(OmegaConf.to_container(cfg.hardware, resolve=True))
    assert hw.num_devices == 1024
    assert hw.link(0, 1023).kind is LinkKind.ib and hw.link(0, 1023).bw_gbps == 25.0  # HDR 200 Gb/s
    assert hw.link(7, 8).kind is LinkKind.ib  # neighbours across a node boundary
    assert hw.link(1016, 1023).kind is LinkKind.nvswitch  # last node, same switch
    assert not hw.is_peer(7, 8)


def test_capture_cluster_is_4x4_a100_with_100gbit_ib():
    hw = load("capture_cluster")
    assert (hw.nodes, hw.devices_per_node, hw.device.memory_bytes) == (4, 4, 40 << 30)
    assert hw.link(3, 4).kind is LinkKind.ib and hw.link(3, 4).total_bw_gbps == 12.5
    assert all(hw.is_peer(a, b) for a, b in itertools.permutations(range(4), 2))


def test_h100_node_needs_no_new_file_for_more_nodes():
    hw = load("h100_node", nodes=16)
    assert hw.num_devices == 128 and hw.link(0, 8).kind is LinkKind.ib


def test_device_memories_match_the_papers():
    gib = 1 << 30
    expect = {"dgx1": 32, "dgx2": 40, "capture_cluster": 40, "map_8xa100": 80, "v100_single": 32,
              "a10_cluster": 24, "selene": 80, "h100_node": 80}
    for name, mem in expect.items():
        assert load(name).device.memory_bytes == mem * gib, name


def test_local_cpu_is_four_ranks_within_this_budget():
    hw = load("local_cpu")
    assert hw.devices_per_node == 4 and hw.device.model == "cpu-gloo-rank"
    assert hw.link(0, 3).kind is LinkKind.shm and hw.is_peer(0, 3)
    # the rank budgets plus the host tier must fit in the 23.5 GiB this machine has
    assert hw.num_devices * hw.device.memory_bytes + hw.host.memory_bytes < 23.5 * (1 << 30)


# ---- the link fits the measurement script and mode=calibrate share (calibration.link_bench) ---------

def _measure_module():
    from calibration import link_bench

    return link_bench


def test_alpha_beta_fit_recovers_a_linear_law():
    m = _measure_module()
    sizes = list(m.MESSAGE_BYTES)
    alpha, beta = m.fit_alpha_beta(sizes, [50e-6 + b / 2.5e9 for b in sizes])
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(2.5e9, rel=1e-6)


def test_alpha_beta_fit_stays_positive_on_noise_that_inverts_the_slope():
    # CI 2026-11-24: steal during the small messages made them slower than the large ones, the
    # unconstrained fit's slope went negative and the calibrated file carried bw_gbps -420
    m = _measure_module()
    sizes = list(m.MESSAGE_BYTES)
    times = [9e-3, 8e-3, 7e-3, 6e-3, 5e-3, 4.5e-3]  # falls with size: no size term to fit
    alpha, beta = m.fit_alpha_beta(sizes, times)
    assert alpha >= 0 and 0 < beta < float("inf")
    # the largest message is priced no faster than it was measured
    assert alpha + sizes[-1] / beta == pytest.approx(times[-1], rel=1e-9)


def test_ring_link_from_allreduce_inverts_the_ring_model():
    m = _measure_module()
    bw_gbps, lat_s = m.ring_link_from_allreduce(4e-3, 0.8e9, n=4)
    hw = load("local_cpu")
    link = hw.intra_node.fallback.model_copy(update={"bw_gbps": bw_gbps, "collective_latency_s": lat_s})
    for nbytes in (4096, 1 << 20, 16 << 20):
        assert ring_allreduce_s(nbytes, 4, link) == pytest.approx(4e-3 + nbytes / 0.8e9)
