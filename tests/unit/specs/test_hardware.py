"""HardwareSpec behaviour on small hand-built specs: link resolution and validation messages."""
from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from specs.hardware import HardwareSpec, LinkKind

NVLINK = {"kind": "nvlink", "count": 1, "bw_gbps": 25.0, "latency_s": 3e-6}
PCIE = {"kind": "pcie", "count": 1, "bw_gbps": 12.0, "latency_s": 5e-6}
IB = {"kind": "ib", "count": 1, "bw_gbps": 25.0, "latency_s": 5e-6}


def spec_dict(**over) -> dict:
    """A 2-node x 4-device spec: NVLink 0-1 (x2) and 2-3, PCIe otherwise, IB between nodes."""
    d = {
        "name": "toy",
        "nodes": 2,
        "devices_per_node": 4,
        "device": {
            "model": "toy-gpu",
            "memory_bytes": 16 << 30,
            "peak_tflops": {"fp32": 10.0, "fp16": 100.0},
            "compute_efficiency": 0.5,
            "hbm_gbps": 900.0,
        },
        "host": {"memory_bytes": 256 << 30, "pcie_gbps": 12.0},
        "intra_node": {
            "links": [{"a": 0, "b": 1, **NVLINK, "count": 2}, {"a": 3, "b": 2, **NVLINK}],
            "fallback": PCIE,
        },
        "inter_node": IB,
    }
    d.update(over)
    return d


def with_links(*links: dict) -> dict:
    d = spec_dict()
    d["intra_node"] = {**d["intra_node"], "links": list(links)}
    return d


def test_link_resolves_explicit_fallback_and_inter_node():
    hw = HardwareSpec.model_validate(spec_dict())
    assert hw.num_devices == 8
    assert hw.link(0, 1).kind is LinkKind.nvlink and hw.link(0, 1).total_bw_gbps == 50.0
    assert hw.link(2, 3) == hw.link(3, 2)  # pairs are undirected, listed either way round
    assert hw.link(0, 2).kind is LinkKind.pcie
    assert hw.link(1, 5).kind is LinkKind.ib  # different nodes: the fabric, even for local pair 1-1
    assert hw.link(4, 5).kind is LinkKind.nvlink  # node 1 repeats node 0's topology


def test_is_peer_only_for_nvlink_within_a_node():
    hw = HardwareSpec.model_validate(spec_dict())
    assert hw.is_peer(0, 1) and hw.is_peer(6, 7)
    assert not hw.is_peer(0, 2)  # PCIe
    assert not hw.is_peer(0, 4)  # IB
    assert not hw.is_peer(1, 1)


def test_all_to_all_covers_every_unlisted_pair():
    d = spec_dict()
    d["intra_node"] = {"all_to_all": {**NVLINK, "kind": "nvswitch", "count": 12}, "fallback": PCIE}
    hw = HardwareSpec.model_validate(d)
    for a in range(4):
        for b in range(4):
            if a != b:
                assert hw.link(a, b).kind is LinkKind.nvswitch and hw.link(a, b).total_bw_gbps == 300.0


def test_link_rejects_missing_devices_and_self_links():
    hw = HardwareSpec.model_validate(spec_dict())
    with pytest.raises(ValueError, match="not in hardware 'toy'"):
        hw.link(0, 8)
    with pytest.raises(ValueError, match="no link to itself"):
        hw.link(3, 3)


def test_link_to_device_outside_the_node_names_the_link():
    with pytest.raises(ValidationError) as e:
        HardwareSpec.model_validate(with_links({"a": 0, "b": 9, **NVLINK}))
    msg = str(e.value)
    assert "intra_node.links[0]" in msg and "device 9" in msg and "4 devices" in msg


def test_duplicated_pair_names_the_second_listing():
    with pytest.raises(ValidationError) as e:
        HardwareSpec.model_validate(with_links({"a": 0, "b": 1, **NVLINK}, {"a": 1, "b": 0, **NVLINK}))
    msg = str(e.value)
    assert "intra_node.links[1]" in msg and "(0, 1)" in msg and "twice" in msg


def test_self_link_is_rejected():
    with pytest.raises(ValidationError, match=r"intra_node.links\[0\]"):
        HardwareSpec.model_validate(with_links({"a": 2, "b": 2, **NVLINK}))


def test_several_nodes_need_an_inter_node_fabric():
    with pytest.raises(ValidationError) as e:
        HardwareSpec.model_validate(spec_dict(inter_node=None))
    assert "inter_node" in str(e.value) and "nodes=2" in str(e.value)
    HardwareSpec.model_validate(spec_dict(nodes=1, inter_node=None))  # one node needs none


def test_unknown_dtype_in_peak_tflops_names_the_field():
    d = spec_dict()
    d["device"] = {**d["device"], "peak_tflops": {"fp32": 10.0, "fp8": 400.0}}
    with pytest.raises(ValidationError) as e:
        HardwareSpec.model_validate(d)
    msg = str(e.value)
    assert "device" in msg and "peak_tflops" in msg and "fp8" in msg


def test_peak_tflops_needs_fp32():
    d = spec_dict()
    d["device"] = {**d["device"], "peak_tflops": {"fp16": 100.0}}
    with pytest.raises(ValidationError, match="peak_tflops"):
        HardwareSpec.model_validate(d)


def test_unknown_key_is_an_error_not_ignored():
    d = spec_dict()
    d["host"] = {**d["host"], "pcie_gbs": 12.0}  # typo of pcie_gbps
    with pytest.raises(ValidationError, match="pcie_gbs"):
        HardwareSpec.model_validate(d)


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("intra_node", "fallback", "bw_gbps"), 0.0, "bw_gbps"),
        (("device", "compute_efficiency"), 1.5, "compute_efficiency"),
        (("device", "memory_bytes"), 0, "memory_bytes"),
        (("intra_node", "fallback", "kind"), "carrier-pigeon", "kind"),
    ],
)
def test_bad_numbers_name_their_field(path, value, field):
    d = copy.deepcopy(spec_dict())
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValidationError, match=field):
        HardwareSpec.model_validate(d)


def test_flops_per_s_applies_efficiency_and_never_falls_back():
    hw = HardwareSpec.model_validate(spec_dict())
    assert hw.device.flops_per_s("fp16") == pytest.approx(100e12 * 0.5)
    # no bf16 units: an error naming the field and the dtypes it has, not the fp32 rate (issue #10)
    with pytest.raises(ValueError, match=r"peak_tflops.*no bf16.*fp32, fp16.*training.precision=fp16"):
        hw.device.flops_per_s("bf16")
