"""STRONGHOLD's multi-streamed execution (§IV-A, Fig. 5; executor.window_streams): S workers share
one window, microbatches run in groups of S, a group's pass fetches each streamed layer once and
copies its summed gradient to the host once.

Real gloo runs of gpt_tiny on local_cpu (one stage, blocks 0..3 streamed, embedding and tied head
resident; m = 4 microbatches) and, for the mechanism, a window built in this process over plain
Linear layers: the S workers' computes of one layer meet at a barrier inside the layer (serialised
workers would break it: no timing threshold), and the slot's gradient buffer sums the workers'
gradients in worker order (bit for bit g_0 + g_1 of separate backwards).

Numerics: a group's summed gradient reaches the host accumulator as m / S group sums instead of
m microbatch gradients: a regrouping of the same float sum, inside the float32 reordering bound
(executor.reference.reorder_rtol) the window tests already demand against the reference."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from executor.launch import launch
from executor.measure import execute_run
from executor.preflight import streams_unsupported
from executor.window import Window
from executor.window_streams import Workers
from specs.plan import OffloadPolicy, StagePlan
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU
from tests.integration.executor.test_executor_window import (HEAD, STEPS, assert_bitwise, assert_matches_reference,
                                                             f64, plan)

M = CPU_TRAINING.microbatches


def streams_plan(s: int, w: int = 1, dp: int = 1, training=CPU_TRAINING):
    p = plan([(0, HEAD + 1, list(range(dp)), OffloadPolicy(window_layers=w, resident_layers=[0, HEAD], streams=s))])
    return p.model_copy(update={"training": training}) if training is not CPU_TRAINING else p


def recorded(p, iterations: int = 2):
    opts = {"iterations": iterations, "collect": False, "memory_iteration": None, "track_memory": False,
            "fault": None, "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "record_window": True}
    out = launch(p, GPT_TINY, opts, 120.0)
    assert out.failure is None, out.failure
    return out.reports[0]


# ---- numerics against the single-process reference ---------------------------------------------

@pytest.mark.parametrize("s, w", [(2, 1), (4, 2)])
def test_streams_train_as_the_reference(s, w):
    out = f64(streams_plan(s, w))
    assert out.failure is None, out.failure
    assert_matches_reference(out, STEPS)


def test_streams_are_deterministic():
    """Worker-order adds (the CPU gate): two runs agree bit for bit."""
    assert_bitwise(f64(streams_plan(2)), f64(streams_plan(2)))


@pytest.mark.slow
def test_dp2_streams2_trains_as_the_reference():
    out = f64(streams_plan(2, 1, dp=2))
    assert out.failure is None, out.failure
    assert_matches_reference(out, STEPS)


# ---- the window's traffic: a fetch per group pass, a gradient copy per group -----------------

def test_a_group_pass_fetches_and_copies_as_one_pass_of_m_over_s_microbatches():
    """The S = 2 run's (event, layer) sequence is the S = 1 run's with m / 2 microbatches (one
    pass per group), its microbatch labels the groups' first; m / S gradient copies per layer."""
    s = 2
    grouped = recorded(streams_plan(s))["window_events"][0]
    fewer = CPU_TRAINING.model_copy(update={"microbatch_size": CPU_TRAINING.microbatch_size * s})
    assert fewer.microbatches == M // s
    single = recorded(streams_plan(1, training=fewer))["window_events"][0]
    assert [(e, layer) for e, layer, _ in grouped] == [(e, layer) for e, layer, _ in single]
    assert [k for *_, k in grouped] == [k * s for *_, k in single]
    streamed = range(1, HEAD)
    for layer in streamed:  # two iterations
        assert sum(1 for e, i, _ in grouped if e == "d2h" and i == layer) == 2 * M // s
        assert sum(1 for e, i, _ in grouped if e == "step" and i == layer) == 2
    fetches = sum(1 for e, *_ in grouped if e == "fetch")
    single_m = sum(1 for e, *_ in recorded(streams_plan(1))["window_events"][0] if e == "fetch")
    print(f"\nfetches per 2 iterations: S=2 {fetches}, S=1 {single_m} ({len(streamed)} streamed layers, w=1)")
    assert fetches < single_m


def test_workers_compute_one_layer_concurrently_in_the_run():
    """Each worker's compute interval of each streamed layer, from the gloo run; reported, and
    every layer's intervals of a group are ordered by nothing but the workers (one interval per
    worker per layer per group pass)."""
    rep = recorded(streams_plan(2), iterations=1)
    computes = rep["window_computes"][0]
    by = {}
    for kind, layer, k, t0, t1 in computes:
        by.setdefault((layer, k // 2), []).append((k % 2, t0, t1))
    assert len(by) == (HEAD - 1) * M // 2 and all(len(v) == 2 for v in by.values())
    overlap = sum(1 for v in by.values() if max(a for _, a, _ in v) < min(b for *_, b in v))
    print(f"\n{overlap} of {len(by)} (layer, group) computes overlap in time on this machine")


# ---- the mechanism in process: barrier inside a layer, worker-order gradient sum ---------------

def _window(s: int, barrier=None):
    torch.manual_seed(0)
    mods = [torch.nn.Linear(8, 8) for _ in range(3)]
    fresh = [torch.nn.Linear(8, 8) for _ in range(3)]
    for a, b in zip(fresh, mods):
        b.load_state_dict(a.state_dict())
    win = Window(list(enumerate(mods)), [0, 1, 2], 1, 1, torch.device("cpu"),
                 lambda ps: torch.optim.SGD(ps, lr=0.0), torch.float32, record=True, streams=s)
    return win, mods, fresh


def test_two_workers_meet_inside_one_layer_and_sum_their_gradients_in_worker_order():
    s = 2
    win, mods, fresh = _window(s)
    workers = Workers(s, win, 1)
    meet = threading.Barrier(s, timeout=20)  # serialised workers would never both arrive: broken
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(w)) for w in range(s)]

    def forward(w):
        y = xs[w]
        for i in range(3):
            def run(y=y, i=i):
                meet.wait()
                return torch.tanh(mods[i](y))
            y = win.forward_layer(i, run)
        return y.sum()

    with win.pass_("F", 0):
        ys = workers.run(forward)
    with win.pass_("B", 0):
        workers.run(lambda w: ys[w].backward())
    win.step()
    win.finish()
    # one fetch per layer per group pass (w = 1: the backward starts with the forward's last layer),
    # one gradient copy per layer for the group
    assert [i for e, i, _ in win.events if e == "fetch"] == [0, 1, 2, 1, 0]
    assert [i for e, i, _ in win.events if e == "d2h"] == [2, 1, 0]
    for layer in range(3):  # the two workers' compute intervals of each layer intersect
        iv = [(t0, t1) for _, i, _, t0, t1 in win.computes if i == layer]
        assert len(iv) == 2 and max(a for a, _ in iv) < min(b for _, b in iv)
    want = []  # separate backwards per worker, then g_0 + g_1 in worker order
    per_worker = []
    for w in range(s):
        y = xs[w]
        for m in fresh:
            y = torch.tanh(m(y))
        for m in fresh:
            m.zero_grad()
        y.sum().backward()
        per_worker.append([p.grad.clone() for m in fresh for p in m.parameters()])
    want = [a + b for a, b in zip(*per_worker)]
    got = [win.host_state(p)[1] for m in mods for p in m.parameters()]
    for g, ref in zip(got, want):
        assert torch.equal(g, ref)


# ---- refusals ---------------------------------------------------------------------------------

def test_streams_not_dividing_m_or_pp2_are_refused_by_name():
    one = streams_plan(1)  # m % 3 != 0 (whatever validate_plan says of it: the executor refuses on its own)
    st = one.stages[0]
    three = one.model_copy(update={"stages": [st.model_copy(update={"offload": st.offload.model_copy(
        update={"streams": 3})})]})
    assert any("stages[0].offload.streams: 3 workers run microbatches in groups of 3; 4 microbatches" in p
               for p in streams_unsupported(three))
    pol = OffloadPolicy(window_layers=1, resident_layers=[0], streams=2)
    one = streams_plan(1)  # validate_plan refuses it too (specs.plan); the executor on its own
    pp2 = one.model_copy(update={"stages": [StagePlan(layer_start=0, layer_stop=3, devices=[0], offload=pol),
                                            StagePlan(layer_start=3, layer_stop=HEAD + 1, devices=[1])]})
    assert any("stages[0].offload.streams: 2 workers need a one-stage pipeline" in p for p in streams_unsupported(pp2))
    assert streams_unsupported(streams_plan(2)) == []
    opts = {"iterations": 1, "collect": False, "memory_iteration": None, "track_memory": False, "fault": None,
            "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None}
    out = launch(three, GPT_TINY, opts, 60.0)  # the ranks refuse it at start-up, naming the field
    assert out.failure is not None and "offload.streams: 3 workers" in out.failure, out.failure


# ---- memory: one copy of weights per slot, each worker its own activations -------------------

@pytest.mark.slow
def test_streams_share_the_slots_and_hold_their_own_activations():
    peaks = {}
    for s in (1, 2):
        result, _ = execute_run(streams_plan(s), GPT_TINY, LOCAL_CPU, iterations=1, warmup=1, timeout_s=120,
                                device="cpu")
        assert result.failure is None, result.failure
        peaks[s] = result.devices[0]
        print(f"\nS={s}: peak {peaks[s].peak_bytes} B, parameters {peaks[s].breakdown.parameters_bytes} B, "
              f"activations {peaks[s].breakdown.activations_bytes} B")
    assert peaks[2].breakdown.parameters_bytes == peaks[1].breakdown.parameters_bytes
    assert peaks[2].breakdown.activations_bytes > peaks[1].breakdown.activations_bytes
    assert np.isfinite(peaks[2].peak_bytes)


# ---- the measured trace: group passes named as the simulator names them ----------------------

def test_recorder_labels_a_group_by_its_microbatches():
    from executor.timeline import Recorder, slices

    rec = Recorder(0, streams=2)
    rec.interval("window_grads", 0, 2, 4, 10, 20)
    rec.interval("window_fetch", 0, -1, 4, 0, 5)
    names = [name for _, name, *_ in slices(rec.events)]
    assert names == ["grads L4 g1 (mb 2-3)", "fetch L4"]
    one = Recorder(0)
    one.interval("window_grads", 0, 2, 4, 10, 20)
    assert [name for _, name, *_ in slices(one.events)] == ["grads L4 mb2"]


@pytest.mark.slow
def test_measured_trace_holds_the_simulators_group_slices():
    """Every window fetch, group gradient copy, CPU step and group pass of the measured trace is
    named as a slice of the simulated trace (simulator.window.group_name), with the simulated
    count per iteration."""
    from collections import Counter

    from costs.families import build_model
    from executor.measure import measured_timeline
    from simulator import simulate

    p = streams_plan(2)
    result, out = execute_run(p, GPT_TINY, LOCAL_CPU, iterations=2, warmup=1, timeout_s=120, device="cpu")
    assert result.failure is None, result.failure
    _, rep, _ = measured_timeline(p, out, 1)
    trace = simulate(p, build_model(GPT_TINY, 4), LOCAL_CPU).trace
    sim = Counter(e["name"] for e in trace["traceEvents"] if e.get("ph") == "X")
    got = Counter(name for _, name, *_ in rep[0])
    watched = ("F s0 ", "B s0 ", "fetch L", "grads L", "cpu step L")
    for name, n in got.items():
        if name.startswith(watched):
            assert sim[name] == n, (name, n, sim[name])
    assert got["grads L1 g1 (mb 2-3)"] == 1 and got["F s0 g0 (mb 0-1)"] == 1


def test_a_failing_worker_ends_the_group_pass_with_its_error():
    """Worker 1 fails inside layer 1: worker 0, waiting for layer 2's fetch (issued only after
    both workers' layer 1), must end with that error, not wait forever."""
    win, mods, _ = _window(2)
    workers = Workers(2, win, 1)
    xs = [torch.randn(4, 8) for _ in range(2)]

    def forward(w):
        y = xs[w]
        for i in range(3):
            def run(y=y, i=i):
                if w == 1 and i == 1:
                    raise ValueError("worker 1 broke")
                return mods[i](y)
            y = win.forward_layer(i, run)
        return y

    outcome = {}

    def group():
        try:
            with win.pass_("F", 0):
                workers.run(forward)
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            outcome["error"] = exc

    t = threading.Thread(target=group, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the group pass hung on the failed worker"
    assert "worker 1 broke" in repr(outcome.get("error")), outcome
