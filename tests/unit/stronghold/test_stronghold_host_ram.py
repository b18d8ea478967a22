"""STRONGHOLD against host RAM (issue 22): a plan whose host-side state (the streamed layers'
weights, gradients and optimizer state in DRAM) exceeds a node's RAM does not "fit". The search
prefers a plan that fits host RAM where one exists (NVMe for the optimizer state, more stages over
more nodes), and otherwise says what is short, with the bytes."""
from __future__ import annotations

from costs.families import build_model, parse_model_config
from planners import parse_policy
from planners.stronghold.planner import stronghold_search
from planning import stronghold_short
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf, make_hardware

GIB = 1 << 30
TRAINING = TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16")


def l20():
    return build_model(parse_model_config(conf("model", "stronghold_gpt_l20")))  # 1.7B: ~28 GiB streamed state


def nodes_of_one_gpu(nodes: int, host_gib: int, nvme_gib: int = 0):
    hw = make_hardware(devices=1, nodes=nodes)
    return hw.model_copy(update={"host": hw.host.model_copy(update={"memory_bytes": host_gib * GIB,
                                                                     "nvme_bytes": nvme_gib * GIB})})


def test_the_search_spreads_the_host_state_over_nodes_until_it_fits():
    hw = nodes_of_one_gpu(2, host_gib=20)  # one node's 20 GiB cannot hold it, two nodes' can
    one_gpu = {"kind": "stronghold", "dp": 1, "tp": 1}
    one = stronghold_search(parse_policy({**one_gpu, "pp": 1}), l20(), hw, TRAINING, ScheduleSpec())
    assert not one.fits and one.host_bytes_per_node[0] > 20 * GIB
    found = stronghold_search(parse_policy(one_gpu), l20(), hw, TRAINING, ScheduleSpec())
    assert found.fits and len(found.plan.stages) == 2
    assert all(b <= 20 * GIB for b in found.host_bytes_per_node.values())
    # degrees left to the planner (issue 25): a layout over both nodes (pipeline, or tp shards whose
    # host state is each node's half) fits too
    free = stronghold_search(parse_policy({"kind": "stronghold"}), l20(), hw, TRAINING, ScheduleSpec())
    assert free.fits and free.plan.used_devices() == [0, 1]


def test_when_no_plan_fits_host_ram_the_verdict_names_the_bytes():
    hw = nodes_of_one_gpu(1, host_gib=4)
    outcome = stronghold_search(parse_policy({"kind": "stronghold"}), l20(), hw, TRAINING, ScheduleSpec())
    assert not outcome.fits
    why = stronghold_short(outcome, hw)
    need = outcome.host_bytes_per_node[0] / GIB
    assert why.startswith(f"host RAM: node 0 needs {need:.1f} GiB, has 4.0 GiB"), why
