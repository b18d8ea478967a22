"""Failures the issue-#22 fuzzing (new seeds, every policy's knobs, every preset, mutated plans of
every planner) found: each ends in one line naming the field, never a traceback."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

import run
from planning import plan_for
from runconfig import UsageError


def _config(*overrides: str):
    with initialize_config_dir(config_dir=str(run.CONF_DIR), version_base="1.3"):
        return run.validate_config(compose("config", overrides=list(overrides)))


def test_map_refuses_an_interleaved_schedule_by_name(tmp_path):
    """seed 31337: policy=map with schedule=interleaved_1f1b built one stage with virtual_stages 2,
    whose pipeline depth (1 // 2 = 0) divided by zero in the simulator."""
    cfg = _config("+hardware=map_8xa100", "+model=gpt_tiny", "policy=map", "schedule=interleaved_1f1b",
                  "estimator=analytic")
    with pytest.raises(UsageError, match="schedule.virtual_stages is 2; use schedule=1f1b or gpipe"):
        plan_for(cfg, tmp_path)


def test_capture_refuses_fewer_merged_layers_than_nodes_by_name(tmp_path):
    """seed 31337: policy.merge_layers=2 on capture_cluster's 4 nodes reached the recommender, whose
    bare ValueError ("no plan places 2 layers on 4 x 4 GPUs") was an internal error."""
    cfg = _config("+hardware=capture_cluster", "+model=gpt_tiny", "policy=capture", "policy.merge_layers=2",
                  "policy.backend=simulator", f"profile_cache={tmp_path / 'cache'}", "estimator=analytic")
    with pytest.raises(UsageError, match="policy.merge_layers: 2 merged layers cannot occupy the 4 nodes"):
        plan_for(cfg, tmp_path)


def test_capture_bounds_the_exhaustive_search_by_name(tmp_path):
    """seed 2718: policy.search=exhaustive on GPT-3 2.6B's 34 layers over 16 GPUs (2e12 placements)
    ran past the fuzzer's 60 s deadline; now refused at once, naming policy.search and the merge
    target under which Algorithm 4 stays fast."""
    cfg = _config("+hardware=capture_cluster", "+model=gpt", "policy=capture", "policy.search=exhaustive",
                  "policy.scenarios=[pp]", "policy.backend=simulator", f"profile_cache={tmp_path / 'cache'}",
                  "estimator=analytic")
    with pytest.raises(UsageError, match=r"policy.search: exhaustive .* 2.06e\+12 plans .* policy.merge_layers <= 12"):
        plan_for(cfg, tmp_path)
