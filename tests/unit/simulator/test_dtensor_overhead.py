"""DeviceSpec.dtensor_op_overhead_s (issue #11, "Time on CPU"): DTensor's extra per-operator
dispatch cost is charged for every operator of a MAP stage (simulator.sharded_layer.node_compute_s) and
for the DTensor operators of tp > 1 layers (costs.layer_time.TP_DTENSOR_OPS), nowhere else; the field
validates; mode=calibrate's YAML carries it."""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from planners import make_plan
from simulator.analytic import iteration_time_s
from planners.policy import ManualPolicy
from simulator import simulate
from simulator.sharded_layer import layer_cost, stage_mesh
import costs.layer_time
from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.model import LayerKind
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec

CONF = Path(__file__).resolve().parents[3] / "conf"
D = 1.46e-4  # local_cpu's measured value


@lru_cache(maxsize=None)
def local_cpu(dtensor: float = 0.0) -> HardwareSpec:
    raw = yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text())
    raw["device"]["dtensor_op_overhead_s"] = dtensor
    return HardwareSpec.model_validate(raw)


@lru_cache(maxsize=None)
def gpt_tiny():
    raw = yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text())
    return build_model(parse_model_config(raw), 4)


def plan_of(pp: int, tp: int, dp: int, hw: HardwareSpec):
    training = TrainingSpec(global_batch=32, microbatch_size=8, precision="fp32")
    return make_plan(ManualPolicy(pp=pp, tp=tp, dp=dp), gpt_tiny(), hw, training, ScheduleSpec(kind="1f1b"))


# ---- the field ---------------------------------------------------------------------------------

def test_field_defaults_to_zero_and_every_gpu_file_leaves_it_unmeasured():
    for path in sorted((CONF / "hardware").glob("*.yaml")):
        hw = HardwareSpec.model_validate(yaml.safe_load(path.read_text()))
        if path.stem == "local_cpu":
            assert hw.device.dtensor_op_overhead_s == pytest.approx(D)
        else:
            assert hw.device.dtensor_op_overhead_s == 0.0, path.name


@pytest.mark.parametrize("bad", [-1e-6, math.nan, math.inf, -math.inf, 2.0])
def test_field_rejects_negative_non_finite_and_absurd(bad):
    raw = yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text())
    raw["device"]["dtensor_op_overhead_s"] = bad
    with pytest.raises(ValidationError, match="dtensor_op_overhead_s"):
        HardwareSpec.model_validate(raw)


# ---- Megatron TP ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pp,tp,dp", [(1, 1, 4), (2, 1, 2), (4, 1, 1)])
def test_plans_without_dtensor_predict_exactly_as_with_the_term_zero(pp, tp, dp):
    plain, dt = local_cpu(0.0), local_cpu(D)
    plan = plan_of(pp, tp, dp, plain)
    model = gpt_tiny()
    a, b = simulate(plan, model, plain).result, simulate(plan, model, dt).result
    assert a.iteration_time_s == b.iteration_time_s
    assert iteration_time_s(plan, model, plain) == iteration_time_s(plan, model, dt)
    for st in plan.stages:
        assert costs.layer_time.stage_pass_times_s(model, plan, plain, st) == costs.layer_time.stage_pass_times_s(model, plan, dt, st)


def test_tp_layers_pay_exactly_their_dtensor_operators():
    plain, dt = local_cpu(0.0), local_cpu(D)
    model = gpt_tiny()
    plan = plan_of(2, 2, 1, plain)
    for st in plan.stages:
        for layer in st.layers:
            f0, b0, _ = costs.layer_time.layer_pass_times_s(model, plan, plain, st, layer)
            f1, b1, _ = costs.layer_time.layer_pass_times_s(model, plan, dt, st, layer)
            nf, nb = costs.layer_time.TP_DTENSOR_OPS[model.layers[layer].kind]
            assert f1 - f0 == pytest.approx(nf * D, rel=1e-9)
            assert b1 - b0 == pytest.approx(nb * D, rel=1e-9)
    # a block: 6 DTensor Linears of 4 forward and 12 backward operators (executor.stage.tensor_parallel)
    assert costs.layer_time.TP_DTENSOR_OPS[LayerKind.transformer_block] == (24, 72)
    # the simulator and the analytic estimate both see it, and still agree
    sim0, sim1 = simulate(plan, model, plain).result.iteration_time_s, simulate(plan, model, dt).result.iteration_time_s
    assert sim1 > sim0
    assert iteration_time_s(plan, model, dt) == pytest.approx(sim1, rel=0.05)


def test_layers_tensor_parallelism_leaves_plain_are_not_charged():
    model = gpt_tiny()
    block = next(l for l in model.layers if l.kind is LayerKind.transformer_block)
    assert costs.layer_time.tp_dtensor_ops(block, 1) == (0, 0)
    assert costs.layer_time.tp_dtensor_ops(block.model_copy(update={"kind": LayerKind.residual_block}), 2) == (0, 0)
    assert costs.layer_time.tp_dtensor_ops(block.model_copy(update={"kind": LayerKind.generic}), 4) == (0, 0)


# ---- MAP -------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def map_model():
    from executor.op_graph import model_op_graphs

    raw = yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text())
    cfg = parse_model_config({**raw, "num_layers": 1})
    graphs, keys = model_op_graphs(cfg, 4, "fp32")
    model = build_model(cfg, 4)
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 4, "layers": [
        l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})


def test_every_map_node_pays_it_once_per_operator_per_pass():
    from costs.map_strategies import strategies
    from specs.plan import LayerSharding, NodeSharding

    model = map_model()
    plain, dt = local_cpu(0.0), local_cpu(D)
    mesh = stage_mesh(plain, (0, 1, 2, 3), (2, 2))
    specs_in = {"x": "R,R,R"}
    for l, layer in enumerate(model.layers):
        graph = model.op_graphs[layer.op_graph]
        nodes = []
        for n in graph.nodes:
            s = strategies(n, mesh, 4, 16)[0]
            nodes.append(NodeSharding(node=n.name, inputs=[str(x) for x in s.input_specs],
                                      params={p.name: str(x) for p, x in zip(n.params, s.param_specs)},
                                      output=str(s.output_spec)))
        sh = LayerSharding(layer=l, mesh=[2, 2], nodes=nodes)
        inputs = {} if l == 0 else specs_in
        a = layer_cost(graph, sh, mesh, plain, "fp32", 16.0, inputs)
        b = layer_cost(graph, sh, mesh, dt, "fp32", 16.0, inputs)
        ops = sum(max(len(n.ops), 1) for n in graph.nodes)
        assert b.u_f - a.u_f == pytest.approx(ops * D, rel=1e-9)
        assert b.u_b - a.u_b == pytest.approx(ops * D, rel=1e-9)
        # communication and memory are not touched
        assert (b.u_fcomm, b.u_bcomm, b.w_a, b.w_abar, b.o_f, b.o_b) == (a.u_fcomm, a.u_bcomm, a.w_a, a.w_abar, a.o_f,
                                                                          a.o_b)
        specs_in = {"x": a.output_spec}


# ---- mode=calibrate ----------------------------------------------------------------------------

def _measurements(**ranks) -> dict:
    r = {"matmul_fp32_1024_flops_per_s": 3e10, "matmul_bf16_256_flops_per_s": 6e8, "matmul_fp16_256_flops_per_s": 6e8,
         "copy_gbps": 5.0, "p2p_alpha_s": 2e-4, "p2p_beta": 1.5e9, "ar_ring_bw_gbps": 0.6, "ar_ring_latency_s": 6e-4,
         "p2p_residuals": [0.0] * 6, "ar_residuals": [0.0] * 6, "ar_alpha_s": 4e-3, "ar_beta": 8e8,
         "ar_busbw_gbps": 0.6, "op_overhead_s": 2.5e-5, "ops_per_block_pass": 104, **ranks}
    return {"ranks": r, "world": 4, "cuda": False, "torch": "x", "load_average": 0.5, "elapsed_s": 1.0,
            "cpu_adam_params_per_s": 3e8, "gemm_sweep": {}}


def test_calibrated_yaml_carries_the_dtensor_rate():
    from calibration.hardware_file import hardware_yaml

    base = yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text())
    base["device"].pop("dtensor_op_overhead_s")
    text = hardware_yaml(base, _measurements(dtensor_op_overhead_s=1.4249e-4, dtensor_ops_per_block_pass=96,
                                             dtensor_plain_op_s=1.6e-5), "measured")
    hw = HardwareSpec.model_validate(yaml.safe_load(text))
    assert hw.device.dtensor_op_overhead_s == pytest.approx(1.42e-4)
    assert "DTensor extra per operator 142.5 us" in text and "96 DTensor operators" in text
    # an older measurement without it keeps the base's value
    hw = HardwareSpec.model_validate(yaml.safe_load(hardware_yaml(base, _measurements(), "measured")))
    assert hw.device.dtensor_op_overhead_s == 0.0


def test_measurement_counts_the_blocks_dtensor_operators():
    """The calibration's DTensor block dispatches exactly what TP_DTENSOR_OPS charges a block."""
    import torch.distributed as dist

    from calibration.link_bench import free_port
    from calibration.dtensor import dtensor_op_overhead_s

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        per_op, ops, plain = dtensor_op_overhead_s(dist.group.WORLD, seconds=0.01, windows=1)
    finally:
        dist.destroy_process_group()
    assert ops == sum(costs.layer_time.TP_DTENSOR_OPS[LayerKind.transformer_block])
    assert per_op >= 0.0 and math.isfinite(per_op) and plain > 0.0
