"""Executor building blocks that need no process group: torch modules against the model specs,
boundary routes between differently shaped stage meshes, and the live-tensor tracker."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import yaml

from executor.memtrack import LiveTensorTracker
from executor.models import build_layers, layer_names_and_params, make_batch, output_shapes
from executor.topology import process_groups, routes
from costs.families import build_model, parse_model_config
from specs.plan import Plan, StagePlan
from specs.training import TrainingSpec

CONF = Path(__file__).resolve().parents[3] / "conf"
TINY = ["gpt_tiny", "bert_tiny", "moe_tiny", "wresnet_tiny"]


def tiny(name: str):
    return parse_model_config(yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("name", TINY)
def test_layers_equal_the_spec_names_order_and_params(name):
    cfg = tiny(name)
    spec = build_model(cfg, 4)
    assert layer_names_and_params(cfg) == [(layer.name, layer.params) for layer in spec.layers]


@pytest.mark.parametrize("name", TINY)
def test_output_shapes_match_spec_boundary_bytes(name):
    cfg = tiny(name)
    spec = build_model(cfg, 4)
    for shape, layer in zip(output_shapes(cfg), spec.layers):
        assert 4 * int(torch.Size(shape).numel()) == layer.output_bytes_per_sample, layer.name


@pytest.mark.parametrize("name", TINY)
def test_whole_model_runs_forward_and_backward(name):
    cfg = tiny(name)
    batch, x = make_batch(cfg, 2, step=0), None
    for _, _, mod in build_layers(cfg):
        x = mod(x, batch)
    x.backward()
    assert x.ndim == 0 and torch.isfinite(x)


def test_stage_materialises_only_its_layers_with_the_same_weights():
    cfg = tiny("gpt_tiny")
    whole = build_layers(cfg)
    part = build_layers(cfg, owned=range(2, 4))
    assert [(i, n) for i, n, _ in part] == [(2, "block_01"), (3, "block_02")]
    for (i, _, a), (_, _, b) in zip(part, whole[2:4]):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert pa.device.type == "cpu" and torch.equal(pa, pb)
    # a different seed gives different weights
    other = build_layers(cfg, owned=range(2, 3), seed=1)[0][2]
    assert not torch.equal(other.attn.q.weight, whole[2][2].attn.q.weight)


def _plan(stages: list[dict], batch: int = 8, mb: int = 4) -> Plan:
    return Plan(planner="manual", model="m", hardware="hw", num_devices=4,
                training=TrainingSpec(global_batch=batch, microbatch_size=mb),
                stages=[StagePlan(**s) for s in stages])


def test_routes_reshard_dp2_to_tp2_along_the_batch_dim():
    plan = _plan([dict(layer_start=0, layer_stop=1, devices=[0, 1], dp=2),
                  dict(layer_start=1, layer_stop=2, devices=[2, 3], tp=2)])
    fwd = routes(plan, 0, 1)
    # each TP rank of stage 1 needs the whole microbatch: rows 0-2 from replica 0, 2-4 from replica 1
    assert sorted(fwd) == sorted([(0, 2, 0, 2), (1, 2, 2, 4), (0, 3, 0, 2), (1, 3, 2, 4)])
    bwd = routes(plan, 1, 0)
    # gradients go back: replica r of stage 0 gets its rows from a TP rank of stage 1
    assert sorted(bwd) == [(2, 0, 0, 2), (2, 1, 2, 4)]


@pytest.mark.parametrize("src,dst", [((4, 1), (2, 2)), ((2, 2), (4, 1)), ((1, 4), (4, 1)), ((2, 1), (1, 2))])
def test_routes_cover_every_receivers_rows_exactly_once(src, dst):
    (dp_a, tp_a), (dp_b, tp_b) = src, dst
    n_a, n_b = dp_a * tp_a, dp_b * tp_b
    plan = Plan(planner="manual", model="m", hardware="hw", num_devices=n_a + n_b,
                training=TrainingSpec(global_batch=8, microbatch_size=4),
                stages=[StagePlan(layer_start=0, layer_stop=1, devices=list(range(n_a)), dp=dp_a, tp=tp_a),
                        StagePlan(layer_start=1, layer_stop=2, devices=list(range(n_a, n_a + n_b)), dp=dp_b, tp=tp_b)])
    for a, b in ((0, 1), (1, 0)):
        receivers = plan.stages[b]
        for j, device in enumerate(receivers.devices):
            replica = j // receivers.tp
            per = 4 // receivers.dp
            rows = sorted((r.start, r.stop) for r in routes(plan, a, b) if r.dst_device == device)
            covered = [i for lo, hi in rows for i in range(lo, hi)]
            assert covered == list(range(replica * per, (replica + 1) * per))
            assert all(r.src_device in plan.stages[a].devices for r in routes(plan, a, b))


def test_process_groups_are_listed_per_replica_and_tp_rank():
    plan = _plan([dict(layer_start=0, layer_stop=1, devices=[0, 1, 2, 3], dp=2, tp=2)])
    assert process_groups(plan) == [("tp", 0, 0, [0, 1]), ("tp", 0, 1, [2, 3]),
                                    ("dp", 0, 0, [0, 2]), ("dp", 0, 1, [1, 3])]


def test_tracker_counts_what_dtensor_allocates_inside_an_op():
    """A DTensor op's sharding rule runs local ops whose temporaries are real memory: torch's
    loss_parallel backward builds the fused log-softmax + NLL gradient from a zeros tensor, exp of
    the log-probabilities and their sum, three logits-sized tensors live at once
    (torch.distributed.tensor.parallel.loss._nll_loss_and_log_softmax_backward). The tracker must
    see them, not only the one-logits result the DTensor op hands back. One gloo rank: the shard
    is the whole vocabulary, the same code path as under tp > 1."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from calibration.link_bench import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tokens, vocab = 64, 256
        logits_bytes = tokens * vocab * 4
        mesh = DeviceMesh("cpu", [0])
        x = distribute_tensor(torch.randn(tokens, vocab), mesh, [Shard(-1)]).requires_grad_(True)
        targets = torch.randint(0, vocab, (tokens,))
        tracker = LiveTensorTracker()
        with tracker, loss_parallel():
            loss = F.cross_entropy(x, targets)
            tracker.reset_peak()
            before = tracker.total_bytes
            loss.backward()
    finally:
        dist.destroy_process_group()
    assert tracker.peak_bytes - before >= 3 * logits_bytes


def test_tracker_counts_live_storages_once_and_sees_frees():
    tracker = LiveTensorTracker()
    w = torch.zeros(256)  # made outside: only counted once tagged
    tracker.tag(w, "parameters")
    with tracker:
        a = torch.ones(1024)  # 4 KiB
        view = a[:10]  # same storage: no new bytes
        with tracker.phase("buffers"):
            b = torch.empty(512)
        assert tracker.total_bytes == 1024 + 4096 + 2048
        del a, view, b
        gc.collect()
        c = torch.ones(100)
    assert tracker.peak_bytes == 1024 + 4096 + 2048
    assert tracker.peak_breakdown == {"parameters": 1024, "gradients": 0, "optimizer": 0,
                                      "activations": 4096, "buffers": 2048, "swapped": 0, "stashed": 0}
    assert tracker.total_bytes == 1024 + 400
    tracker.tag(c, "gradients")  # re-filing moves bytes between categories
    assert tracker.totals["gradients"] == 400 and tracker.totals["activations"] == 0
