"""policy.find (planners/auto/find.py, issue 23): the fewest nodes that train a model and the largest
model that trains, each checked at its edge with independent searches: the answer fits and one
step smaller (nodes) or larger (layers) does not.

The hardware is conftest's toy cluster: one device per node, ib between nodes, and 1–2 MiB of
host RAM per node so that STRONGHOLD windows and host swaps cannot hold a whole model's state
(with a full host any model fits one device, streamed). The model is the tiny GPT (fp32), so each
probe (an auto search without MPress's improve rounds) takes a fraction of a second.
"""
from __future__ import annotations

from costs.families import build_model, parse_model_config
from planners.auto.find import find, with_nodes
from planners.auto.search import auto_search
from planners.policy import AutoPolicy
from specs import HardwareSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, make_hardware
from tests.unit.auto.auto_cases import ONE_F_ONE_B, SINGLES, simulated_fit

MIB = 1 << 20


def cluster(device_mib: float, host_mib: float, nodes: int = 1) -> HardwareSpec:
    hw = make_hardware(devices=1, nodes=2, memory_bytes=int(device_mib * MIB), nvlink_pairs=()).model_dump()
    hw["host"]["memory_bytes"] = int(host_mib * MIB)
    return HardwareSpec.model_validate({**hw, "nodes": nodes})


def gpt(layers: int):
    """The tiny GPT with ``layers`` transformer blocks (the shell's grown_model does this from configs)."""
    return build_model(parse_model_config({**GPT_TINY.model_dump(), "num_layers": layers}),
                       CPU_TRAINING.act_dtype_bytes)


def fits_on(policy, model, hw) -> bool:
    return auto_search(policy, model, hw, CPU_TRAINING, ONE_F_ONE_B).fits


def test_fewest_nodes_fits_and_one_node_fewer_does_not():
    hw = cluster(device_mib=1.5, host_mib=1)
    policy = AutoPolicy(find="fewest_nodes", singles=sorted(SINGLES), max_nodes=16)
    model = gpt(4)
    out = find(policy, model, hw, CPU_TRAINING, ONE_F_ONE_B)
    n = out.hardware.nodes
    assert n > 1, "the test needs a model that does not fit one node"
    assert out.fits and out.plan.num_devices == n * hw.devices_per_node and f"fewest nodes: {n}" in out.find_answer
    fits, _, peaks = simulated_fit(out.plan, model, with_nodes(hw, n), out.capacity_bytes)
    assert fits, f"the answer's plan does not fit {n} nodes when simulated again (peaks {peaks})"
    assert not fits_on(policy, model, with_nodes(hw, n - 1)), f"{n - 1} nodes fit too"


def test_largest_model_fits_and_one_layer_more_does_not():
    hw = cluster(device_mib=2.5, host_mib=2, nodes=4)
    policy = AutoPolicy(find="largest_model", singles=sorted(SINGLES))
    out = find(policy, gpt(4), hw, CPU_TRAINING, ONE_F_ONE_B, grow=(4, gpt))
    blocks = out.model.num_layers - 2  # embedding and head around the blocks
    assert blocks > 4, "the test needs a model that grows past the configured one"
    assert out.fits and f"largest model: {blocks} layers" in out.find_answer
    fits, _, _ = simulated_fit(out.plan, out.model, hw, out.capacity_bytes)
    assert fits
    assert not fits_on(policy, gpt(blocks + 1), hw), f"{blocks + 1} layers fit too"


def test_probes_skip_the_improve_rounds_without_changing_a_verdict(monkeypatch):
    """The probes run without MPress's improve rounds (they only speed up plans that already fit);
    each probed size's verdict equals the whole search's, and the answer is the whole search's."""
    import planners.auto.find as find_module

    calls = []

    def spy(policy, model, hw, *args, **kwargs):
        out = auto_search(policy, model, hw, *args, **kwargs)
        calls.append((policy, model, hw, out))
        return out

    monkeypatch.setattr(find_module, "auto_search", spy)
    hw = cluster(device_mib=2.5, host_mib=2, nodes=4)
    policy = AutoPolicy(find="largest_model", singles=sorted(SINGLES))
    assert policy.improve_layouts > 0
    out = find(policy, gpt(4), hw, CPU_TRAINING, ONE_F_ONE_B, grow=(4, gpt))
    *probes, answer = calls
    assert len(probes) >= 3 and all(p.improve_layouts == 0 for p, _, _, _ in probes)
    assert answer[0].improve_layouts == policy.improve_layouts and answer[3] is out
    assert answer[1].num_layers == out.model.num_layers and out.fits
    whole = policy.model_copy(update={"singles": answer[0].singles})
    for _, model, probe_hw, got in probes:
        assert auto_search(whole, model, probe_hw, CPU_TRAINING, ONE_F_ONE_B).fits == got.fits, model.num_layers
