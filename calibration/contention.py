"""Contended CPU rates from a real executor run (issue #11 item 5).

``mode=calibrate``'s microbenchmarks (calibration/calibrate.py) time one kernel kind at a time. On a
2-core VM with four gloo ranks and neighbours' steal, the executor's own passes ran about twice as
long as those rates predict (benchmarks/cpu_time_fidelity.py, 2026-11-23: median |error| 49 % with
a calibration made the same minute). So the last step of calibrating a CPU is to run one small
plan through the executor, time every action (executor.timeline), simulate the same plan with the
microbenchmark rates, and fold the ratio of measured to simulated means into the rates that price
each kind of action:

- forward and backward passes: ``op_overhead_s`` up and ``peak_tflops`` down by the same factor
  (both terms of a pass's time, costs, scale alike);
- the data-parallel all-reduce: ``collective_latency_s`` up, ``collective_efficiency`` down;
- the optimizer step (a memory-bound pass over the state): ``hbm_gbps`` down.

Point-to-point sends are left as calibrated: their measured durations include waiting for the
peer. So is ``dtensor_op_overhead_s``: it is measured on the executor's own Megatron TP code
(calibration.dtensor.dtensor_op_overhead_s), which this DTensor-free reference run does not
run. The reference plan is pipeline-free (pp 1 x dp 4) so that no wait enters the compute means.
The factors are medians over the ranks' actions; the validation in cpu_time_fidelity.py reports
which plans were fitted on.
"""
from __future__ import annotations

import statistics

from specs.compare import ActionError
from specs.hardware import HardwareSpec

#: what :func:`fit_from_run` runs for gpt_tiny on local_cpu: 1F1B, pp 1 x dp 4, global batch 128 in
#: microbatches of 32 (8 per replica), in cpu_time_fidelity.PLANS' terms
REFERENCE = ("gpt_tiny", "1f1b", 1, 1, 4, 1, 128, 32)


def _ratio(actions: list[ActionError], kinds: tuple[str, ...]) -> float | None:
    r = [a.measured_mean_s / a.simulated_mean_s for a in actions
         if a.action in kinds and a.simulated_mean_s and a.measured_mean_s]
    return statistics.median(r) if r else None


def contention_factors(actions: list[ActionError]) -> dict[str, float]:
    """Measured / simulated mean duration per kind of action: ``compute`` (forward, backward),
    ``allreduce``, ``optimizer``; a kind the run did not have is left out."""
    out = {}
    for name, kinds in (("compute", ("forward", "backward")), ("allreduce", ("allreduce",)),
                        ("optimizer", ("optimizer",))):
        f = _ratio(actions, kinds)
        if f is not None:
            out[name] = f
    return out


def apply_factors(hw: HardwareSpec, factors: dict[str, float]) -> HardwareSpec:
    """``hw`` with each kind's rates scaled by its factor (see the module docstring). Efficiencies
    stay in (0, 1]: an all-reduce faster than the ring model at efficiency 1 keeps 1."""
    dev = hw.device
    upd: dict = {}
    c = factors.get("compute")
    if c:
        upd["op_overhead_s"] = dev.op_overhead_s * c
        upd["peak_tflops"] = {k: v / c for k, v in dev.peak_tflops.items()}
    o = factors.get("optimizer")
    if o:
        upd["hbm_gbps"] = dev.hbm_gbps / o
    out = hw.model_copy(update={"device": dev.model_copy(update=upd)})
    a = factors.get("allreduce")
    if a:
        def scaled(link):
            if link is None:
                return None
            lat = link.collective_latency_s if link.collective_latency_s is not None else link.latency_s
            eff = min(1.0, link.collective_efficiency / a)
            return link.model_copy(update={"collective_latency_s": lat * a, "collective_efficiency": eff})

        intra = out.intra_node
        out = out.model_copy(update={"intra_node": intra.model_copy(update={
            "links": [scaled(l) for l in intra.links],
            "all_to_all": scaled(intra.all_to_all), "fallback": scaled(intra.fallback)})})
    return HardwareSpec.model_validate(out.model_dump(mode="json"))  # re-checks every bound


def fit_from_run(hw: HardwareSpec, model_cfg, model_spec, iterations: int = 3,
                 microbatch_per_replica: int = 8) -> tuple[HardwareSpec, dict[str, float]]:
    """Run ``model_cfg`` (its ModelSpec ``model_spec``, fp32) data-parallel over every device of
    one node of ``hw``, pipeline-free, time each action, and return ``hw`` scaled by the measured /
    simulated factors (:func:`contention_factors`) together with them."""
    from executor.measure import execute_run, measured_timeline
    from planners import make_plan
    from planners.policy import ManualPolicy
    from simulator import simulate
    from simulator.trace import x_slices
    from specs.compare import slice_action_errors
    from specs.plan import ScheduleSpec
    from specs.training import TrainingSpec

    n = hw.devices_per_node
    training = TrainingSpec(global_batch=n * microbatch_per_replica * 4, microbatch_size=n * microbatch_per_replica,
                            precision="fp32")
    plan = make_plan(ManualPolicy(pp=1, dp=n, tp=1), model_spec, hw, training, ScheduleSpec(kind="1f1b"))
    res, out = execute_run(plan, model_cfg, hw, iterations=iterations, warmup=1, timeout_s=300, device="cpu",
                           model_spec=model_spec)
    if res.failure:
        raise RuntimeError(f"the reference run failed: {res.failure.splitlines()[0]}")
    _, _, every = measured_timeline(plan, out, 1)
    factors = contention_factors(slice_action_errors(x_slices(simulate(plan, model_spec, hw).trace), every))
    return apply_factors(hw, factors), factors
