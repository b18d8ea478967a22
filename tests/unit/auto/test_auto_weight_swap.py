"""policy=auto gains MPress's live weight swap (issue 24: ``offload.weight_swap_layers``): where a
budget leaves a layout's stages over capacity with their activations compacted, the compaction's
last resort puts layers' weights, gradients and optimizer state in host memory, as policy=mpress's
step 6 does (planners/mpress/compact.py, planners/mpress/weights.py)."""
from __future__ import annotations

from planners.auto.search import auto_search
from planners.policy import AutoPolicy
from tests.conftest import CPU_TRAINING, GIB, LOCAL_CPU
from tests.unit.auto.auto_cases import MIB, ONE_F_ONE_B, simulated_fit, spec


def test_a_tight_budget_is_met_with_weights_in_host_memory():
    model = spec("gpt_tiny", CPU_TRAINING)
    budget = int(0.95 * MIB)  # under every layout's peak with its activations compacted (gpt_tiny, mb 1)
    out = auto_search(AutoPolicy(memory_budget_gib=budget / GIB), model, LOCAL_CPU, CPU_TRAINING, ONE_F_ONE_B)
    assert out.fits
    swapped = [st.offload.weight_swap_layers for st in out.plan.stages]
    assert any(swapped), "the answer fits without weight swap: the budget does not test it"
    fits, _, peaks = simulated_fit(out.plan, model, LOCAL_CPU, budget)
    assert fits and max(peaks) <= budget
    # the same plan with the weights back on the devices is over the budget: the swap is what fits it
    kept = out.plan.model_copy(update={"stages": [
        st.model_copy(update={"offload": st.offload.model_copy(update={"weight_swap_layers": []})})
        for st in out.plan.stages]})
    fits_kept, _, peaks_kept = simulated_fit(kept, model, LOCAL_CPU, budget)
    assert not fits_kept and max(peaks_kept) > budget
