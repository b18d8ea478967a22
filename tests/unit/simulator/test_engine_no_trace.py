"""simulator.engine.Engine(trace=False) (simulator.engine.NoTrace): the same walk and Result as
with a trace, and an empty trace. What a planner's search would use for candidates whose trace it
never reads (simulate() does not expose it yet)."""
from __future__ import annotations

from costs.families import build_model, parse_model_config
from planners import make_plan
from planners.policy import BalancedPolicy
from simulator import simulate
from simulator.engine import Engine
from simulator.report import build_result
from specs import TrainingSpec
from specs.hardware import HardwareSpec
from specs.plan import D2DTarget, LayerMemory, MemoryAction, ScheduleSpec
from tests.conftest import conf


def test_no_trace_gives_the_same_result_and_an_empty_trace():
    hw = HardwareSpec.model_validate(conf("hardware", "dgx1"))
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    model = build_model(parse_model_config({**conf("model", "gpt_tiny"), "num_layers": 14}), training.act_dtype_bytes)
    plan = make_plan(BalancedPolicy(pp=8), model, hw, training, ScheduleSpec(kind="1f1b"))
    stages = list(plan.stages)
    s1, s2 = stages[1], stages[2]
    stages[1] = s1.model_copy(update={"memory": [LayerMemory(layer=s1.layer_start, action=MemoryAction.recompute)],
                                      "offload": s1.offload.model_copy(update={"optimizer_swap": True})})
    stages[2] = s2.model_copy(update={"memory": [
        LayerMemory(layer=s2.layer_start, action=MemoryAction.cpu_swap),
        LayerMemory(layer=s2.layer_start + 1, action=MemoryAction.d2d_swap, targets=[D2DTarget(device=7, weight=1.0)])]})
    plan = plan.model_copy(update={"stages": stages})
    traced = simulate(plan, model, hw)
    engine = Engine(plan, model, hw, trace=False)
    engine.run()
    result, trace = build_result(engine, model)
    assert trace == {} and traced.trace["traceEvents"]
    assert result.model_dump_json() == traced.result.model_dump_json()
    assert engine.events == traced.events
