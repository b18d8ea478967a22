"""policy=map (planners/map/plan.py): budgets are met on every device as the simulator counts them,
time rises as the budget falls, an honest "does not fit" below the minimum, and the baselines'
parameter-only bound is shown to overshoot where MAP does not."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from executor.op_graph import model_op_graphs
from planners.map.plan import map_search
from planners.policy import MapPolicy
from simulator import simulate
from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import Plan, ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from specs.units import size_text

CONF = Path(__file__).resolve().parents[3] / "conf"
MIB = 1 << 20


def _hw(name: str) -> HardwareSpec:
    return HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


def _model(name: str, mb: int, precision: str, **override):
    data = yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()) | override
    cfg = parse_model_config(data)
    model = build_model(cfg, 4 if precision == "fp32" else 2)
    graphs, keys = model_op_graphs(cfg, mb, precision)
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": mb,
                                    "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})


@pytest.fixture(scope="module")
def tiny():
    """gpt_tiny with a longer sequence so that activations, not parameters, dominate."""
    return _model("gpt_tiny", 8, "fp32", seq_len=256), _hw("local_cpu"), TrainingSpec(
        global_batch=16, microbatch_size=8, precision="fp32")


def _run(tiny, budget_mib: float | None, **kw):
    model, hw, tr = tiny
    pol = MapPolicy(memory_budget_gib=None if budget_mib is None else budget_mib / 1024, **kw)
    return map_search(pol, model, hw, tr, ScheduleSpec())


def _min_budget_bytes(tiny) -> int:
    """The smallest budget any strategy choice with checkpointing meets (the planner's own
    answer below it: test_below_the_minimum_says_so_with_the_minimum)."""
    out = _run(tiny, 0.05)
    assert not out.fits
    return max(c.min_budget_bytes for c in out.stages)


def test_budgets_met_and_time_monotone(tiny):
    """Against the simulator (which shares the ILP's cost code, simulator/sharded.py); the same
    budgets against measured gloo runs: tests/integration/map/test_map_budget_measured.py."""
    model, hw, _ = tiny
    free = _run(tiny, None)
    assert free.fits
    top = max(free.peak_bytes)
    need = _min_budget_bytes(tiny)
    times, peaks = [], []
    for frac in (1.0, 0.8, 0.6, 0.45):
        # every budget of the sweep is above the minimum, so each must fit (no outcome is optional)
        assert top * frac >= 1.02 * need, (frac, top, need)
        out = _run(tiny, top * frac / MIB)
        assert out.fits, (frac, out.notes)
        plan = validate_plan(out.plan, model, hw)
        sim = simulate(plan, model, hw).result
        used = [d for d in sim.devices if d.stages]
        assert all(d.peak_bytes <= out.budget_bytes for d in used), (frac, [d.peak_bytes for d in used])
        times.append(sim.iteration_time_s)
        peaks.append(max(d.peak_bytes for d in used))
    # a tighter budget never makes the plan faster (MAP §5.3 searches a superset as the budget grows)
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:])), times
    assert peaks[-1] < peaks[0]


def test_below_the_minimum_says_so_with_the_minimum(tiny):
    out = _run(tiny, 0.05)  # 50 KiB: below the parameter state alone
    assert not out.fits
    note = " ".join(out.notes)
    need = max(c.min_budget_bytes for c in out.stages)
    assert need > out.budget_bytes
    # the note names the minimum and the asked budget, each in the unit its magnitude needs
    assert "does not fit" in note and size_text(need) in note and size_text(out.budget_bytes) in note, note
    # the minimum is real: planning at it fits (up to the refinement's rounding)
    again = _run(tiny, need * 1.02 / MIB)
    assert again.fits


def test_plan_is_deterministic_and_json(tiny):
    a, b = _run(tiny, None), _run(tiny, None)
    assert a.plan.model_dump_json() == b.plan.model_dump_json()
    assert Plan.model_validate_json(a.plan.model_dump_json()) == a.plan


def test_params_only_bound_overshoots_where_map_fits(tiny):
    """autoparallel / ColossalAI bound parameter state only; with activations dominating, their
    choice at a budget MAP meets exceeds it once activations are counted (MAP §1, §5.1)."""
    model, hw, _ = tiny
    free = _run(tiny, None)
    budget_mib = max(free.peak_bytes) * 0.6 / MIB
    ours = _run(tiny, budget_mib)
    theirs = _run(tiny, budget_mib, constrain="params")
    assert ours.fits
    sim = simulate(theirs.plan, model, hw).result
    assert max(d.peak_bytes for d in sim.devices) > ours.budget_bytes


def test_fixed_mesh_and_pipeline(tiny):
    model, hw, _ = tiny
    out = _run(tiny, None, mesh=[2], pp=2)
    assert len(out.plan.stages) == 2
    assert all(st.sharding[0].mesh == [2] and len(st.devices) == 2 for st in out.plan.stages)
    validate_plan(out.plan, model, hw)
    with pytest.raises(Exception, match="policy.mesh"):
        _run(tiny, None, mesh=[3])


def test_a_users_model_with_pytree_boundaries_plans():
    """A torch_module model whose layers pass dicts and tuples (tests/byom_models.py): its operator
    graphs trace (pytree inputs), and policy=map plans and simulates it within a budget that binds
    (between the minimum it reports and the unconstrained peak), and says "does not fit" below it."""
    from executor.profile_symbolic import profile_model
    from specs.profile import model_from_profile

    cfg = parse_model_config({"family": "torch_module", "name": "tiny_rope_layers",
                              "factory": "tests.byom_models:layered"})
    tr = TrainingSpec(global_batch=8, microbatch_size=4, precision="fp32")
    model = model_from_profile(profile_model(cfg, microbatch=4, dtype="fp32"))
    graphs, keys = model_op_graphs(cfg, 4, "fp32")
    assert len(keys) == 4  # embed, two blocks (one reads a dict, one a tuple: two graphs), head
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 4,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    hw = _hw("local_cpu")

    def plan(budget_bytes: float | None):
        pol = MapPolicy(memory_budget_gib=None if budget_bytes is None else budget_bytes / (1 << 30))
        return map_search(pol, model, hw, tr, ScheduleSpec())

    free = plan(None)
    assert free.fits
    top = max(free.peak_bytes)
    low = plan(1000)  # 1000 B: below the parameter state alone
    need = max(c.min_budget_bytes for c in low.stages)
    assert not low.fits and "does not fit" in " ".join(low.notes) and 0 < need < top, (need, top, low.notes)
    # halfway between the minimum and the unconstrained peak: feasible by the planner's own
    # minimum, and binding (the unconstrained plan is over it), so the outcome is determined
    budget = (need + top) // 2
    tight = plan(budget)
    assert tight.fits, tight.notes
    sim = simulate(validate_plan(tight.plan, model, hw), model, hw).result
    assert max(d.peak_bytes for d in sim.devices) <= tight.budget_bytes < top


def test_bad_policy_values_name_the_field(tiny):
    from planners.layout import PlanningError

    for kw, field in (({"pp": 7}, "policy.pp"), ({"pp": 3}, "policy.pp"), ({"devices": 9}, "policy.devices"),
                      ({"mesh": [2, 3]}, "policy.mesh")):
        with pytest.raises(PlanningError, match=field.replace(".", r"\.")):
            _run(tiny, None, **kw)
    with pytest.raises(ValueError, match="mesh"):
        MapPolicy(mesh=[-2, -2])
