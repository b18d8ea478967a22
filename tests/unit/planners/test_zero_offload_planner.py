"""policy=zero_offload (planners/baselines/zero_offload.py): the no-offload layout with the
optimizer on the CPU of every stage (ZeRO-Offload, Ren et al. ATC'21 §3), NVMe for its state on
request (ZeRO-Infinity), DPU after the warm-up (§5.2); and the plan field it sets
(``offload.delayed_update_from``) validated."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from costs.families import build_model
from planners import PlanningError, make_plan, parse_policy
from simulator import simulate
from specs.plan import OffloadPolicy, ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

SPEC = build_model(GPT_TINY, 4)
NVME_CPU = LOCAL_CPU.model_copy(update={"host": LOCAL_CPU.host.model_copy(update={"nvme_bytes": 1 << 40,
                                                                                  "nvme_gbps": 2.0})})


def plan(hardware=LOCAL_CPU, schedule=ScheduleSpec(), **knobs):
    return make_plan(parse_policy({"kind": "zero_offload", **knobs}), SPEC, hardware, CPU_TRAINING, schedule)


def test_one_device_every_layer_its_optimizer_on_the_cpu():
    p = plan()
    assert p.planner == "zero_offload" and len(p.stages) == 1
    st = p.stages[0]
    assert st.devices == [0] and (st.layer_start, st.layer_stop) == (0, SPEC.num_layers)
    assert st.offload.optimizer_on_cpu and st.offload.window_layers is None and not st.offload.nvme
    assert st.offload.delayed_update_from is None  # off by default: numerics equal the reference's
    # recompute=full (the default) checkpoints every layer, as policy=balanced does
    balanced = make_plan(parse_policy({"kind": "balanced", "pp": 1, "recompute": "full"}),
                         SPEC, LOCAL_CPU.model_copy(update={"devices_per_node": 1}), CPU_TRAINING, ScheduleSpec())
    assert st.memory == balanced.stages[0].memory


def test_device_keeps_weights_and_gradients_and_no_optimizer_state():
    p = plan()
    d = simulate(p, SPEC, LOCAL_CPU).result.devices[0]
    params = sum(layer.params for layer in SPEC.layers) - SPEC.layers[-1].tied_params
    w_b, g_b, o_b = CPU_TRAINING.bytes_per_param()
    assert d.breakdown.optimizer_bytes == 0
    assert d.breakdown.parameters_bytes == params * w_b and d.breakdown.gradients_bytes == params * g_b
    assert d.host_bytes == params * o_b


def test_pipeline_and_replicas_on_the_first_devices():
    p = plan(pp=2, dp=2)
    assert [st.devices for st in p.stages] == [[0, 1], [2, 3]]
    assert all(st.dp == 2 and st.offload.optimizer_on_cpu for st in p.stages)


def test_nvme_and_delayed_update_knobs():
    p = plan(NVME_CPU, nvme=True, delayed_update=True, dpu_warmup_iterations=7)
    assert p.stages[0].offload.nvme and p.stages[0].offload.delayed_update_from == 7


@pytest.mark.parametrize("knobs,hardware,schedule,needle", [
    ({"nvme": True}, LOCAL_CPU, ScheduleSpec(), "policy.nvme"),
    ({}, LOCAL_CPU, ScheduleSpec(kind="pipedream_async"), "pipedream_async"),
    ({"pp": 4, "dp": 2}, LOCAL_CPU, ScheduleSpec(), "policy.pp"),
])
def test_refusals_name_the_knob(knobs, hardware, schedule, needle):
    with pytest.raises(PlanningError, match=needle):
        plan(hardware, schedule, **knobs)


def test_delayed_update_needs_the_optimizer_on_the_cpu_without_a_window():
    assert OffloadPolicy(optimizer_on_cpu=True, delayed_update_from=1).delayed_update_from == 1
    with pytest.raises(ValidationError, match="delayed_update_from"):
        OffloadPolicy(delayed_update_from=3)
    with pytest.raises(ValidationError, match="delayed_update_from"):
        OffloadPolicy(optimizer_on_cpu=True, window_layers=2, delayed_update_from=3)
    with pytest.raises(ValidationError, match="delayed_update_from"):
        OffloadPolicy(optimizer_on_cpu=True, delayed_update_from=0)
