"""policy=auto and CAPTURE's profile (planning._plan_auto): above AUTO_CAPTURE_MAX_LAYERS layers an
uncached profile is not built (it grows as L²: 1014 s at 502 layers), CAPTURE is left out with the
reason, and the search still answers; a cached profile is used whatever the size."""
from __future__ import annotations

import planning
from runconfig import compose


def _cfg(tmp_path, layers: int):
    return compose("+hardware=local_cpu", "hardware.devices_per_node=2", "+model=gpt_tiny",
                   f"model.num_layers={layers}", "policy=auto", "policy.singles=[balanced,capture]",
                   "policy.max_layouts=2", "policy.improve_layouts=0", f"profile_cache={tmp_path}")


def test_an_uncached_profile_of_a_deep_model_is_left_out_with_the_reason(tmp_path, capsys):
    layers = planning.AUTO_CAPTURE_MAX_LAYERS + 2
    cfg = _cfg(tmp_path, layers)
    model = planning.model_spec(cfg)
    assert model.num_layers > planning.AUTO_CAPTURE_MAX_LAYERS
    _, plan = planning._plan_auto(cfg, model, tmp_path, None)
    out = capsys.readouterr().out
    assert "policy=capture left out: its profile is not cached" in out
    assert not list(tmp_path.glob("capture_*.json"))  # nothing was profiled
    assert plan.planner == "auto"


def test_a_shallow_model_is_profiled_and_cached(tmp_path, capsys):
    cfg = _cfg(tmp_path, 6)
    model = planning.model_spec(cfg)
    planning._plan_auto(cfg, model, tmp_path, None)
    assert "policy=capture left out" not in capsys.readouterr().out
    assert list(tmp_path.glob("capture_*.json"))
