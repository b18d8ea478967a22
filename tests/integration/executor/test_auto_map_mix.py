"""policy=auto's MAP mixing (planners/auto/map_mix.py): a stage of a dp × tp pipeline replaced by
MAP's per-operator sharding of the same devices is a valid plan, simulated, and the executor runs
it (gloo, four ranks: a dp2 stage beside a MAP-sharded 2-device stage) within the issue's 5 % of
the simulated peak per rank."""
from __future__ import annotations

import contextlib
import io

from model_costs import model_spec
from planners.auto import map_mix
from planners.auto.search import auto_search
from runconfig import compose


def _setup():
    cfg = compose("+hardware=local_cpu", "hardware.devices_per_node=4", "+model=gpt_tiny", "policy=auto",
                  "policy.singles=[balanced,map]", "training.precision=fp32", "policy.microbatch_sizes=[2]")
    with contextlib.redirect_stdout(io.StringIO()):
        model = model_spec(cfg)
    return cfg, model, auto_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule, None)


def test_a_map_sharded_stage_beside_a_dp_stage_plans_simulates_and_runs():
    from executor.measure import execute

    cfg, model, out = _setup()
    base = next(c for c in out.candidates if c.layout is not None and len(c.plan.stages) == 2
                and all(len(s.devices) == 2 and not s.sharding for s in c.plan.stages))
    stage = map_mix._sharded_stage(base.plan, 1, model, cfg.hardware, out.capacity_bytes)
    mixed = map_mix.simulated_candidate("mixed", map_mix._with_stage(base.plan, 1, stage), model, cfg.hardware,
                               out.capacity_bytes)
    st0, st1 = mixed.plan.stages
    assert st0 == base.plan.stages[0] and st1.sharding and st1.devices == base.plan.stages[1].devices
    got = execute(mixed.plan, cfg.model, cfg.hardware, iterations=1, warmup=1, timeout_s=300)
    assert got.failure is None
    simulated = {d.device: d.peak_bytes for d in mixed.result.devices}
    for d in got.devices:
        assert abs(simulated[d.device] - d.peak_bytes) <= 0.05 * d.peak_bytes, \
            (d.device, simulated[d.device], d.peak_bytes)


def test_map_mixed_tries_every_multi_device_stage_in_turn():
    """map_mixed on a pp2 of dp2 stages: each stage is tried as MAP's sharding (the next on top of
    the last kept one), every candidate simulated."""
    cfg, model, out = _setup()
    base = next(c for c in out.candidates if c.layout is not None and c.fits and len(c.plan.stages) == 2
                and all(len(s.devices) == 2 and not s.sharding for s in c.plan.stages))
    got = map_mix.map_mixed(base, model, cfg.hardware, out.capacity_bytes)
    assert {i for c in got for i, s in enumerate(c.plan.stages) if s.sharding} == {0, 1}
    for c in got:
        assert c.result.iteration_time_s > 0 and c.how.startswith(base.how)
