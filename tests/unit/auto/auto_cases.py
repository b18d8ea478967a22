"""Shared inputs of the policy=auto tests: the configs searched, each searched once per session, and
a fresh simulation to judge a plan's fit by."""
from __future__ import annotations

from costs.families import build_model, parse_model_config
from planners.auto.search import auto_search
from planners.policy import AutoPolicy, BalancedPolicy, MPressPolicy, StrongholdPolicy, ThroughputPolicy
from simulator import simulate
from specs import HardwareSpec, TrainingSpec
from specs.plan import ScheduleSpec, validate_plan
from tests.conftest import CPU_TRAINING, GIB, LOCAL_CPU, conf

MIB = 1 << 20
DGX1 = HardwareSpec.model_validate(conf("hardware", "dgx1"))
GPT_TRAINING = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")  # conf/config.yaml's
ONE_F_ONE_B = ScheduleSpec(kind="1f1b")
#: the singles planned from the specs alone (CAPTURE needs a profile, MAP operator graphs: the CLI
#: test runs those, tests/integration/shell/test_auto_cli.py)
SINGLES = {"balanced": BalancedPolicy, "throughput": ThroughputPolicy, "mpress": MPressPolicy,
           "stronghold": StrongholdPolicy}


def spec(name: str, training: TrainingSpec):
    """The closed-form spec the CLI builds for ``+model=name``."""
    return build_model(parse_model_config(conf("model", name)), training.act_dtype_bytes)


def budget_hardware(hw: HardwareSpec, capacity: int) -> HardwareSpec:
    device = hw.device.model_copy(update={"memory_bytes": capacity})
    return HardwareSpec.model_validate({**hw.model_dump(), "device": device.model_dump()})


def simulated_fit(plan, model, hw: HardwareSpec, capacity: int) -> tuple[bool, float, list[int]]:
    """(fits ``capacity`` on every device and host, iteration time, per-device peaks) from a fresh simulation."""
    result = simulate(validate_plan(plan, model, hw), model, hw, trace=False).result
    fits = all(d.peak_bytes <= capacity and not d.host_oom for d in result.devices)
    return fits, result.iteration_time_s, [d.peak_bytes for d in result.devices]


#: (model, hardware, training, memory_budget_gib): the tiny CPU models with and without a budget that
#: forces memory actions, and the MPress paper's smallest GPT on the DGX-1 under a 12 GiB budget
CASES = {
    "gpt_tiny-local_cpu": ("gpt_tiny", LOCAL_CPU, CPU_TRAINING, None),
    "gpt_tiny-local_cpu-1.2MiB": ("gpt_tiny", LOCAL_CPU, CPU_TRAINING, 1.2 * MIB / GIB),
    "bert_tiny-local_cpu-1.6MiB": ("bert_tiny", LOCAL_CPU, CPU_TRAINING, 1.6 * MIB / GIB),
    "gpt_5b3-dgx1-12GiB": ("gpt_5b3", DGX1, GPT_TRAINING, 12.0),
}
_OUTCOMES: dict[str, tuple] = {}


def searched(case: str):
    """(model, hardware, training, policy, outcome) of a case, searched once per session."""
    if case not in _OUTCOMES:
        name, hw, training, budget = CASES[case]
        model = spec(name, training)
        policy = AutoPolicy(singles=sorted(SINGLES), memory_budget_gib=budget)
        _OUTCOMES[case] = (model, hw, training, policy, auto_search(policy, model, hw, training, ONE_F_ONE_B))
    return _OUTCOMES[case]
