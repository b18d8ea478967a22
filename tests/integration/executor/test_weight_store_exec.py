"""``schedule.weight_store`` in the executor (executor.weight_store: the Zero Bubble paper's own
WeightGradStore, Qi et al. 2024): B is the stage's whole backward with each Linear's weight
gradient deferred, W computes dW = dY^T X from the stored pairs.

- A split-backward stage built with the field runs executor.weight_store.WeightStore (without it,
  executor.split_backward.SplitBackward).
- gloo ranks, float64, against the single-process reference (losses, gradients, weights within
  the reduction-order bound; one W per stage, microbatch and iteration): gpt_tiny pp 2 zb_h1;
  llama_tiny pp 2 zbv (a V: chunks 0 and 3 on rank 0, handed over in memory on rank 1) with one
  recomputed layer; gpt_tiny pp 2 zb_h1 and dualpipev; gpt_tiny pp 2 x dp 2 with
  overlap_grad_reduce under zb_h1 (buckets reduced as W completes them; also with the distributed
  optimizer) and zbv (the V's shared embedding/head reduced at the flush, after both stages' sums);
  pp 2 x tp 2 (DTensor Linears): gpt_tiny zb_h1 and zbv, llama_tiny zb_h1 with sequence parallelism.
- the bytes a tp 2 stage's B leaves for W, on each TP rank (gloo), are simulator.stagecost's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from costs.families import build_model, parse_model_config
from executor.memtrack import NullTracker
from executor.reference import train_reference
from executor.split_backward import SplitBackward, unsupported
from executor.stage import StageRuntime
from executor.weight_store import WeightStore
from planners import make_plan, parse_policy
from specs.hardware import HardwareSpec
from specs.plan import SPLIT_BACKWARD, LayerMemory, MemoryAction, ScheduleSpec
from specs.schedule import ActionKind, build_schedule
from tests.conftest import CPU_TRAINING, GPT_TINY, conf, longest_reduction, reorder_rtol, run_plan_float64

TRAINING = CPU_TRAINING
LLAMA_TINY = parse_model_config(conf("model", "llama_tiny"))
HW2 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})  # 2 ranks
HW4 = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
F64 = torch.float64
STEPS = 2


def _plan(cfg, schedule: str, hw=HW2, store: bool = True, **policy):
    return make_plan(parse_policy({"kind": "manual" if hw is HW4 else "even", "pp": 2, **policy}),
                     build_model(cfg, 4), hw, TRAINING, ScheduleSpec(kind=schedule, weight_store=store))


@pytest.mark.parametrize("store", [True, False])
def test_stage_runs_the_weight_store_when_planned(store):
    plan = _plan(GPT_TINY, "zb_h1", store=store)
    rt = StageRuntime(plan, GPT_TINY, 1, plan.stages[1].devices[0], {d: d for d in plan.used_devices()}, {},
                      torch.device("cpu"), 0, NullTracker(), F64)
    assert type(rt.split) is (WeightStore if store else SplitBackward)


def _check_run(plan, cfg, reference, what: str = "grads") -> None:
    assert plan.schedule.kind in SPLIT_BACKWARD and plan.schedule.weight_store
    assert not unsupported(plan, cfg)
    lists = build_schedule(plan)
    w = [(a.stage, a.microbatch) for acts in lists.values() for a in acts if a.kind is ActionKind.backward_weight]
    assert sorted(set(w)) == [(s, k) for s in range(len(plan.stages)) for k in range(TRAINING.microbatches)]
    out = run_plan_float64(plan, cfg, iterations=STEPS)
    assert out.failure is None, out.failure
    tol = reorder_rtol(longest_reduction(cfg, TRAINING))
    np.testing.assert_allclose(out.losses, reference["losses"], rtol=tol)
    for kind in sorted({what, "params"}):
        got = {k: v for rep in out.reports.values() for k, v in rep[kind].items()}
        assert sorted(got) == sorted(reference[kind])
        scale = max(float(np.abs(v).max()) for v in reference[kind].values())
        for key, want in reference[kind].items():
            np.testing.assert_allclose(got[key], want, rtol=tol, atol=tol * scale, err_msg=f"{kind} {key}")
    # every B had its W: one W pass per stage, microbatch and iteration on each replica and tp rank
    replicas = plan.stages[0].dp * plan.stages[0].tp
    assert sum(rep["w_passes"] for rep in out.reports.values()) == \
        STEPS * len(plan.stages) * TRAINING.microbatches * replicas


@pytest.fixture(scope="module")
def gpt_reference() -> dict:
    return train_reference(GPT_TINY, TRAINING, STEPS, dtype=F64)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb_h1", "dualpipev"])
def test_gpt_pp2_matches_reference(schedule, gpt_reference):
    _check_run(_plan(GPT_TINY, schedule), GPT_TINY, gpt_reference)


@pytest.mark.slow
def test_llama_zbv_with_a_recomputed_layer_matches_reference():
    """llama_tiny on a V (zbv), the last block of rank 1's first chunk recomputed
    (``torch.utils.checkpoint``): W's X is the one B's unpack re-made."""
    plan = _plan(LLAMA_TINY, "zbv")
    assert len(plan.used_devices()) == 2 and len(plan.stages) == 4
    i = next(i for i, st in enumerate(plan.stages) if st.layer_stop - st.layer_start >= 1 and 0 < i < 3)
    st = plan.stages[i]
    memory = [LayerMemory(layer=st.layer_stop - 1, action=MemoryAction.recompute)]
    plan = plan.model_copy(update={"stages": [s if j != i else st.model_copy(update={"memory": memory})
                                              for j, s in enumerate(plan.stages)]})
    _check_run(plan, LLAMA_TINY, train_reference(LLAMA_TINY, TRAINING, STEPS, dtype=F64))


@pytest.mark.slow
@pytest.mark.parametrize("name,schedule,sp", [("gpt_tiny", "zb_h1", False), ("llama_tiny", "zb_h1", True),
                                              ("gpt_tiny", "zbv", False)])
def test_pp2_tp2_matches_reference(name, schedule, sp, gpt_reference):
    """Megatron TP (executor.megatron_tp, DTensor Linears), with sequence parallelism for llama:
    each TP rank stores its local X and dY (column-parallel: the whole, under sequence parallelism
    all-gathered, X and its dY shard; row-parallel: its X shard and the whole dY) and W makes its
    weight's own shard; dX and the biases' gradients are DTensor's ops, with DTensor's placements."""
    cfg = GPT_TINY if name == "gpt_tiny" else LLAMA_TINY
    plan = _plan(cfg, schedule, hw=HW4, tp=2, **({"sequence_parallel": True} if sp else {}))
    assert all(st.tp == 2 and st.sequence_parallel == sp for st in plan.stages)
    reference = gpt_reference if cfg is GPT_TINY else train_reference(cfg, TRAINING, STEPS, dtype=F64)
    _check_run(plan, cfg, reference)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,zero1", [("zb_h1", False), ("zbv", False), ("zb_h1", True)],
                         ids=["zb_h1", "zbv", "zb_h1-zero1"])
def test_gpt_pp2_dp2_overlapped_reduction_matches_reference(schedule, zero1, gpt_reference):
    """Overlapped dp reduction (executor.zero1), also with the distributed optimizer (ZeRO-1: each
    reduced gradient lives in its rank's shard only, so the weights are compared)."""
    plan = _plan(GPT_TINY, schedule, hw=HW4, dp=2, overlap_grad_reduce=True, distributed_optimizer=zero1)
    assert plan.overlap_grad_reduce and len(plan.used_devices()) == 4 and (plan.zero_stage == 1) == zero1
    _check_run(plan, GPT_TINY, gpt_reference, what="params" if zero1 else "grads")


def _bytes_rank(rank: int, world: int, port: int, queue, name: str, owned: range, sp: bool) -> None:
    import os

    import torch.distributed as dist

    from tests.unit.simulator.test_zero_bubble import _executor_split_bytes, _profiled

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg, _ = _profiled(name)
        queue.put((rank, _executor_split_bytes(cfg, owned, False, store=True, tp=True, sequence_parallel=sp)))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        import traceback

        queue.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name,where,sp", [("gpt_tiny", "first", False), ("gpt_tiny", "last", False),
                                           ("llama_tiny", "middle", True), ("llama_tiny", "last", True)])
def test_tp2_held_bytes_are_the_simulated_ones(name, where, sp):
    """What a tp 2 stage's B leaves for W on each TP rank (gloo, executor.memtrack.LiveTensorTracker,
    float32, 2 samples; the harness of tests/unit/simulator/test_zero_bubble.py) is byte for byte
    simulator.stagecost.stored_bytes (column-parallel dY and row-parallel X split over t, the
    column-parallel X whole: under sequence parallelism the all-gathered sequence), which
    store_split_bytes adds less the activations; W frees exactly that."""
    import torch.multiprocessing as mp

    from executor.launch import free_port
    from simulator.stagecost import store_split_bytes, stored_bytes
    from costs.activations import stage_activation_bytes
    from tests.unit.simulator.test_zero_bubble import _profiled, _slice_plan

    _, model = _profiled(name)
    n = model.num_layers
    owned = {"first": range(0, 2), "middle": range(1, 3), "last": range(n - 2, n)}[where]
    plan, s = _slice_plan(model, owned, False, tp=2, sequence_parallel=sp)
    plan = plan.model_copy(update={"schedule": ScheduleSpec(kind="zb_h1", weight_store=True)})
    stage = plan.stages[s]
    store = sum(stored_bytes(model, plan, stage, l) for l in stage.layers)
    held, scratch = store_split_bytes(model, plan, stage)
    assert held + stage_activation_bytes(model, plan, stage) == store
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_bytes_rank, args=(r, 2, port, queue, name, owned, sp)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r in range(2):
        assert isinstance(got[r], dict), got[r]
        assert (got[r]["stored"], got[r]["w_frees"], got[r]["w_excess"]) == (store, store, scratch), (r, got[r])  # one weight's local dW at a time
