"""executor.weight_store (schedule.weight_store: the Zero Bubble paper's WeightGradStore, Qi et al.
2024) on one stage in one process, float64:

- B (the stage's whole backward with each Linear's weight gradient deferred) then W (dW = dY^T X
  from the stored pairs) leaves bitwise the input gradients and ``.grad`` of one ordinary backward
  per microbatch: gpt, llama and bert stages (first, middle, last), layers kept, recomputed
  (``torch.utils.checkpoint``) or selectively recomputed (executor.selective);
- B alone sums every gradient but the Linear weights' (those wait, one stored pair per Linear call);
- after B only the stored X and dY (and the input gradient to send) are alive: the graph is freed;
- with overlap_grad_reduce every parameter is counted once per microbatch (autograd's
  post-accumulate hook in B, ``zero1.grad_ready`` in W), as in a whole backward;
- a backward outside B (a benchmark's 1F1B iteration) sums the weight gradients at once;
- executor.split_backward.unsupported refuses families other than gpt, bert, llama; tp > 1 (and
  sequence parallelism) is run (tests/integration/executor/test_weight_store_exec.py), as
  specs.plan validates it.
"""
from __future__ import annotations

import types

import pytest
import torch

from costs.families import build_model, parse_model_config
from executor.memtrack import LiveTensorTracker, NullTracker
from executor.models import build_layers, make_batch, output_shapes
from executor.split_backward import unsupported
from executor.stage_passes import StagePasses
from executor.weight_store import WeightStore
from planners import make_plan, parse_policy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, conf, run_layers

F64 = torch.float64
CFGS = {name: parse_model_config(conf("model", name)) for name in ("gpt_tiny", "llama_tiny", "bert_tiny")}


class _Stage(StagePasses):
    """The state StagePasses.backward and WeightStore read of an executor.stage.StageRuntime."""

    def __init__(self, layers, first: bool, last: bool, zero1=None):
        self.layers, self.first, self.last, self.zero1 = layers, first, last, zero1
        self.params = list({id(p): p for _, _, mod in layers for p in mod.parameters()}.values())
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.outputs, self.inputs = {}, {}
        self.vocab_parallel = self.release_outputs = False
        self.tracker = NullTracker()
        self.bounds = self.workers = self.pipedream = self.swapper = self.weight_swap = self.window = None
        self.index = 1
        self.plan = types.SimpleNamespace(schedule=ScheduleSpec(kind="zb_h1", weight_store=True))


def _owned(cfg, where: str) -> range:
    n = len(output_shapes(cfg))
    return {"first": range(0, 2), "middle": range(1, 3), "last": range(2, n)}[where]


def _forward(st, cfg, owned, recompute: str, k: int, batch, gen):
    x = None if st.first else torch.randn((2, *output_shapes(cfg)[owned.start - 1]), generator=gen,
                                          dtype=F64).requires_grad_(True)
    mb = {key: v[2 * k:2 * k + 2] for key, v in batch.items()}
    y = run_layers(st.layers, x, mb, recompute)
    grad = None if st.last else torch.randn(y.shape, generator=gen, dtype=F64)
    st.outputs[k], st.inputs[k] = y, x
    return grad


def _run(cfg, store: bool, recompute: str, where: str, m: int = 2, zero1=None, check_b=None):
    """Input gradients and ``.grad`` after m microbatches: ordinary backward each, or B (all) then W (all)."""
    owned = _owned(cfg, where)
    st = _Stage(build_layers(cfg, owned, "cpu", 0, F64), where == "first", where == "last", zero1)
    ws = WeightStore(st) if store else None
    batch = make_batch(cfg, 2 * m, 0, 0, F64)
    gen = torch.Generator().manual_seed(1)
    dx = []
    for k in range(m):
        grad = _forward(st, cfg, owned, recompute, k, batch, gen)
        if store:
            ws.input_pass(k, grad)
        else:
            st.backward(k, grad)
        dx.append(st.grad_to_send)
    if store:
        if check_b is not None:
            check_b(st, ws)
        for k in range(m):
            ws.weight_pass(k)
        assert ws.w_passes == m and not ws.pending
        ws.check_done()
    return dx, {name: p.grad.clone() for name, p in _names(st).items()}


def _names(st) -> dict:
    return {f"{i}.{n}": p for i, _, mod in st.layers for n, p in mod.named_parameters()}


def _linear_weights(st) -> set[int]:
    return {id(m.weight) for _, _, mod in st.layers for m in mod.modules() if isinstance(m, torch.nn.Linear)}


CASES = ([("gpt_tiny", w, r) for w in ("first", "middle", "last") for r in ("keep", "full", "selective")]
         + [("llama_tiny", w, "keep") for w in ("first", "middle", "last")]
         + [("llama_tiny", "middle", "full"), ("llama_tiny", "last", "selective"),
            ("bert_tiny", "first", "keep"), ("bert_tiny", "middle", "full"), ("bert_tiny", "last", "keep")])


@pytest.mark.parametrize("model,where,recompute", CASES, ids=["-".join(c) for c in CASES])
def test_b_then_w_bitwise_equals_one_backward(model, where, recompute):
    cfg = CFGS[model]
    dx_ref, g_ref = _run(cfg, False, recompute, where)
    after_b = {}

    def check_b(st, ws):
        linears = _linear_weights(st)
        for name, p in _names(st).items():
            after_b[name] = (id(p) in linears, p.grad.clone())
        # one stored pair per Linear call per microbatch, each a Linear of the stage
        calls = sum(1 for _, _, mod in st.layers for mm in mod.modules() if isinstance(mm, torch.nn.Linear))
        assert all(len(v) == calls for v in ws.pending.values()) and len(ws.pending) == 2

    dx, g = _run(cfg, True, recompute, where, check_b=check_b)
    for a, b in zip(dx, dx_ref):
        assert (a is None and b is None) or torch.equal(a, b)
    assert sorted(g) == sorted(g_ref)
    for name, want in g_ref.items():
        assert float(want.abs().max()) > 0, name
        assert torch.equal(g[name], want), name
        deferred, got_b = after_b[name]
        # B summed every gradient but the Linear weights' (those wait for W)
        assert torch.equal(got_b, torch.zeros_like(want) if deferred else want), name


@pytest.mark.parametrize("recompute", ["keep", "full"])
def test_after_b_only_stored_inputs_and_output_grads_live(recompute):
    """B frees its graph (no retain_graph): what the forward saved goes, only each Linear's X and dY
    (q, k, v's one X once) and the input gradient stay; W drops them."""
    cfg = CFGS["gpt_tiny"]
    owned = _owned(cfg, "middle")
    st = _Stage(build_layers(cfg, owned, "cpu", 0, F64), False, False)
    ws = WeightStore(st)
    batch = make_batch(cfg, 2, 0, 0, F64)
    tracker = LiveTensorTracker()
    with tracker:
        for p in st.params:
            tracker.tag(p.grad, "gradients")
        grad = _forward(st, cfg, owned, recompute, 0, batch, torch.Generator().manual_seed(1))
        ws.input_pass(0, grad)
        del grad
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for _, x, dy in ws.pending[0] for t in (x, dy)}
        send = st.grad_to_send.untyped_storage().nbytes()
        assert tracker.totals["activations"] == sum(held.values()) + send
        # q, k and v of each block read one X: fewer storages than stored pairs' tensors
        assert len(held) < 2 * len(ws.pending[0])
        ws.weight_pass(0)
        assert tracker.totals["activations"] == send
    assert st.grad_to_send is not None


@pytest.mark.parametrize("recompute", ["keep", "full"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_every_parameter_counted_once_per_microbatch(where, recompute):
    """overlap_grad_reduce (executor.zero1): a Linear's weight, entering the Function detached, gets
    no AccumulateGrad call in B (one with no gradient would still fire its post-accumulate hook);
    W tells the bucket instead. Every parameter is counted m times, as in whole backward passes."""
    cfg = CFGS["gpt_tiny"]
    m, counts = 3, {}
    zero1 = types.SimpleNamespace(overlap_grad=True,
                                  grad_ready=lambda p: counts.__setitem__(id(p), counts.get(id(p), 0) + 1))
    owned = _owned(cfg, where)
    st = _Stage(build_layers(cfg, owned, "cpu", 0, F64), where == "first", where == "last", zero1)
    for p in st.params:  # Zero1's own hook
        p.register_post_accumulate_grad_hook(zero1.grad_ready)
    ws = WeightStore(st)
    batch = make_batch(cfg, 2 * m, 0, 0, F64)
    gen = torch.Generator().manual_seed(1)
    for k in range(m):
        ws.input_pass(k, _forward(st, cfg, owned, recompute, k, batch, gen))
    linears = _linear_weights(st)
    assert all(counts.get(id(p), 0) == (0 if id(p) in linears else m) for p in st.params)
    for k in range(m):
        ws.weight_pass(k)
    assert {counts.get(id(p)) for p in st.params} == {m}


def test_backward_outside_b_sums_weight_grads_at_once():
    """A whole backward run outside B (executor.worker's alternating benchmark runs 1F1B iterations
    on a split plan) gives the ordinary gradients: nothing is left stored."""
    cfg = CFGS["llama_tiny"]
    _, g_ref = _run(cfg, False, "keep", "middle")
    owned = _owned(cfg, "middle")
    st = _Stage(build_layers(cfg, owned, "cpu", 0, F64), False, False)
    ws = WeightStore(st)
    batch = make_batch(cfg, 4, 0, 0, F64)
    gen = torch.Generator().manual_seed(1)
    for k in range(2):
        st.backward(k, _forward(st, cfg, owned, "keep", k, batch, gen))
    assert not ws.pending
    for name, p in _names(st).items():
        assert torch.equal(p.grad, g_ref[name]), name


def test_unsupported_refuses_other_families_not_tp():
    hw = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
    gpt = CFGS["gpt_tiny"]
    store = ScheduleSpec(kind="zb_h1", weight_store=True)

    def plan_of(cfg, **policy):
        plan = make_plan(parse_policy({"kind": "manual", **policy}), build_model(cfg, 4), hw, CPU_TRAINING,
                         ScheduleSpec(kind="zb_h1"))
        return plan.model_copy(update={"schedule": store})  # past validate_plan's own check

    assert not unsupported(plan_of(gpt, pp=2, dp=2), gpt)
    assert not unsupported(plan_of(gpt, pp=2, tp=2), gpt)
    # tensor parallel, with and without sequence parallelism: planned (validate_plan) and run
    for cfg, sp in ((gpt, False), (CFGS["llama_tiny"], True)):
        plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "tp": 2, "sequence_parallel": sp}),
                         build_model(cfg, 4), hw, CPU_TRAINING, store)
        assert plan.schedule.weight_store and all(st.tp == 2 and st.sequence_parallel == sp for st in plan.stages)
        assert not unsupported(plan, cfg)
    moe = parse_model_config(conf("model", "moe_tiny"))
    why = unsupported(plan_of(moe, pp=2, dp=2), moe)
    assert len(why) == 1 and why[0].startswith("model.family: schedule.weight_store") and "gpt, bert, llama" in why[0]
    # without the store the same plans are not refused for it
    assert not unsupported(plan_of(moe, pp=2, dp=2).model_copy(update={"schedule": ScheduleSpec(kind="zb_h1")}), moe)
