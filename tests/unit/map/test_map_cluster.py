"""MAP's cluster detector, the grouping (MAP §4.2): bandwidth tables -> a mesh of equal-bandwidth axes."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import yaml

from planners.map.cluster import check_links, detect_mesh, hardware_matrices, mesh_from_hardware
from specs.hardware import HardwareSpec

CONF = Path(__file__).resolve().parents[3] / "conf" / "hardware"
MAP8 = HardwareSpec.model_validate(yaml.safe_load((CONF / "map_8xa100.yaml").read_text()))
LOCAL = HardwareSpec.model_validate(yaml.safe_load((CONF / "local_cpu.yaml").read_text()))
GB = 1e9


def _matrix(n: int, bw) -> list[list[float]]:
    return [[bw(i, j) if i != j else 0.0 for j in range(n)] for i in range(n)]


def _axis_pairs(shape: tuple[int, ...], devices: tuple[int, ...], axis: int) -> set[frozenset[int]]:
    """Device pairs that differ only in ``axis``'s coordinate (row-major order over ``shape``)."""
    coords = list(itertools.product(*(range(s) for s in shape)))
    at = dict(zip(coords, devices))
    return {frozenset((at[c], at[d])) for c, d in itertools.combinations(coords, 2)
            if [k for k in range(len(shape)) if c[k] != d[k]] == [axis]}


def test_map_8xa100_puts_the_nvlink_pairs_on_the_fast_axis():
    found = mesh_from_hardware(MAP8)
    assert found.shape == (2, 2, 2) and found.mesh.num_devices == 8
    nvlink = {frozenset(p) for p in [(0, 1), (2, 3), (4, 5), (6, 7)]}
    fast = max(range(3), key=lambda k: found.mesh.axes[k].beta_bytes_per_s)
    assert _axis_pairs(found.shape, found.devices, fast) == nvlink
    # MAP §7: NVLink > 200 GB/s, PCIe inside a NUMA half 20, across the halves ~10: one axis each,
    # priced by its slowest pair (the NUMA halves 0-3 / 4-7 on the middle axis)
    assert [ax.beta_bytes_per_s / GB for ax in found.mesh.axes] == [10.0, 20.0, 300.0]
    assert [ax.alpha_s for ax in found.mesh.axes] == [1e-5, 5e-6, 3e-6]
    assert _axis_pairs(found.shape, found.devices, 1) == {frozenset(p) for p in [(0, 2), (1, 3), (4, 6), (5, 7)]}


def test_every_axis_is_priced_by_its_slowest_pair():
    found = mesh_from_hardware(MAP8)
    for k, ax in enumerate(found.mesh.axes):
        worst = min(MAP8.link(a, b).total_bw_gbps for a, b in map(tuple, _axis_pairs(found.shape, found.devices, k)))
        assert ax.beta_bytes_per_s == worst * GB


def test_uniform_four_devices_are_one_axis():
    found = detect_mesh(_matrix(4, lambda i, j: 2.5 * GB), _matrix(4, lambda i, j: 1e-4))
    assert found.shape == (4,) and found.devices == (0, 1, 2, 3)
    assert found.mesh.axes[0].beta_bytes_per_s == 2.5 * GB and found.mesh.axes[0].alpha_s == 1e-4


def test_two_tier_eight_devices_give_2_by_4():
    # two islands of 4 (say two NVSwitch boards) joined by a 10x slower link; islands interleaved
    island = {0: 0, 2: 0, 4: 0, 6: 0, 1: 1, 3: 1, 5: 1, 7: 1}
    beta = _matrix(8, lambda i, j: 100 * GB if island[i] == island[j] else 10 * GB)
    found = detect_mesh(beta)
    assert found.shape == (2, 4) and found.devices == (0, 2, 4, 6, 1, 3, 5, 7)
    assert [ax.beta_bytes_per_s for ax in found.mesh.axes] == [10 * GB, 100 * GB]


@pytest.mark.parametrize("seed", range(20))
def test_noise_within_10_percent_keeps_the_grouping(seed):
    rng = random.Random(seed)
    beta, alpha = hardware_matrices(MAP8, range(8))
    exact = detect_mesh(beta, alpha)
    noisy = [[v * rng.uniform(0.9, 1.1) for v in row] for row in beta]  # asymmetric noise too
    found = detect_mesh(noisy, alpha)
    assert (found.shape, found.devices) == (exact.shape, exact.devices)
    for ax, ref in zip(found.mesh.axes, exact.mesh.axes):
        assert ax.beta_bytes_per_s == pytest.approx(ref.beta_bytes_per_s, rel=0.1)


def test_labels_follow_the_rows():
    beta, alpha = hardware_matrices(MAP8, range(8))
    found = detect_mesh(beta, alpha, devices=[10, 11, 12, 13, 14, 15, 16, 17])
    assert found.devices == tuple(range(10, 18))


def test_grouping_is_deterministic_under_relabelling_of_equal_pairs():
    # device 3 is paired with 0 and 1 with 2: groups come out ordered by their first device
    fast = {frozenset((0, 3)), frozenset((1, 2))}
    found = detect_mesh(_matrix(4, lambda i, j: 50 * GB if frozenset((i, j)) in fast else 5 * GB))
    assert found.shape == (2, 2) and found.devices == (0, 3, 1, 2)


def test_no_equal_clique_tier_falls_back_to_one_axis_at_the_slowest_pair():
    # 3 devices on a fast link and 1 alone: no equal-sized groups below the slowest tier
    beta = _matrix(4, lambda i, j: 100 * GB if max(i, j) < 3 else 10 * GB)
    found = detect_mesh(beta)
    assert found.shape == (4,) and found.mesh.axes[0].beta_bytes_per_s == 10 * GB


def test_bad_matrices_are_rejected_with_the_entry_named():
    with pytest.raises(ValueError, match=r"beta\[0\]\[1\]"):
        detect_mesh([[0.0, float("nan")], [1.0, 0.0]])
    with pytest.raises(ValueError, match="at least 2 devices"):
        detect_mesh([[0.0]])
    with pytest.raises(ValueError, match="beta must be 2 x 2"):
        detect_mesh([[0, 1, 1], [1, 0, 1]])


def test_check_links_flags_a_pair_whose_yaml_bandwidth_is_5x_the_measured():
    beta, _ = hardware_matrices(MAP8, range(8))
    assert check_links(MAP8, beta) == []
    beta[2][3] = beta[3][2] = 60 * GB  # the 2-3 NVLink bridge measures 60 GB/s, the YAML says 300
    got = check_links(MAP8, beta)
    assert len(got) == 1 and "devices 2-3" in got[0] and "300 GB/s" in got[0] and "5x" in got[0]


def test_check_links_reports_within_factor_as_agreement_and_devices_outside_the_yaml():
    beta = _matrix(4, lambda i, j: LOCAL.link(0, 1).total_bw_gbps * GB * 1.8)
    assert check_links(LOCAL, beta) == []
    # the YAML's own bandwidth on 5 devices: only the 4 pairs with device 4 (outside the YAML) are reported
    got = check_links(LOCAL, _matrix(5, lambda i, j: LOCAL.link(0, 1).total_bw_gbps * GB))
    assert len(got) == 4 and all("devices 0..3 only" in line for line in got)


def test_local_cpu_yaml_is_one_axis_of_four():
    found = mesh_from_hardware(LOCAL)
    said = LOCAL.link(0, 1).total_bw_gbps * GB  # whatever mode=calibrate last wrote
    assert found.shape == (4,) and found.mesh.axes[0].beta_bytes_per_s == pytest.approx(said)
