"""benchmarks/fuzz_inputs.py covers the surface issue #22 names: every policy and its own knobs,
every experiment= preset as a base, and plan files from each planner's real plan."""
from __future__ import annotations

import random
from pathlib import Path

from benchmarks import fuzz_inputs as fz
from planners.policy import PolicyConfig

ROOT = Path(fz.__file__).resolve().parents[1]


def test_every_policy_knob_and_preset_is_drawn():
    rng = random.Random(0)
    draws = [fz.draw_overrides(rng) for _ in range(3000)]
    args = {a for d in draws for a in d}
    presets = {a.split("=", 1)[1] for a in args if a.startswith("experiment=")}
    assert presets == {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    kinds = {a.split("=", 1)[1] for a in args if a.startswith("policy=")}
    assert kinds >= {"even", "balanced", "manual", "map", "stronghold", "mpress", "capture", "throughput", "auto"}
    for kind, knobs in fz.POLICY_KNOBS.items():
        model = next(m for m in PolicyConfig.__args__[0].__args__ if m.model_fields["kind"].default == kind)
        assert set(knobs) <= set(model.model_fields), kind  # each knob is a real field of that policy
        for knob in knobs:
            assert any(a.startswith(f"policy.{knob}=") for d in draws if f"policy={kind}" in d for a in d), (kind, knob)


def test_plan_bases_come_from_every_planner():
    kinds = {a.split("=", 1)[1] for s in fz.BASE_SETS for a in s if a.startswith("policy=")}
    kinds |= {a.split("=", 1)[1].split("_")[0] for s in fz.BASE_SETS for a in s if a.startswith("experiment=")}
    assert kinds >= {"mpress", "stronghold", "map", "capture", "throughput", "balanced"}
