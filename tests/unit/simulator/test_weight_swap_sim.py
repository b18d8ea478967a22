"""MPress's GPU-CPU swap of live model data (``offload.weight_swap_layers``, MPress §II-D), simulated
(simulator/weightswap.py) and in closed form (simulator.analytic, costs.static), against numbers
derived by hand from the contract (specs.plan_memory.OffloadPolicy) on a toy model: every layer
1 M parameters, weights 2 B, gradients 4 B, optimizer state 12 B per parameter (mixed precision)."""
from __future__ import annotations

import json

import pytest

import costs.activations
import costs.static
from simulator import simulate
from simulator.analytic import estimate
from simulator.stash_peak import max_stashed_versions

from test_simulator import hardware, model, plan  # noqa: E402  (tests/unit/simulator on sys.path)

P, M = 4, 8
PARAMS = 1_000_000


def _ws(pl, layers_of):
    """``pl`` with ``offload.weight_swap_layers`` of stage s = ``layers_of(stage)``."""
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={"weight_swap_layers": layers_of(st)})})
              for st in pl.stages]
    return type(pl).model_validate({**pl.model_dump(), "stages": [st.model_dump() for st in stages]})


def _setup(kind: str, layers: int = 8, pcie_gbps: float = 100.0):
    """Activations large against the weights (8 MiB saved per layer per microbatch vs 2 MB of
    weights) and a backward workspace above the sent output, so every position peaks during a
    backward; the host link slow enough that the copies take time (100 GB/s: 20 us per layer)."""
    mdl = model(layers=layers, params=PARAMS, saved=8 << 20)
    mdl = mdl.model_copy(update={"layers": [l.model_copy(update={"workspace_fixed_bytes": 1 << 20})
                                            for l in mdl.layers]})
    return mdl, plan(kind, P, M, mdl=mdl), hardware(P, pcie_gbps=pcie_gbps)


def _slices(trace: dict, pid: int) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == pid]


def _bytes(pl, mdl, s: int, l: int) -> tuple[int, int, int]:
    w_b, g_b, o_b = pl.training.bytes_per_param()
    return PARAMS * w_b, PARAMS * g_b, PARAMS * o_b


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "pipedream_async"])
def test_static_bytes_move_to_the_host(kind):
    mdl, base, _ = _setup(kind)
    pl = _ws(base, lambda st: [st.layer_start])
    for s in range(P):
        w, g, o = _bytes(pl, mdl, s, pl.stages[s].layer_start)
        assert costs.static.weight_swap_bytes(mdl, pl, pl.stages[s]) == (w, g, o)
        (before, host0), (after, host1) = (costs.static.stage_static(mdl, x, x.stages[s]) for x in (base, pl))
        assert (before.parameters_bytes - after.parameters_bytes, before.gradients_bytes - after.gradients_bytes,
                before.optimizer_bytes - after.optimizer_bytes, host1 - host0) == (w, g, o, w + g + o)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "pipedream_async"])
def test_each_pass_fetches_and_waits_and_each_backward_copies_its_gradient(kind):
    mdl, base, hw = _setup(kind)
    pl = _ws(base, lambda st: [st.layer_start])
    sim = simulate(pl, mdl, hw)
    for s in range(P):
        l = pl.stages[s].layer_start
        ev = _slices(sim.trace, s)
        fetches = [e for e in ev if e["name"].startswith(f"fetch L{l} ")]
        grads = [e for e in ev if e["name"].startswith(f"grads L{l} ")]
        steps = [e for e in ev if e["name"].startswith(f"cpu step L{l}")]
        assert len(fetches) == 2 * M and len(grads) == M  # a forward and a backward per microbatch
        assert {e["tid"] for e in fetches} != {e["tid"] for e in grads}  # h2d vs d2h
        assert len(steps) == (M if kind == "pipedream_async" else 1)
        # the pass's first layer (L, forward) is fetched when the pass starts and the layer waits
        # for the whole copy: a "wait fetch" slice ending where the copy ends, one per forward
        ends = {round(e["ts"] + e["dur"], 3) for e in ev if e["name"].startswith(f"wait fetch L{l} ")}
        fwd_fetches = [e for e in fetches if _is_forward_fetch(ev, e)]
        assert len(fwd_fetches) == M
        assert all(round(e["ts"] + e["dur"], 3) in ends for e in fwd_fetches)
        assert sim.result.devices[s].host_bytes >= sum(_bytes(pl, mdl, s, l))


def test_pipedream_forward_waits_for_the_cpu_step():
    """Under PipeDream the CPU steps the layer after every backward (its gradient copied out first)
    and a forward's fetch starts only after the steps of every backward that ended before that
    forward started; with a slow CPU (1e6 params/s: 1 s per step) the iteration is bound by them."""
    mdl, base, hw = _setup("pipedream_async")
    hw = hw.model_copy(update={"host": hw.host.model_copy(update={"cpu_adam_params_per_s": 1e6})})
    pl = _ws(base, lambda st: [st.layer_start])
    sim = simulate(pl, mdl, hw)
    for s in range(P):
        l = pl.stages[s].layer_start
        ev = _slices(sim.trace, s)
        steps = {e["name"].split()[-1]: e for e in ev if e["name"].startswith(f"cpu step L{l} ")}
        step_end = {k: e["ts"] + e["dur"] for k, e in steps.items()}
        grad_end = {e["name"].split()[-1]: e["ts"] + e["dur"] for e in ev if e["name"].startswith(f"grads L{l} ")}
        bwd_end = {e["name"].split()[-1]: e["ts"] + e["dur"] for e in ev if e["cat"] == "backward"}
        assert len(steps) == M
        for k, e in steps.items():  # after its gradient is in, one layer at the CPU's rate (us)
            assert e["ts"] >= grad_end[k] - 1e-3 and e["dur"] == pytest.approx(PARAMS / 1e6 * 1e6, rel=1e-9)
        fwd_start = {e["name"].split()[-1]: e["ts"] for e in ev if e["cat"] == "forward"}
        checked = 0
        for e in ev:
            if e["name"].startswith(f"fetch L{l} ") and _is_forward_fetch(ev, e):
                j = e["name"].split()[-1]
                for k, b_end in bwd_end.items():
                    if b_end <= fwd_start[j]:
                        assert e["ts"] >= step_end[k] - 1e-3
                        checked += 1
        assert checked  # some forward followed a backward
    # PipeDream's iteration is its busiest position's busy time (simulator.report.iteration_ns):
    # after the warm-up every forward of a position waits for the step of the backward before it
    # (1 s each, the position's stream held), so at least M - P + 1 of them
    assert sim.result.iteration_time_s >= (M - P + 1) * PARAMS / 1e6 * (1 - 1e-9)


def _is_forward_fetch(ev: list[dict], fetch: dict) -> bool:
    """Whether ``fetch`` (``fetch L<l> mb<k>``) serves microbatch k's forward: issued before that
    forward's compute slice ends."""
    k = fetch["name"].split()[-1]
    fwd = [e for e in ev if e["cat"] == "forward" and e["name"].endswith(" " + k)]
    return bool(fwd) and fetch["ts"] < fwd[0]["ts"] + fwd[0]["dur"]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "pipedream_async"])
@pytest.mark.parametrize("which", ["first", "all", "pair"])
def test_device_peak_drops_by_what_the_contract_says(kind, which):
    """The peak is a backward's (activations held + workspace). Weight swap takes the listed layers'
    weights, gradients and optimizer state off the device (and their stashed versions under
    PipeDream) and puts back, during a backward, the prefetch rule's in-flight set at its worst
    moment. Here every layer keeps 8 MiB of activations, which autograd has freed by the time the
    layer's 4 MB gradient is complete (costs.static.weight_swap_backward_relief), so the worst
    moment is the pass's start: the top layer's weights and the next one's (its fetch issued as
    the top layer starts), where swapped, and no gradient."""
    mdl, base, hw = _setup(kind)
    pick = {"first": lambda st: [st.layer_start], "all": lambda st: list(st.layers),
            "pair": lambda st: [st.layer_start, st.layer_start + 1]}[which]
    pl = _ws(base, pick)
    before, after = simulate(base, mdl, hw).result, simulate(pl, mdl, hw).result
    w_b, g_b, o_b = pl.training.bytes_per_param()
    w, g, o = PARAMS * w_b, PARAMS * g_b, PARAMS * o_b
    for s in range(P):
        n = len(pick(pl.stages[s]))
        layers_per_stage = pl.stages[s].num_layers
        assert layers_per_stage == 2
        for l in pick(pl.stages[s]):  # the premise: a layer's backward frees more than its gradient
            assert costs.static.weight_swap_backward_relief(mdl, pl, pl.stages[s], l)[0] > g
        in_flight = n * w  # the top layer's and the one below's weights, where swapped
        versions = (max_stashed_versions(P, M, s) if kind == "pipedream_async" else 0)
        freed = n * (w + g + o) + versions * n * w
        assert before.devices[s].peak_bytes - after.devices[s].peak_bytes == freed - in_flight, (s, n)
        b = after.devices[s].breakdown
        static = costs.static.stage_static(mdl, pl, pl.stages[s])[0]
        assert (b.parameters_bytes - static.parameters_bytes, b.gradients_bytes - static.gradients_bytes) == \
            (in_flight, 0)


def test_swapped_layer_gradient_meets_its_swapped_in_copy():
    """A weight-swapped layer whose activations are swapped (cpu_swap): its swapped-in copy stays
    until its last saved tensor goes, so its complete gradient and that copy (with the copy of the
    layer below, double buffered) are on the device together (executor.swap frees a copy with its
    last saved tensor). The workspace's weight-gradient part (1 MiB here) is the gradient itself
    until the next layer starts."""
    from specs.plan import LayerMemory, MemoryAction

    mdl, base, hw = _setup("1f1b")
    swapped = type(base).model_validate({**base.model_dump(), "stages": [
        {**st.model_dump(), "memory": [LayerMemory(layer=l, action=MemoryAction.cpu_swap).model_dump()
                                       for l in st.layers]} for st in base.stages]})
    pl = _ws(swapped, lambda st: [st.layer_stop - 1])  # the top layer: both copies are in at its end
    res = simulate(pl, mdl, hw).result
    w_b, g_b, _ = pl.training.bytes_per_param()
    w, g = PARAMS * w_b, PARAMS * g_b
    scratch = mdl.layers[0].workspace_fixed_bytes
    samples = pl.training.samples_per_microbatch
    for s in range(P):
        st = pl.stages[s]
        assert costs.static.weight_swap_backward_relief(mdl, pl, st, st.layer_stop - 1) == (0, scratch)
        b = res.devices[s].breakdown
        static = costs.static.stage_static(mdl, pl, st)[0]
        assert (b.parameters_bytes - static.parameters_bytes, b.gradients_bytes - static.gradients_bytes) == (w, g)
        assert b.swapped_in_bytes >= sum(costs.activations.swapped_bytes(mdl, st, l, samples) for l in st.layers)
        # the copy out runs beside the next layer's backward (a GPU's copy engine), whose
        # weight-gradient scratch is back: the worst moment gives nothing back
        assert costs.static.weight_swap_transient_bytes(mdl, pl, st) == (w, g, 0)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "pipedream_async"])
@pytest.mark.parametrize("which", ["first", "all", "last"])
def test_closed_form_peak_and_host_equal_the_engine(kind, which):
    mdl, base, hw = _setup(kind, layers=12)  # three layers per stage: L, L-1, L-2 all swapped with "all"
    pick = {"first": lambda st: [st.layer_start], "all": lambda st: list(st.layers),
            "last": lambda st: [st.layer_stop - 1]}[which]
    pl = _ws(base, pick)
    sim, ana = simulate(pl, mdl, hw).result, estimate(pl, mdl, hw)
    assert [d.peak_bytes for d in sim.devices] == [d.peak_bytes for d in ana.devices]
    assert [d.host_bytes for d in sim.devices] == [d.host_bytes for d in ana.devices]
    if which == "all":  # the layers free more activations than a gradient: the pass start's two weights
        w_b, g_b, _ = pl.training.bytes_per_param()
        for s in range(P):
            assert costs.static.weight_swap_transient_bytes(mdl, pl, pl.stages[s]) == (2 * PARAMS * w_b, 0, 0)


def test_pipedream_host_keeps_a_stale_version_per_stashed_version():
    mdl, base, hw = _setup("pipedream_async")
    pl = _ws(base, lambda st: [st.layer_start])
    res = simulate(pl, mdl, hw).result
    ref = simulate(base, mdl, hw).result
    w_b, g_b, o_b = pl.training.bytes_per_param()
    for s in range(P):
        home = PARAMS * (w_b + g_b + o_b)
        assert res.devices[s].host_bytes - ref.devices[s].host_bytes == \
            home + max_stashed_versions(P, M, s) * PARAMS * w_b


def test_link_carries_the_fetches_and_gradients():
    """Every fetch is one layer's weights over the host link, every gradient copy one gradient:
    the trace's h2d/d2h slices of a swapped layer last transfer_s of those bytes."""
    import costs.collectives
    from simulator.stagecost import host_link, ns

    mdl, base, hw = _setup("1f1b")
    pl = _ws(base, lambda st: [st.layer_start])
    sim = simulate(pl, mdl, hw)
    w_b, g_b, _ = pl.training.bytes_per_param()
    link = host_link(hw)
    fetch_us, grad_us = (ns(costs.collectives.transfer_s(PARAMS * b, link)) / 1000 for b in (w_b, g_b))
    ev = _slices(sim.trace, 0)
    assert {e["dur"] for e in ev if e["name"].startswith("fetch L0 ")} == {fetch_us}
    assert {e["dur"] for e in ev if e["name"].startswith("grads L0 ")} == {grad_us}


def test_slower_iteration_and_deterministic():
    mdl, base, hw = _setup("1f1b", pcie_gbps=1.0)  # 2 ms per fetch: exposed
    pl = _ws(base, lambda st: list(st.layers))
    a, b = simulate(pl, mdl, hw), simulate(pl, mdl, hw)
    assert a.result.model_dump_json() == b.result.model_dump_json()
    assert json.dumps(a.trace, sort_keys=True) == json.dumps(b.trace, sort_keys=True)
    assert a.result.iteration_time_s > simulate(base, mdl, hw).result.iteration_time_s


def test_interleaved_schedule_runs():
    mdl = model(layers=16, params=PARAMS, saved=8 << 20)
    pl = _ws(plan("interleaved_1f1b", P, M, mdl=mdl, v=2), lambda st: [st.layer_start])
    sim = simulate(pl, mdl, hardware(P, pcie_gbps=100.0))
    names = [e["name"] for e in _slices(sim.trace, 0)]
    assert sum(n.startswith("fetch L0 ") for n in names) == 2 * M
    assert sum(n.startswith("fetch L8 ") for n in names) == 2 * M
    assert costs.activations.in_flight_microbatches(pl, 0) >= 1
