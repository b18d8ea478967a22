"""Context parallelism in the executor (issue 27; executor/context_parallel.py): refused before any
rank starts, with the reason a real 2-rank gloo run of torch's ring attention gives on CPU; the
rank bookkeeping (executor/topology.py) knows the dp x cp x tp order all the same."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from executor import UnsupportedPlan, execute, run_plan, unsupported
from executor.context_parallel import CPU_SDPA_OP, cpu_ring_attention_op_handled
from executor.topology import coords, cp_group_devices, mesh_coords
from planners import make_plan
from planners.policy import ManualPolicy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, conf
from costs.families import build_model

HW4 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 4})
SPEC = build_model(GPT_TINY, 4)


def _plan(cp: int, tp: int = 1, dp: int = 1, pp: int = 1):
    return make_plan(ManualPolicy(pp=pp, dp=dp, tp=tp, cp=cp), SPEC, HW4, CPU_TRAINING, ScheduleSpec(kind="1f1b"))


def test_cp_plans_are_refused_before_launch_with_the_reason():
    plan = _plan(cp=2, tp=2)
    problems = unsupported(plan, GPT_TINY)
    assert [p for p in problems if p.startswith("stages[0].cp: 2:")], problems
    assert any(CPU_SDPA_OP in p for p in problems)
    assert not [p for p in unsupported(_plan(cp=1, tp=2, dp=2), GPT_TINY) if ".cp:" in p]
    with pytest.raises(UnsupportedPlan, match=r"stages\[0\]\.cp"):
        run_plan(plan, GPT_TINY, iterations=1, timeout_s=5.0)
    result = execute(plan, GPT_TINY, HW4, iterations=1, warmup=0, timeout_s=5.0, device="cpu")
    assert result.failure and "cp" in result.failure


def test_topology_orders_tp_then_cp_then_dp():
    """devices[(r*cp + c)*tp + t]: replica r, cp rank c, tp rank t (specs/plan_stage.py)."""
    st = _plan(cp=2, tp=2).stages[0]
    assert [mesh_coords(st, d) for d in st.devices] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert cp_group_devices(st) == [[st.devices[0], st.devices[2]], [st.devices[1], st.devices[3]]]
    st = _plan(cp=2, dp=2).stages[0]
    assert [mesh_coords(st, d) for d in st.devices] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    plain = _plan(cp=1, tp=2, dp=2).stages[0]
    assert cp_group_devices(plain) == []
    assert all(mesh_coords(plain, d)[::2] == coords(plain, d) for d in plain.devices)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ring_attention_rank(rank: int, world: int, port: int, queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            try:
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
                queue.put((rank, "ran"))
            except Exception as exc:  # noqa: BLE001 - the error is the result
                queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(cpu_ring_attention_op_handled(), reason="this torch handles the CPU SDPA op in ring attention")
def test_torch_ring_attention_fails_on_cpu_gloo_as_the_refusal_says():
    """The refusal's reason, reproduced: 2 gloo ranks, causal SDPA under torch's context_parallel."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ring_attention_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert set(got) == {0, 1}
    for msg in got.values():
        assert msg.startswith("NotImplementedError") and CPU_SDPA_OP in msg, msg
