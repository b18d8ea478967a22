"""Zero-bubble schedules (Qi et al. 2024; DeepSeek-V3's DualPipeV): their pass orders against
torch's, the Action lists walked without deadlock, the closed forms of their in-flight activations
and bubbles, and the simulator's B/W pricing on a uniform model.

Oracles: torch.distributed.pipelining's own generators (ScheduleInterleavedZeroBubble with one
stage per rank is ZB-H1, ScheduleZBVZeroBubble, ScheduleDualPipeV), called on a stand-in ``self``
that carries only the counts they read (their constructors need process groups and real stages);
the papers' closed forms; an independent unit-time walk of the Action lists written here."""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest

from simulator import simulate
from simulator.analytic import estimate, split_peak
from simulator.pipe_walk import split_pipe_s
from simulator.stagecost import stage_costs
from specs import (
    DeviceSpec, HardwareSpec, HostSpec, LayerKind, LayerSpec, LinkKind, LinkSpec, ModelSpec,
    NodeTopology, Plan, ScheduleSpec, StagePlan, TrainingSpec,
)
from specs.model import GemmSpec
from specs.plan import LayerMemory, MemoryAction, PlanError, ScheduleKind, position_of_stage, validate_plan
from specs.schedule import ActionKind, build_schedule, compute_order, pairs

GIB = 1 << 30
SPLIT = ("zb_h1", "zbv", "dualpipev")


def chunks_of(kind: str) -> int:
    return 2 if kind in ("zbv", "dualpipev") else 1


def make_plan(kind: str, p: int, m: int, layers_per_stage: int = 1, dp: int = 1, memory=None) -> Plan:
    n = p * chunks_of(kind)
    stages = []
    for j in range(n):
        pos = position_of_stage(ScheduleKind(kind), p, j)
        stages.append(StagePlan(layer_start=j * layers_per_stage, layer_stop=(j + 1) * layers_per_stage,
                                devices=list(range(pos * dp, pos * dp + dp)), dp=dp,
                                memory=(memory or {}).get(j, [])))
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=p * dp,
                training=TrainingSpec(global_batch=m * dp, num_microbatches=m), schedule=ScheduleSpec(kind=kind),
                stages=stages)


# ---- the orders against torch's generators ---------------------------------------------------------
def torch_order(kind: str, p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {"zb_h1": ts.ScheduleInterleavedZeroBubble, "zbv": ts.ScheduleZBVZeroBubble,
           "dualpipev": ts.ScheduleDualPipeV}[kind]
    rounds = max(1, m // p)
    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p, _num_stages=2 * p,
                         n_local_stages=1, microbatches_per_round=m // rounds)
    C = ts._ComputationType
    short = {C.FORWARD: "F", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W"}
    out = []
    for a in cls._calculate_single_rank_operations(me, rank):
        if a is None:  # a step where torch's rank idles
            continue
        for x in (a.sub_actions if a.computation_type == C.OVERLAP_F_B else (a,)):
            if x.computation_type == C.FULL_BACKWARD:  # a whole backward: B, then W at once
                out += [("B", x.stage_index, x.microbatch_index), ("W", x.stage_index, x.microbatch_index)]
            else:
                out.append((short[x.computation_type], x.stage_index, x.microbatch_index))
    return out


def torch_cases():
    for p in (1, 2, 3, 4, 5, 8):
        for m in sorted({1, 2, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p + 2}):
            for kind in SPLIT:
                if kind == "dualpipev" and m < 2 * p:
                    continue
                if kind == "zb_h1" and m % max(1, m // p):  # torch refuses these m
                    continue
                yield kind, p, m


@pytest.mark.parametrize("kind,p,m", list(torch_cases()))
def test_order_is_torchs(kind, p, m):
    for rank in range(p):
        assert compute_order(ScheduleKind(kind), p, m, chunks_of(kind), rank) == torch_order(kind, p, m, rank)


# ---- the Action lists, walked ----------------------------------------------------------------------
def unit_walk(plan: Plan, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> tuple[list[float], list[float]]:
    """Walk every position's Action list at once with free communication: a recv waits for its
    matching send (sends never wait); F, B, W take ``f``, ``b``, ``w`` (a whole backward b + w).
    Returns (finish, busy) per position; raises on a deadlock."""
    lists = build_schedule(plan)
    p = len(lists)
    split = plan.schedule.kind.value in SPLIT
    dur = {ActionKind.forward: f, ActionKind.backward: b if split else b + w, ActionKind.backward_weight: w}
    at, clock, busy, sent = [0] * p, [0.0] * p, [0.0] * p, {}
    while any(at[i] < len(lists[i]) for i in range(p)):
        moved = False
        for i in range(p):
            while at[i] < len(lists[i]):
                a = lists[i][at[i]]
                if a.kind in (ActionKind.recv_act, ActionKind.recv_grad):
                    if pairs(a) not in sent:
                        break
                    clock[i] = max(clock[i], sent[pairs(a)])
                elif a.kind in (ActionKind.send_act, ActionKind.send_grad):
                    sent[pairs(a)] = clock[i]
                elif a.kind in dur:
                    clock[i] += dur[a.kind]
                    busy[i] += dur[a.kind]
                at[i] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: positions stuck at {at}")
    return clock, busy


def walk_cases():
    for p in (1, 2, 3, 4, 6):
        for m in sorted({1, 2, p, 2 * p, 2 * p + 3, 4 * p}):
            for kind in SPLIT:
                if not (kind == "dualpipev" and m < 2 * p):
                    yield kind, p, m


@pytest.mark.parametrize("kind,p,m", list(walk_cases()))
def test_lists_complete_and_deadlock_free(kind, p, m):
    plan = make_plan(kind, p, m)
    lists = build_schedule(plan)
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}  # pass -> (position, index in its list)
    sends, recvs = [], []
    for i, actions in lists.items():
        for j, a in enumerate(actions):
            code = {ActionKind.forward: "F", ActionKind.backward: "B", ActionKind.backward_weight: "W"}.get(a.kind)
            if code:
                assert plan.device_group_of(a.stage) == i
                assert (code, a.stage, a.microbatch) not in seen
                seen[(code, a.stage, a.microbatch)] = (i, j)
            elif a.kind in (ActionKind.send_act, ActionKind.send_grad):
                sends.append(pairs(a))
                assert plan.device_group_of(a.peer_stage) != i  # the V's bottom hands over in process
            elif a.kind in (ActionKind.recv_act, ActionKind.recv_grad):
                recvs.append(pairs(a))
    assert sorted(sends) == sorted(recvs)
    for s in range(2 * p if chunks_of(kind) == 2 else p):
        for k in range(m):  # every pass once; on its position F before B before W
            f, b, w = seen[("F", s, k)], seen[("B", s, k)], seen[("W", s, k)]
            assert f[0] == b[0] == w[0] and f[1] < b[1] < w[1]
    unit_walk(plan)  # raises on a deadlock


def test_dualpipev_needs_2p_microbatches():
    from tests.conftest import make_hardware, make_model

    plan = make_plan("dualpipev", 4, 7)
    with pytest.raises(PlanError, match="dualpipev needs at least 2 x pipeline depth"):
        validate_plan(plan, make_model(8), make_hardware(4))


def test_swaps_refused_by_name():
    from tests.conftest import make_hardware, make_model

    plan = make_plan("zb_h1", 4, 8, memory={1: [LayerMemory(layer=1, action=MemoryAction.cpu_swap)]})
    with pytest.raises(PlanError, match=r"stages\[1\]\.memory.*zb_h1 splits the backward"):
        validate_plan(plan, make_model(4), make_hardware(4))


# ---- closed forms: activations in flight, bubbles --------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 2), (3, 9), (4, 8), (4, 3), (5, 25), (8, 16)])
def test_in_flight_closed_forms(p, m):
    """ZB-H1 holds min(p, m) microbatches on every position until their W, 1F1B's peak on position
    0 (Qi et al. §2.1: the same in-flight count on all stages); ZB-V 2p chunk-microbatches (half
    a stage each: 1F1B's p) on every position (§6, balanced); DualPipeV 2p + 1 (its steps 1-2 hold
    2p, step 4's forward runs before the paired backward frees one)."""
    for i in range(p):
        assert sum(split_peak(make_plan("zb_h1", p, m), i)[1].values()) == min(p, m)
        if m >= 2 * p - 1:
            assert sum(split_peak(make_plan("zbv", p, m), i)[1].values()) == 2 * p
        if m >= 2 * p:
            assert sum(split_peak(make_plan("dualpipev", p, m), i)[1].values()) == 2 * p + 1


@pytest.mark.parametrize("p,m", [(2, 4), (3, 9), (4, 8), (4, 16), (6, 12)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1.25, 0.75), (2, 1, 1), (1, 2, 1)])
def test_bubble_closed_forms(p, m, f, b, w):
    """Iteration = m(F+B+W) + bubble: 1F1B (p-1)(F+B+W); ZB-H1 (p-1)(F+B-W) (Qi et al. §2.1,
    there for F = B = W; holds here whenever W <= B); ZB-V and DualPipeV with per-chunk F = B = W
    only the last position's start-up, (p-1)F, for m >= 2p. Checked on the unit-time walk of the
    Action lists and on simulator.pipe_walk.split_pipe_s, which walks the orders."""
    def bubble(kind, f=f, b=b, w=w):
        plan = make_plan(kind, p, m)
        finish, _ = unit_walk(plan, f, b, w)
        work = m * (f + b + w) * chunks_of(kind)
        if kind in SPLIT:
            passes = {s: (f, b, w) for s in range(len(plan.stages))}
            assert split_pipe_s(plan, passes, {}) == pytest.approx(max(finish), rel=1e-12)
        return max(finish) - work

    assert bubble("1f1b") == pytest.approx((p - 1) * (f + b + w))
    assert bubble("zb_h1") == pytest.approx((p - 1) * (f + b - w))
    if (f, b, w) == (1, 1, 1):
        assert bubble("zbv") == pytest.approx(p - 1)
        assert bubble("dualpipev") == pytest.approx(p - 1)


# ---- the simulator on a uniform model --------------------------------------------------------------
# What one microbatch of a stage holds (simulator.stagecost.split_bytes, measured on the executor in
# test_split_bytes_are_the_executors): its activations from F's end to W's end (act_bytes: B's
# retained graph keeps every saved tensor below the topmost weight op), plus from B's end to W's end
# each weight GEMM's output gradient b·m·n (here one GEMM of tokens x d per layer, the first
# stage's first layer excepted: its weights are B's), less a head's logits freed at B (none here);
# W adds one weight's gradient (d·d, fp32 only) and a recomputed layer's activations less its input.
def gemm_model(layers: int, d: int = 1024, tokens: int = 512) -> ModelSpec:
    """Square GEMMs (forward, dgrad and wgrad the same shape: T_F = T_B = T_W up to the element-wise
    terms), mixed precision, no per-operator overhead."""
    g = GemmSpec(m=tokens, n=d, k=d)
    return ModelSpec(name="toy", family="custom", layers=[
        LayerSpec(name=f"l{i}", kind=LayerKind.transformer_block, params=d * d,
                  fwd_flops_per_sample=2.0 * tokens * d * d, gemms=[g], saved_bytes_per_sample=tokens * d * 2,
                  output_bytes_per_sample=tokens * d * 2) for i in range(layers)])


def fast_hardware(devices: int) -> HardwareSpec:
    link = LinkSpec(kind=LinkKind.nvswitch, bw_gbps=1e12, latency_s=0.0)
    return HardwareSpec(
        name="toyhw", devices_per_node=devices,
        device=DeviceSpec(model="toy", memory_bytes=80 * GIB, peak_tflops={"fp32": 100, "fp16": 100},
                          compute_efficiency=1.0, hbm_gbps=1e6),
        host=HostSpec(memory_bytes=512 * GIB, pcie_gbps=1e12, pcie_latency_s=0.0),
        intra_node=NodeTopology(all_to_all=link, fallback=link))


@pytest.mark.parametrize("p,m", [(4, 8), (2, 6)])
def test_simulated_bubble_and_memory(p, m):
    """Same stages, same model: ZB-H1's iteration is 1F1B's less 2(p-1)W (the two closed forms'
    difference, W from the stage's priced wgrad GEMMs), with B + W = the whole backward; its
    position 0 peaks at 1F1B's activations when W's scratch fits in B's workspace."""
    mdl, hw = gemm_model(p), fast_hardware(p)
    one = make_plan("1f1b", p, m)
    zb = make_plan("zb_h1", p, m)
    validate_plan(zb, mdl, hw)
    sc_one, sc_zb = stage_costs(one, mdl, hw), stage_costs(zb, mdl, hw)
    for a, z in zip(sc_one, sc_zb):
        assert a.bwd_ns == z.bwd_ns and 0 < z.wgrad_ns <= z.bwd_ns - z.wgrad_ns and a.wgrad_ns == 0
    w_ns = sc_zb[0].wgrad_ns
    t_one = simulate(one, mdl, hw, trace=False).result
    t_zb = simulate(zb, mdl, hw, trace=False).result
    # tolerance: the transfers' integer nanoseconds, one per boundary crossing of the critical path
    hops_ns = 4 * (m + p) * p
    assert (t_one.iteration_time_s - t_zb.iteration_time_s) * 1e9 == pytest.approx(2 * (p - 1) * w_ns, abs=hops_ns)
    assert t_zb.iteration_time_s == pytest.approx(estimate(zb, mdl, hw).iteration_time_s, abs=hops_ns * 1e-9)
    acts = lambda r, d: r.devices[d].breakdown.activations_bytes  # noqa: E731
    if sc_zb[0].w_scratch_bytes <= sc_zb[0].workspace_bytes:
        assert acts(t_zb, 0) == acts(t_one, 0)
    assert acts(t_zb, p - 1) > acts(t_one, p - 1)  # position p-1 holds p, not 1


def test_simulated_zbv_beats_zb_h1_and_1f1b():
    p, m = 4, 8
    mdl, hw = gemm_model(2 * p), fast_hardware(p)
    times = {}
    for kind in ("1f1b", "zb_h1", "zbv", "dualpipev"):
        plan = make_plan(kind, p, m, layers_per_stage=2 // chunks_of(kind))
        validate_plan(plan, mdl, hw)
        times[kind] = simulate(plan, mdl, hw, trace=False).result.iteration_time_s
    assert times["zbv"] < times["zb_h1"] < times["1f1b"]
    assert times["dualpipev"] < times["zb_h1"]


def test_recompute_runs_inside_b():
    """Full recompute with B/W: the recomputed forward is in B (before it) and once more in W
    (simulator.stagecost.w_rerun_s), W's GEMMs are unchanged,
    the weight GEMMs' output gradients wait for W alike, and W re-makes one recomputed layer at a
    time (its scratch, StageCost.w_scratch_bytes; B's recomputed tensors go with B:
    executor.split_backward, measured in test_split_bytes_are_the_executors)."""
    p, m = 2, 4
    mdl, hw = gemm_model(2 * p), fast_hardware(p)
    rc = {s: [LayerMemory(layer=l, action=MemoryAction.recompute) for l in (2 * s, 2 * s + 1)] for s in range(p)}
    plain, recomputed = make_plan("zb_h1", p, m, 2), make_plan("zb_h1", p, m, 2, memory=rc)
    a, r = stage_costs(plain, mdl, hw)[0], stage_costs(recomputed, mdl, hw)[0]
    assert r.wgrad_ns == a.wgrad_ns and r.bwd_ns > a.bwd_ns and r.w_held_bytes == a.w_held_bytes > 0
    # W re-runs layer 1's forward (B's re-made tensors went with B); layer 0 is B's own, not re-run
    assert a.w_rerun_ns == 0 and r.w_rerun_ns == r.layers[1].recompute_ns > 0
    # fp16 here: accumulation fused into the wgrad GEMM (no fresh weight gradient); layer 1's
    # re-made activations are its saved bytes less its checkpointed input (layer 0 is B's own)
    spec = mdl.layers[1]
    remade = spec.saved_bytes_per_sample - mdl.layers[0].output_bytes_per_sample
    assert a.w_scratch_bytes == 0 and r.w_scratch_bytes == 4 * remade
    simulate(recomputed, mdl, hw, trace=False)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("p,m", [(3, 6), (4, 5)])
def test_analytic_peak_is_the_walks(precision, recompute, p, m):
    """The analytic estimate's walk (simulator.analytic.split_peak: activations held to W, the
    weight GEMMs' output gradients from B's end to W's end, W's scratch: one weight's gradient when
    accumulation is not fused, fp32 here, plus a recomputed layer re-made) gives the simulator's
    per-device peaks, byte for byte."""
    mdl, hw = gemm_model(2 * p), fast_hardware(p)
    memory = {s: [LayerMemory(layer=2 * s, action=MemoryAction.recompute)] for s in range(p)} if recompute else None
    body = make_plan("zb_h1", p, m, 2, memory=memory).model_dump()
    body["training"]["precision"] = precision
    plan = Plan.model_validate(body)
    sc = stage_costs(plan, mdl, hw)[0]
    assert sc.w_held_bytes > 0 and (sc.w_scratch_bytes > 0) == (precision == "fp32")
    simulated = simulate(plan, mdl, hw, trace=False).result
    assert [d.peak_bytes for d in simulated.devices] == [d.peak_bytes for d in estimate(plan, mdl, hw).devices]


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_v_peaks_per_device(kind):
    """The V: each device's simulated peak is the analytic walk's for its own two chunks."""
    p, m = 4, 8
    mdl, hw = gemm_model(2 * p), fast_hardware(p)
    plan = make_plan(kind, p, m)
    simulated = simulate(plan, mdl, hw, trace=False).result
    assert [d.peak_bytes for d in simulated.devices] == [d.peak_bytes for d in estimate(plan, mdl, hw).devices]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind,p,m", [("zbv", 4, 8), ("zbv", 3, 5), ("dualpipev", 4, 8), ("dualpipev", 2, 5)])
def test_v_peaks_per_position(kind, p, m, recompute):
    """The V, per pipeline position (the engine's own timelines): the simulated peak is the analytic
    walk's for the position's two chunks (s and 2p-1-s), incl. the in-process hand-off at the
    bottom, the output gradients held from B to W, W's re-made recomputed layer, and the
    sent-gradient buffers."""
    from simulator.engine import Engine
    from simulator.memory import summarize

    mdl, hw = gemm_model(2 * p), fast_hardware(p)
    memory = {s: [LayerMemory(layer=s, action=MemoryAction.recompute)] for s in range(2 * p)} if recompute else None
    plan = make_plan(kind, p, m, memory=memory)
    engine = Engine(plan, mdl, hw, trace=False)
    engine.run()
    simulated = [summarize(engine.mem[i].events, hw.device.memory_bytes).peak_bytes for i in range(p)]
    assert simulated == [d.peak_bytes for d in estimate(plan, mdl, hw).devices]  # device i is position i


# ---- B and W's memory as the executor holds it (executor.split_backward) ----------------------------
# What a microbatch holds from its B to its W (simulator.stagecost.split_bytes), derived from the
# executor's own run: B runs the engine with retain_graph, so everything the forward saved below the
# stage's topmost weight op stays (the weight ops' graph edges reach it) and each weight op's output
# gradient is stored for W: per GPT block 11 s·h (q, k, v, projection, fc2 one each, fc1 4, the two
# layernorms one each); only what lies above the topmost weight op goes at B (a head's loss logits).
# W adds one weight's fresh gradient (fp32: not fused) and, for a recomputed layer, re-makes it once.
# The oracle is the executor's live-tensor tracker on a real float32 run of one stage, not the formula.


@functools.lru_cache(maxsize=None)
def _profiled(name: str):
    """gpt_tiny / llama_tiny / bert_tiny / moe_tiny (llama_qk: llama_tiny with qk_norm, head_dim 24)
    with their symbolic profile's costs (the spec a compare run plans with, model_costs=auto), at
    2 samples per microbatch in float32."""
    from costs.families import build_model, parse_model_config
    from executor.profile_symbolic import profile_model
    from specs.profile import apply_profile
    from tests.conftest import conf

    extra = {"llama_qk": {"qk_norm": True, "head_dim": 24}}.get(name)  # Qwen3's per-head q/k norms
    cfg = parse_model_config({**conf("model", "llama_tiny"), **extra} if extra else conf("model", name))
    return cfg, apply_profile(build_model(cfg, 4), profile_model(cfg, microbatch=2, dtype="fp32"))


def _slice_plan(model: ModelSpec, owned: range, recompute: bool, tp: int = 1,
                sequence_parallel: bool = False) -> tuple[Plan, int]:
    """A zb_h1 plan whose stage ``owned`` is the measured one (float32, 2 samples per microbatch);
    every stage ``tp``-way tensor parallel (with ``sequence_parallel``)."""
    n = model.num_layers
    cuts = sorted({0, owned.start, owned.stop, n})
    stages = [StagePlan(layer_start=a, layer_stop=b, devices=list(range(i * tp, (i + 1) * tp)), tp=tp,
                        sequence_parallel=sequence_parallel,
                        memory=[LayerMemory(layer=l, action=MemoryAction.recompute) for l in range(a, b)]
                        if recompute and a == owned.start else [])
              for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    p = len(stages)
    plan = Plan(planner="test", model=model.name, hardware="toyhw", num_devices=p * tp,
                training=TrainingSpec(global_batch=2 * p, microbatch_size=2, precision="fp32"),
                schedule=ScheduleSpec(kind="zb_h1"), stages=stages)
    return plan, cuts.index(owned.start)


def _executor_split_bytes(cfg, owned: range, recompute: bool, store: bool = False, tp: bool = False,
                          sequence_parallel: bool = False) -> dict:
    """One microbatch of 2 samples through the executor's SplitBackward (``store``: WeightStore,
    ``schedule.weight_store``) on layers ``owned``, float32, counted by executor.memtrack.
    LiveTensorTracker (the compare's measured memory): what B's end adds over the tensors live when
    B starts, with the bytes of the received gradient, the output B releases and the input
    gradient it sends; W's peak over what B left, and what W frees. ``tp``: the layers Megatron
    tensor-parallel over the default process group (executor.megatron_tp, with
    ``sequence_parallel``; the stage's boundaries whole), this rank's bytes."""
    import torch
    from executor.memtrack import LiveTensorTracker
    from executor.models import build_layers, make_batch, output_shapes
    from executor.split_backward import SplitBackward
    from executor.stage_passes import StagePasses
    from executor.weight_store import WeightStore
    from tests.conftest import run_layers

    n = len(output_shapes(cfg))
    first, last = owned.start == 0, owned.stop == n
    layers = build_layers(cfg, owned, "cpu", 0, torch.float32)
    vocab_parallel = False
    if tp:
        import torch.distributed as dist

        from executor.megatron_tp import tensor_parallel
        vocab_parallel = tensor_parallel(layers, dist.group.WORLD, "cpu", sequence_parallel,
                                         split_in=sequence_parallel, split_out=sequence_parallel)
    params = list({id(q): q for _, _, mod in layers for q in mod.parameters()}.values())
    tracker = LiveTensorTracker()
    for q in params:
        q.grad = torch.zeros_like(q)
        tracker.tag(q, "parameters")
        tracker.tag(q.grad, "gradients")

    class Stage(StagePasses):  # the runtime's attributes the splitters and StagePasses.backward read
        workers = swapper = pipedream = weight_swap = window = bounds = zero1 = plan = None
        vocab_parallel = release_outputs = False

    st = Stage()
    st.vocab_parallel = vocab_parallel
    st.outputs, st.inputs, st.first, st.last, st.params, st.layers, st.tracker, st.index = (
        {}, {}, first, last, params, layers, tracker, 1)
    sb = WeightStore(st) if store else SplitBackward(st)
    batch = make_batch(cfg, 2, 0, 0, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with tracker:
        shape = output_shapes(cfg)[owned.start - 1] if not first else None
        if tp and sequence_parallel and not first:  # a sequence-split boundary: this rank's s/t positions
            shape = (shape[0] // dist.get_world_size(), *shape[1:])
        x = None if first else torch.randn((2, *shape), generator=gen).requires_grad_(True)
        y = run_layers(layers, x, batch, "full" if recompute else "none")
        grad = None if last else torch.randn(y.shape, generator=gen)
        out = {"received": 0 if grad is None else grad.untyped_storage().nbytes(),
               "output": y.untyped_storage().nbytes()}
        st.outputs[0], st.inputs[0] = y, x
        del x, y
        before = tracker.total_bytes
        tracker.reset_peak()
        sb.input_pass(0, grad)
        out["b_excess"] = tracker.peak_bytes - before
        del grad
        sent = st.grad_to_send
        out["sent"] = 0 if sent is None else sent.untyped_storage().nbytes()
        out["b_adds"] = tracker.total_bytes - before
        if tp:
            _settle(tracker)
            # the store's own storages (X and dY, local shards under tp), each counted once
            local = [getattr(t, "_local_tensor", t) for _, x, dy in sb.pending[0] for t in (x, dy)]
            held = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local}
            out["stored"] = sum(held.values())
            del local  # W frees them
        tracker.reset_peak()
        after_b = tracker.total_bytes
        sb.weight_pass(0)
        out["w_excess"] = tracker.peak_bytes - after_b
        out["w_frees"] = after_b - tracker.total_bytes
    return out

def _settle(tracker, quiet: int = 4, tick_s: float = 0.005, limit_s: float = 5.0) -> None:
    """Wait until gloo's worker thread has let go of the collectives' tensors this thread dropped
    (executor.memtrack.LiveTensorTracker._comm_freed: it frees them a few milliseconds late when
    not scheduled, e.g. loss_parallel's 64-token all-reduce): the total unchanged ``quiet`` ticks."""
    import time

    end, last, still = time.monotonic() + limit_s, tracker.total_bytes, 0
    while still < quiet and time.monotonic() < end:
        time.sleep(tick_s)
        still = still + 1 if tracker.total_bytes == last else 0
        last = tracker.total_bytes


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "middle3", "last3"])
@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "bert_tiny", "llama_qk"])
def test_split_bytes_are_the_executors(name, where, recompute):
    """StageCost.w_held_bytes is exactly what the executor's B adds for W: its stored output
    gradients (the top one is the received gradient, already live; the sent input gradient is the
    stage's grad buffer, costs.buffers) less what it frees (the released output; on the head, the
    loss's logits). A revert to "the activations wait whole, nothing stored" (held 0 with no
    recompute), to "recomputed activations held from B to W", or to a layer's whole weight
    gradient as W's scratch fails here. W's scratch is its measured peak, kept or recomputed:
    a fused GEMM (LLaMA's gate_up, kv) counts one of its ``GemmSpec.weights`` Linears, so a revert
    to the fused k·n as one weight fails on llama_tiny. W walks the layers from the top, freeing each
    one's stored gradients and activations once its groups are done (simulator.stagecost.
    w_scratch_bytes): a revert to one layer's scratch over everything held (high by 98 KiB under a
    recomputed head), or to the executor's W leaving the engine's groups (LLaMA's RMSNorm weights)
    to the end, which kept every re-made block's unpacked tensors (low by 23 KiB on 3 blocks), fails
    here, the 3-layer stages being where the second shows. ``llama_qk`` (Qwen3's per-head q/k
    RMSNorms, head_dim 24): B also stores their output gradients, (heads + kv_heads)·d per token
    (``LayerSpec.head_norm_width``; without it held is 24 KiB low a block)."""
    cfg, model = _profiled(name)
    n = model.num_layers
    owned = {"first": range(0, 2), "middle": range(1, 3), "last": range(n - 2, n),
             "middle3": range(1, 4), "last3": range(n - 3, n)}[where]
    plan, s = _slice_plan(model, owned, recompute)
    sc = stage_costs(plan, model, fast_hardware(len(plan.stages)))[s]
    got = _executor_split_bytes(cfg, owned, recompute)
    assert sc.w_held_bytes == got["b_adds"] + got["received"] - got["sent"] + got["output"], got
    assert sc.w_held_bytes > 0
    assert got["w_excess"] == sc.w_scratch_bytes, got
    # B's peak (simulator.stagecost.split_b_workspace_bytes): nothing freed, the gradients stored
    # so far on top; a layer's own counted stored at its scratch's peak, so high by at most one
    # layer's (a revert to 1F1B's backward, which frees as it goes, was low by up to 6 % of a
    # stage's peak at tp 2)
    from simulator.stagecost import w_grad_inputs_bytes
    stage = plan.stages[s]
    one_layer = max(w_grad_inputs_bytes(model, plan, stage, l) for l in stage.layers)
    scalars = 8  # the head's fp32 loss and its gradient, which no layer books
    assert got["b_excess"] <= sc.workspace_bytes + scalars and sc.workspace_bytes <= got["b_excess"] + one_layer, got


def test_head_frees_its_logits_at_b_and_w_scratch_is_one_weight():
    """The head stage's B frees the loss's logits (2 samples x s·V·4, the head's tp-split saved
    bytes), and W's scratch in fp32 is one weight's gradient (the largest weight GEMM's k·n), not
    the layer's parameters: a revert to the activations all held until W (logits included) or to
    a layer-sized scratch fails here."""
    from simulator.stagecost import freed_at_b_bytes, w_scratch_bytes

    _, model = _profiled("gpt_tiny")
    plan, s = _slice_plan(model, range(model.num_layers - 2, model.num_layers), False)
    stage = plan.stages[s]
    head = model.layers[-1]
    logits = 2 * head.saved_bytes_per_sample * head.tp_sharded_saved_fraction
    assert freed_at_b_bytes(model, plan, stage) == pytest.approx(logits, abs=1) and logits > 0
    # fp32: W's largest weight gradient is a GEMM's k·n (fc2's 4h·h = the head's V·h here), not a block's params
    gemm = max(g.k * g.n for l in stage.layers for g in model.layers[l].gemms if g.batch == 1)
    assert w_scratch_bytes(model, plan, stage) == 4 * gemm < 4 * model.layers[stage.layer_start].params


@pytest.mark.parametrize("name, head_norms", [("gpt_tiny", 1), ("llama_tiny", 1), ("bert_tiny", 1), ("moe_tiny", 0)])
def test_norm_modules_are_the_profiles(name, head_norms):
    """The closed-form families' LayerSpec.norm_modules (GPT, LLaMA, BERT, MoE blocks 2, a head with
    a final norm 1, Alpa's MoE head none, BERT's and MoE's embedding its layernorm) is what the
    executor's modules run, as their profiled saved tensors name the norms
    ("ln1:aten.native_layer_norm", "ln1:aten.rsqrt"): a family that miscounts its norms fails
    here, and so does a count of 0 for the blocks."""
    from simulator.stagecost import norm_modules

    _, model = _profiled(name)
    fields = [l.norm_modules for l in model.layers]
    named = [norm_modules(l.model_copy(update={"norm_modules": 0})) for l in model.layers]
    assert fields == named
    assert fields[1:-1] == [2] * (model.num_layers - 2) and fields[-1] == head_norms


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "bert_tiny"])
def test_closed_form_stores_the_profiled_output_gradients(name):
    """Without a profile (a closed-form spec: saved tensors named by role, not by module), B still
    stores each norm's output gradient for W: a middle block's w_grad_inputs_bytes is the profiled
    spec's (the 11 s·h of a GPT block: its weight GEMMs' 9, its two layernorms' 2), and its W
    scratch is one Linear's weight (a fused GEMM split by GemmSpec.weights). A revert to the names
    alone (2 s·h short per block) fails here."""
    from costs.families import build_model
    from simulator.stagecost import w_grad_inputs_bytes, w_scratch_bytes

    cfg, profiled = _profiled(name)
    closed = build_model(cfg, 4)
    plan, s = _slice_plan(profiled, range(1, 3), False)
    stage = plan.stages[s]
    for l in stage.layers:
        assert w_grad_inputs_bytes(closed, plan, stage, l) == w_grad_inputs_bytes(profiled, plan, stage, l)
    assert w_scratch_bytes(closed, plan, stage) == w_scratch_bytes(profiled, plan, stage)
    if name == "gpt_tiny":
        s_h = 2 * closed.seq_len * closed.hidden * 4  # 2 samples, float32
        assert w_grad_inputs_bytes(closed, plan, stage, 1) == 11 * s_h


def test_norm_modules_field_wins_and_fused_weights_divide_n():
    """LayerSpec.norm_modules is read before the saved tensors' names (a hand-written count holds),
    and a GemmSpec's weights must divide its n (fused Linears of equal width), named in the error."""
    from simulator.stagecost import norm_modules

    layer = LayerSpec(name="x", kind=LayerKind.generic, params=1, fwd_flops_per_sample=1.0,
                      saved_bytes_per_sample=0, output_bytes_per_sample=0, norm_modules=3)
    assert norm_modules(layer) == 3
    assert norm_modules(layer.model_copy(update={"norm_modules": 0})) == 0
    assert GemmSpec(m=1, n=6, k=1, weights=3).weights == 3
    with pytest.raises(ValueError, match="weights: 4 does not divide n 6"):
        GemmSpec(m=1, n=6, k=1, weights=4)


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "middle3"])
@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "bert_tiny"])
def test_weight_store_bytes_are_the_executors(name, where, recompute):
    """``schedule.weight_store`` (the Zero Bubble paper's WeightGradStore): what the executor's B
    leaves for W is each Linear's X and dY (simulator.stagecost.stored_bytes, q/k/v's one input
    held once), everything else the microbatch held being freed as in 1F1B's backward; W frees
    exactly that and peaks at one weight's gradient. A revert to torch's retained graph (the
    activations held until W) or to X counted per Linear fails here."""
    from simulator.stagecost import stored_bytes

    cfg, model = _profiled(name)
    n = model.num_layers
    owned = {"first": range(0, 2), "middle": range(1, 3), "last": range(n - 2, n), "middle3": range(1, 4)}[where]
    plan, s = _slice_plan(model, owned, recompute)
    plan = plan.model_copy(update={"schedule": ScheduleSpec(kind="zb_h1", weight_store=True)})
    stage = plan.stages[s]
    sc = stage_costs(plan, model, fast_hardware(len(plan.stages)))[s]
    got = _executor_split_bytes(cfg, owned, recompute, store=True)
    store = sum(stored_bytes(model, plan, stage, l) for l in stage.layers)
    assert got["w_frees"] == store, got
    assert sc.w_held_bytes + sc.act_bytes == store
    assert got["w_excess"] == sc.w_scratch_bytes, got
    # B's peak (costs.activations.backward_workspace_bytes with ``kept``): within one weight GEMM's
    # output gradient either way (LLaMA's up projection's dY, stored while gate's backward runs, is
    # the low side; a revert to adding each layer's own store at its peak is high by 95-160 KiB)
    dy = max(stored_bytes(model, plan, stage, l, inputs=False) for l in stage.layers)
    one = max(math.ceil(2 * g.m * g.n * 4 / g.weights) for l in stage.layers for g in model.layers[l].gemms
              if g.batch == 1)
    assert dy > 0 and abs(got["b_excess"] - sc.workspace_bytes) <= one, got
