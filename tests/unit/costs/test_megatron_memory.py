"""First-stage (and per-stage) memory of Megatron-LM configurations against Megatron's published
memory model (benchmarks/validate_megatron_memory.py prints the full comparison)."""
from __future__ import annotations

import pytest

from benchmarks.validate_megatron_memory import (
    SEQ, TABLE3, korthikanti_stage_activation_bytes, megatron_static_bytes, memwall_first_stage,
)
import costs.activations


@pytest.mark.parametrize("row", TABLE3, ids=[r[0] for r in TABLE3])
def test_first_stage_static_is_megatrons_most_loaded_shard(row):
    """18 B/param on (blocks / p + h·V) / t (theoretical_memory_usage.py); memwall also counts the
    learned position table (s·h, replicated over TP), which Megatron's estimate leaves out."""
    name, a, h, L, t, p, gpus, batch, micro = row
    _, _, _, got = memwall_first_stage(a, h, L, t, p, gpus, batch, micro, "none")
    without_position = got["static"] - 18 * SEQ * h
    assert without_position == pytest.approx(megatron_static_bytes(h, L, t, p), rel=1e-3)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("row", TABLE3[1:], ids=[r[0] for r in TABLE3[1:]])
def test_every_stage_holds_korthikantis_activations(row, recompute):
    """Korthikanti et al. 2022 Table 2 per layer x min(p − i, m) in flight, embedding terms on
    the first stage, output layer on the last; the one term the published form leaves out is the
    stage output, which Megatron frees once sent (deallocate_pipeline_outputs) — memwall may hold it."""
    name, a, h, L, t, p, gpus, batch, micro = row
    model, _, plan, _ = memwall_first_stage(a, h, L, t, p, gpus, batch, micro, recompute)
    m = plan.training.microbatches
    for i, st in enumerate(plan.stages):
        n = costs.activations.in_flight_microbatches(plan, i)
        got = n * costs.activations.stage_activation_bytes(model, plan, st)
        want = korthikanti_stage_activation_bytes(SEQ, micro, h, a, L, t, p, m, recompute, i)
        out = n * micro * model.layers[st.layer_stop - 1].output_bytes_per_sample if i < p - 1 else 0
        assert got == pytest.approx(want, rel=1e-4) or got == pytest.approx(want + out, rel=1e-4), (i, got, want, out)
