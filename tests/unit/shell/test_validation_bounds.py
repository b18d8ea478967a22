"""Spec fields have real bounds, and bad input becomes one line naming the field (issue #10)."""
from __future__ import annotations

import copy
import json
import math

import pytest
from hydra import compose, initialize_config_dir
from pydantic import ValidationError

import run
from reports.outputs import load_plan, load_result
from specs import HardwareSpec, TrainingSpec
from specs.result import Result
from tests.conftest import LOCAL_CPU, conf

DGX1 = conf("hardware", "dgx1")


def composed(*overrides: str) -> run.RunConfig:
    with initialize_config_dir(config_dir=str(run.CONF_DIR), version_base="1.3"):
        return run.validate_config(compose("config", overrides=list(overrides)))


def with_value(path: str, value) -> dict:
    d = copy.deepcopy(DGX1)
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return d


@pytest.mark.parametrize("path, value", [
    ("device.peak_tflops.fp16", 0), ("device.peak_tflops.fp16", -5), ("device.peak_tflops.fp16", math.nan),
    ("device.peak_tflops.fp16", -math.inf), ("device.peak_tflops.fp32", 1e300),
    ("device.compute_efficiency", 1e-300), ("device.compute_efficiency", 1.5), ("device.compute_efficiency", math.nan),
    ("device.hbm_gbps", math.inf), ("device.memory_bytes", 2**64), ("device.memory_bytes", 0),
    ("device.hbm_efficiency", 0.0), ("device.hbm_efficiency", 1.5),
    ("device.overlap_compute_slowdown", -0.1), ("device.overlap_compute_slowdown", 1.5),
    ("device.overlap_compute_slowdown", math.nan),
    ("device.gemm_efficiency.fp16", [[1e9, math.nan]]), ("device.gemm_efficiency.fp16", [[math.inf, 0.5]]),
    ("intra_node.fallback.collective_efficiency", 2.0),
    ("intra_node.fallback.latency_s", math.inf), ("intra_node.fallback.latency_s", -1e-6),
    ("intra_node.fallback.bw_gbps", 0), ("intra_node.fallback.bw_gbps", math.nan),
    ("host.pcie_gbps", math.inf), ("host.pcie_latency_s", math.nan), ("host.memory_bytes", 2**64),
    ("host.cpu_adam_params_per_s", 0), ("host.nvme_gbps", 1e-300), ("host.nvme_gbps", -1),
    ("nodes", 2**64), ("devices_per_node", 10**6),
])
def test_hardware_numbers_are_bounded_and_named(path, value):
    with pytest.raises(ValidationError) as err:
        HardwareSpec.model_validate(with_value(path, value))
    text = str(err.value)
    assert path.split(".")[-1] in text
    assert "Traceback" not in text


def test_the_message_gives_the_allowed_range():
    with pytest.raises(run.UsageError) as err:
        composed("+hardware=dgx1", "+model=gpt", "hardware.device.peak_tflops.fp16=nan")
    msg = str(err.value)
    assert "\n" not in msg
    assert "hardware.device.peak_tflops.fp16: must be a finite number in [1e-06, 10000], got nan" in msg


def test_shipped_hardware_is_within_the_bounds():
    for name in run.options("hardware"):
        HardwareSpec.model_validate(conf("hardware", name))


@pytest.mark.parametrize("field, value", [("global_batch", 2**64), ("global_batch", 2**40 + 1),
                                          ("microbatch_size", 2**41), ("num_microbatches", 2**64)])
def test_training_counts_are_bounded(field, value):
    data = {"global_batch": 8, "microbatch_size": 2, field: value}
    if field == "num_microbatches":
        data.pop("microbatch_size")
    with pytest.raises(ValidationError, match=field):
        TrainingSpec.model_validate(data)


def test_a_dtype_the_device_lacks_is_an_error_not_the_fp32_rate():
    # issue #10: training.precision=bf16 on a V100 silently used the fp32 rate (37 s instead of 4.7 s)
    with pytest.raises(run.UsageError) as err:
        composed("+hardware=dgx1", "+model=gpt", "training.precision=bf16")
    msg = str(err.value)
    assert "hardware.device.peak_tflops" in msg and "fp32, fp16" in msg and "training.precision=fp16" in msg
    dev = HardwareSpec.model_validate(DGX1).device
    with pytest.raises(ValueError, match="no bf16"):
        dev.flops_per_s("bf16")


@pytest.mark.parametrize("mode", ["execute", "compare"])
def test_modes_that_run_in_fp32_accept_any_precision(mode):
    # execute/compare predict for fp32 (the executor trains in fp32), so bf16 on a V100 is not refused here
    assert composed("+hardware=dgx1", "+model=gpt", "training.precision=bf16", f"mode={mode}").mode == mode
    assert composed("+hardware=local_cpu", "+model=gpt_tiny", f"mode={mode}").hardware == LOCAL_CPU


def test_unresolvable_interpolation_names_the_key():
    with pytest.raises(run.UsageError, match=r"^policy\.tp: .*nonexistent\.key") as err:
        composed("+hardware=dgx1", "+model=gpt", "policy.tp=${nonexistent.key}")
    assert "\n" not in str(err.value)


def result_dict(**over) -> dict:
    d = {"source": "simulated", "plan_id": "x", "model": "m", "hardware": "h",
         "devices": [{"device": 0, "capacity_bytes": 10, "peak_bytes": 5}],
         "iteration_time_s": 1.0, "samples_per_s": 8.0, "tflops_per_device": 1.0}
    d.update(over)
    return d


@pytest.mark.parametrize("field, value", [
    ("iteration_time_s", math.nan), ("iteration_time_s", math.inf), ("iteration_time_s", 0.0),
    ("iteration_time_s", None), ("samples_per_s", math.inf), ("samples_per_s", 0.0),
    ("tflops_per_device", math.nan), ("tflops_per_device", -1.0), ("schema_version", 2),
])
def test_result_numbers_are_finite_and_positive(field, value):
    with pytest.raises(ValidationError, match=field):
        Result.model_validate(result_dict(**{field: value}))


def test_a_failed_run_may_record_zero_time():
    assert Result.model_validate(result_dict(iteration_time_s=0.0, samples_per_s=0.0, tflops_per_device=0.0,
                                             failure="rank 1 died")).failure


def test_load_result_and_load_plan_reject_duplicate_keys_and_nan(tmp_path):
    good = json.dumps(result_dict())
    p = tmp_path / "results.json"
    p.write_text(good)
    assert load_result(p).iteration_time_s == 1.0
    p.write_text('{"iteration_time_s": 5.0, ' + good[1:])
    with pytest.raises(ValueError, match="iteration_time_s.*twice"):
        load_result(p)
    p.write_text(good.replace('"iteration_time_s": 1.0', '"iteration_time_s": NaN'))
    with pytest.raises(ValueError, match="NaN"):
        load_result(p)
    p.write_text('{"planner": "a", "planner": "b"}')
    with pytest.raises(ValueError, match="planner"):
        load_plan(p)


def test_one_line_folds_hydra_messages():
    text = ("In 'config': Could not find 'hardware/nope'\n\nAvailable options in 'hardware':\n\ta\n\tb\n"
            "Config search path:\n\tprovider=hydra")
    assert run.one_line(text) == "In 'config': Could not find 'hardware/nope'; Available options in 'hardware': a, b"


def test_internal_errors_print_one_line_and_log_the_traceback(tmp_path, capsys):
    def boom():
        raise RuntimeError("bug\nsecond line")

    with pytest.raises(SystemExit) as exit_:
        run.report_errors(boom, tmp_path)
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("memwall: internal error: RuntimeError: bug; second line (full traceback in ")
    assert "Traceback" in (tmp_path / "error.log").read_text() and "boom" in (tmp_path / "error.log").read_text()


def test_usage_errors_exit_2_and_interrupts_130(tmp_path, capsys):
    def usage():
        raise run.UsageError("invalid plan:\n  stages[0].dp: 3 does not divide 2")

    with pytest.raises(SystemExit) as exit_:
        run.report_errors(usage, tmp_path)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "memwall: invalid plan: stages[0].dp: 3 does not divide 2\n"

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        run.report_errors(interrupted, tmp_path)
    assert exit_.value.code == 130 and capsys.readouterr().err == "memwall: interrupted\n"


def test_hydra_and_yaml_errors_count_as_input_errors():
    import yaml
    from hydra.errors import ConfigCompositionException

    assert run.from_hydra(ConfigCompositionException("Could not find 'hardware/nope'"))
    assert run.from_hydra(yaml.YAMLError("while parsing a flow sequence"))
    assert not run.from_hydra(ZeroDivisionError("float division by zero"))
    assert run.null_group(["+hardware=null"]).startswith("hardware: '+hardware=null' names no hardware")
    assert run.null_group(["+hardware=dgx1", "experiment=null"]) is None


def test_device_count_is_bounded():
    with pytest.raises(ValidationError, match="at most 65536"):
        HardwareSpec.model_validate({**conf("hardware", "selene"), "nodes": 2**14})
