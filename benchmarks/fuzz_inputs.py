"""Fuzz memwall's inputs (issue #10): random CLI override sets and mutated plan.json files.

Every input must end in a Result or a one-line error (exit 2) naming the field; counted here:
``traceback`` (an exception escaped, or an internal error was reported), ``slow`` (over
--slow-s seconds), ``hang`` (killed at the deadline), ``multiline`` (an error message over several lines), ``nonsense`` (a result with a non-finite
or non-positive time, or more TFLOP/s per device than the device's achievable peak) and, for
plans, ``wrong_accepted`` (validate_plan passed a plan that breaks a rule checked independently).

    python benchmarks/fuzz_inputs.py --cli 300 --plans 300            # in-process, fast
    python benchmarks/fuzz_inputs.py --cli 40 --subprocess            # real `python -m run` runs
    python benchmarks/fuzz_inputs.py --replay /tmp/fuzz_inputs_x/plan_0007_hang.json

Every failing case (a kind above other than ok/usage/rejected) is printed and saved, one JSON file
per case under ``--out`` (default: a new temporary directory, named at the end): the exact override
list (CLI) or the exact plan text and the base it was mutated from (plans), the seed and index,
what was seen (detail, seconds) and the traceback, captured stderr or the error.log of an internal
error; a hang's traceback is where the deadline found it. ``--replay FILE`` reruns that one case
and prints what it does now (exit 0: no longer failing, 1: still failing).

The last line is ``tracebacks=N slow=N hangs=N nonsense=N wrong_accepted=N multiline_errors=N``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ---- CLI override sets ---------------------------------------------------------------------
HARDWARE = ["dgx1", "dgx2", "v100_single", "a10_cluster", "capture_cluster", "map_8xa100", "h100_node", "local_cpu"]
MODELS = ["gpt", "bert", "gpt_tiny", "bert_tiny", "moe_tiny", "wresnet_tiny", "gpt3_2b6", "bert_0b64"]
#: models for the searching planners (MAP's ILP, MPress's emulator, CAPTURE's profiles): each case stays short
MODELS_SMALL = ["gpt_tiny", "bert_tiny", "moe_tiny", "wresnet_tiny", "gpt", "bert_0b64"]
BAD_NUMBERS = ["0", "-1", "-5", "nan", "inf", "-inf", "1e-300", "1e300", str(2**64), "0.5", "abc", "null",
               "'${nonexistent.key}'", "''", "[1,2]"]
NUMBER_FIELDS = {
    "hardware.device.peak_tflops.fp16": ["125", "1e-3", "1e4"],
    "hardware.device.peak_tflops.fp32": ["15.7", "1e-6"],
    "hardware.device.compute_efficiency": ["0.001", "1", "0.3"],
    "hardware.device.memory_bytes": ["1", "1073741824", str(2**42)],
    "hardware.device.hbm_gbps": ["900", "1e-6"],
    "hardware.host.pcie_gbps": ["12", "1e-6", "1e15"],
    "hardware.host.pcie_latency_s": ["0", "1"],
    "hardware.host.memory_bytes": ["1", str(2**40)],
    "hardware.host.cpu_adam_params_per_s": ["1", "1e9"],
    "hardware.host.nvme_gbps": ["0", "3.2"],
    "hardware.intra_node.fallback.latency_s": ["0", "1e-5", "1"],
    "hardware.intra_node.fallback.bw_gbps": ["10", "1e-6"],
    "hardware.nodes": ["1", "2", "4"],
    "hardware.devices_per_node": ["1", "2", "8"],
    "training.global_batch": ["1", "8", "64", "128"],
    "training.microbatch_size": ["1", "2", "4", "8"],
    "training.num_microbatches": ["1", "4", "8"],
    "policy.tp": ["1", "2", "4", "8"],
    "policy.dp": ["1", "2", "4"],
    "policy.pp": ["1", "2", "4", "8"],
    "schedule.virtual_stages": ["1", "2", "4"],
    "schedule.weight_store": ["true", "false", "maybe"],
    "schedule.zb_memory_limit": ["1", "2", "0.1", "0", "-1", "1e9", "null", "x"],
    "schedule.microbatch_group_size": ["1", "2", "3", "5", "8", "0", "-1", "1e9", "null", "x"],
}
CHOICE_FIELDS = {
    "training.precision": ["fp32", "fp16", "bf16", "fp8"],
    "policy": ["even", "balanced", "manual"],
    "schedule": ["gpipe", "1f1b", "pipedream_async", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "zb_1p", "zb_2p", "nope"],
    "policy.recompute": ["none", "full", "half", "selective", "op_sac", "null"],
    "estimator": ["analytic", "simulator"],
    "training.optimizer": ["adam", "sgd"],
    "policy.zero_stage": ["0", "1", "2", "3", "4"],
    # issue 27's knobs (manual / even / balanced)
    "policy.sequence_parallel": ["true", "false"],
    "policy.distributed_optimizer": ["true", "false"],
    "policy.overlap_grad_reduce": ["true", "false"],
    "policy.overlap_param_gather": ["true", "false"],
    "policy.p2p_scatter_gather": ["true", "false"],
    "policy.p2p_blocking": ["true", "false"],
    "policy.cp": ["1", "2", "4", "0"],
    "policy.recompute_num_layers": ["1", "2", "0", "null"],
    "policy.recompute_every": ["1", "2", "0", "null"],
    "model.fused_swiglu": ["true", "false", "maybe"],
    "model.head_dim": ["null", "8", "16", "7", "0", "-2", "1e9"],
    "model.qkv_bias": ["true", "false", "maybe"],
    "model.qk_norm": ["true", "false", "maybe"],
}
ODD_ARGS = ["+hardware=null", "+hardware=nope", "foo=[", "+foo=1", "hardware=null", "+model=null",
            "training='${oops}'", "hardware.device=3", "mode=nope"]


#: every policy's own knobs (conf/policy/*.yaml, planners/policy.py), sane and absurd values
POLICY_KNOBS = {
    "map": {"memory_budget_gib": ["1", "20", "80", "1e-3", "1e7"], "mesh": ["[2,4]", "[1]", "[8]", "[3,3]", "[0]",
                                                                      "[1,1,1,1]", "[65536,2]", "[]", "[2,2,2]"],
            "devices": ["1", "2", "3", "8", "100"], "constrain": ["all", "params", "nope"], "pp": ["1", "2", "3"],
            "alpha": ["0.25", "4", "5"], "budgets": ["1", "3", "41"], "memory_slots": ["10", "9", "5000"],
            "ilp_time_limit_s": ["1", "5", "0"], "refine": ["0", "1", "21"]},
    "stronghold": {"window_layers": ["1", "2", "8", "1000", str(2**40)], "pp": ["1", "2", "3", "8", "100"],
                   "recompute": ["none", "full"], "nvme": ["auto", "on", "off", "maybe"]},
    "mpress": {"partition": ["balanced", "even", "capture", "nope"], "pp": ["1", "2", "3", "8", "100"],
               "techniques": ["[recompute]", "[cpu_swap]", "[d2d_swap]", "[cpu_swap,d2d_swap]", "[]", "[foo]"],
               "mapping": ["search", "identity", "x"], "striping": ["weighted", "equal", "none", "x"],
               "max_simulations": ["1", "2", "5", "40", "10001"]},
    "capture": {"batch_sizes": ["[8,16]", "[16]", "[0]", "[]", "[3]", "[4096]"], "num_microbatches": ["1", "2", "4",
                                                                                                    "1000"],
                "scenarios": ["[pp]", "[dp2,tp2]", "[pp,dp4,tp4]", "[]", "[tp8]"], "backend": ["simulator"],
                "recompute": ["none", "full"], "pipeline_only": ["true", "false"],
                "merge_layers": ["1", "2", "4", "1000"], "search": ["exact", "exhaustive"],
                "compare_throughput": ["true", "false"], "smallest_hardware": ["true", "false"]},
    "throughput": {"recompute": ["none", "full", "half"], "pipeline_only": ["true", "false"]},
    # issue 23; max_nodes and the model sizes stay small so that find=fewest_nodes / largest_model,
    # a whole search per probe, keep a case short
    "auto": {"memory_budget_gib": ["0.001", "1", "12", "1e-9", "1e7"],
             "find": ["fastest", "fewest_nodes", "largest_model", "smallest"],
             "singles": ["[balanced]", "[mpress,stronghold]", "[]", "[capture]", "[map]", "[balanced,balanced]",
                         "[manual]"],
             "microbatch_sizes": ["[1]", "[1,2,4]", "[3]", "[0]", "[]", "[1,2,3,4,5,6,7,8,9]"],
             "schedules": ["[1f1b]", "[gpipe]", "[pipedream_async]", "[]", "[interleaved_1f1b]"],
             "allow_async": ["true", "false", "null"], "zero_stages": ["[0]", "[0,1,2,3]", "[3]", "[]", "[4]"],
             "max_layouts": ["1", "2", "12", "0", "1001"], "max_simulations": ["1", "5", "120", "0"],
             "max_nodes": ["1", "2", "8", "0", "70000"], "scale": ["layers", "hidden", "width"]},
}
#: every experiment= preset (a base whose fields the case then changes)
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
#: fields a preset case may change (its own hardware and model stay)
PRESET_FIELDS = ["training.global_batch", "training.microbatch_size", "training.num_microbatches",
                 "training.precision", "hardware.nodes", "hardware.devices_per_node", "hardware.device.memory_bytes",
                 "hardware.host.memory_bytes", "schedule", "estimator"]


def _policy_knobs(rng: random.Random, kind: str) -> list[str]:
    """0..3 of policy ``kind``'s own knobs, set to sane or (now and then) absurd values."""
    knobs = POLICY_KNOBS[kind]
    args = []
    for key in rng.sample(sorted(knobs), min(len(knobs), rng.randint(0, 3))):
        pool = knobs[key] + (BAD_NUMBERS if rng.random() < 0.2 else [])
        args.append(f"policy.{key}={rng.choice(pool)}")
    if kind == "capture" and not any(a.startswith("policy.backend=") for a in args):
        args.append("policy.backend=simulator")  # auto on local_cpu would run torch ranks: not this tool's job
    return args


def draw_overrides(rng: random.Random) -> list[str]:
    """One random override set: +hardware/+model, then 1..4 fields set to sane or absurd values;
    or (issue #22) a policy with its own knobs, or an experiment= preset with a few fields changed."""
    r = rng.random()
    if r < 0.25:  # a preset as the base
        preset = rng.choice(PRESETS)
        args = [f"experiment={preset}"]
        kind = preset.split("_")[0]
        if kind in POLICY_KNOBS and rng.random() < 0.6:
            args += _policy_knobs(rng, kind)
        for key in rng.sample(PRESET_FIELDS, rng.randint(0, 2)):
            pool = NUMBER_FIELDS.get(key) or CHOICE_FIELDS.get(key)
            if key in NUMBER_FIELDS and rng.random() < 0.3:
                pool = BAD_NUMBERS
            args.append(f"{key}={rng.choice(pool)}")
        return args
    if r < 0.6:  # a planner and its own knobs
        kind = rng.choice(sorted(POLICY_KNOBS))
        hw, model = rng.choice(HARDWARE), rng.choice(MODELS_SMALL)
        if kind == "capture" and rng.random() < 0.5:
            hw = "capture_cluster"
        args = [f"+hardware={hw}", f"+model={model}", f"policy={kind}", *_policy_knobs(rng, kind)]
        for key in rng.sample(["training.global_batch", "training.microbatch_size", "training.precision",
                               "schedule"], rng.randint(0, 2)):
            pool = NUMBER_FIELDS.get(key) or CHOICE_FIELDS.get(key)
            args.insert(3 if key == "schedule" else len(args), f"{key}={rng.choice(pool)}")  # a group before its knobs
        args.append("estimator=analytic" if rng.random() < 0.5 else "estimator=simulator")
        return args
    args = [f"+hardware={rng.choice(HARDWARE)}", f"+model={rng.choice(MODELS)}"]
    order = {"policy": 0, "schedule": 0}  # a group choice must come before its fields
    fields = rng.sample(sorted(NUMBER_FIELDS) + sorted(CHOICE_FIELDS), rng.randint(1, 4))
    for key in sorted(fields, key=lambda k: order.get(k, 1)):
        if key in CHOICE_FIELDS:
            args.append(f"{key}={rng.choice(CHOICE_FIELDS[key])}")
        else:
            pool = NUMBER_FIELDS[key] + BAD_NUMBERS
            args.append(f"{key}={rng.choice(pool)}")
    if rng.random() < 0.05:
        args.append(rng.choice(ODD_ARGS))
    if not any(a.startswith("estimator=") for a in args):
        args.append("estimator=analytic" if rng.random() < 0.5 else "estimator=simulator")
    return args


def result_problem(result, cfg_hardware, precision: str) -> str | None:
    """Why a Result is nonsense, or None: finite positive time/throughput, TFLOP/s within the
    device's achievable peak for the precision it ran in, peaks >= 0."""
    for name in ("iteration_time_s", "samples_per_s", "tflops_per_device"):
        v = getattr(result, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v)):
            return f"{name}={v}"
    if not (result.iteration_time_s > 0 and result.samples_per_s > 0):
        return f"iteration_time_s={result.iteration_time_s} samples_per_s={result.samples_per_s}"
    dev = cfg_hardware["device"] if isinstance(cfg_hardware, dict) else cfg_hardware.device.model_dump()
    from specs.hardware import DeviceSpec  # best GEMM rate: peak x the curve's top x compute_efficiency
    dtype = precision if precision in dev["peak_tflops"] else "fp32"
    rate = DeviceSpec(**dev).flops_per_s(dtype) / 1e12
    if result.tflops_per_device > rate * 1.001:
        return f"tflops_per_device={result.tflops_per_device:.4g} > achievable {rate:.4g}"
    if not result.devices or any(d.peak_bytes < 0 for d in result.devices):
        return "no devices or a negative peak"
    return None


TAIL = 20000  # characters of captured output kept in a saved case


def _text(out) -> str:
    return (out.decode(errors="replace") if isinstance(out, bytes) else out or "")[-TAIL:]


def _error_log(outdir: Path, info: dict | None) -> None:
    """An internal error's traceback (run.report_errors writes it to <outdir>/error.log) into ``info``."""
    log = outdir / "error.log"
    if info is not None and log.exists():
        info["traceback"] = log.read_text()[-TAIL:]


def cli_case_subprocess(args: list[str], outdir: Path, slow_s: float, kill_s: float,
                        info: dict | None = None) -> tuple[str, str, float]:
    """``info`` (optional) receives what a saved case needs: stdout, stderr, the traceback."""
    info = {} if info is None else info
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "run", *args, f"hydra.run.dir={outdir}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=kill_s)
    except subprocess.TimeoutExpired as exc:
        info.update(stdout=_text(exc.stdout), stderr=_text(exc.stderr))
        return "hang", f"killed after {kill_s} s", kill_s
    dt = time.perf_counter() - t0
    info.update(stdout=_text(proc.stdout), stderr=_text(proc.stderr))
    _error_log(outdir, info)
    err = proc.stderr.strip()
    if "Traceback" in proc.stderr or "Traceback" in proc.stdout:
        return "traceback", err.splitlines()[-1] if err else "", dt
    if proc.returncode == 1 and "internal error" in err:
        return "traceback", err, dt
    if proc.returncode == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if len(lines) != 1 or not lines[0].startswith("memwall: "):
            return "multiline", f"usage error on {len(lines)} lines: {err[:200]}", dt
        return ("slow" if dt > slow_s else "usage"), lines[0], dt
    from modes import NOT_FIT_STATUS

    if proc.returncode == NOT_FIT_STATUS and not (err.splitlines() or [""])[-1].startswith("memwall: plan "):
        return "multiline", f"exit {NOT_FIT_STATUS} without its one 'memwall: plan ...' line: {err[-200:]}", dt
    if proc.returncode not in (0, NOT_FIT_STATUS):  # 3: the plan does not fit; its results are checked below
        return "traceback", f"rc={proc.returncode}: {err[-200:]}", dt
    from reports.outputs import load_result
    from omegaconf import OmegaConf

    try:
        result = load_result(outdir / "results.json")
    except Exception as exc:  # noqa: BLE001
        return "nonsense", f"results.json does not load: {exc}", dt
    cfg = OmegaConf.to_container(OmegaConf.load(outdir / ".hydra" / "config.yaml"), resolve=True)
    bad = result_problem(result, cfg["hardware"], cfg["training"]["precision"])
    if bad:
        return "nonsense", bad, dt
    return ("slow" if dt > slow_s else "ok"), "", dt


class Deadline(BaseException):
    """A case ran past its deadline. A BaseException, so that the shell's catch-all
    (run.report_errors: ``except Exception`` -> "internal error") lets it through: a hang is
    counted as a hang, not as a traceback."""


@contextlib.contextmanager
def deadline(seconds: float):
    def on_alarm(signum, frame):
        raise Deadline(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cli_case_inprocess(args: list[str], outdir: Path, slow_s: float, kill_s: float,
                       info: dict | None = None) -> tuple[str, str, float]:
    """The shell's behaviour without a new interpreter: compose with Hydra's Compose API, then the
    same validate + run + error reporting as ``python -m run`` (run.report_errors). ``info``
    (optional) receives stdout, stderr and the traceback (a hang's: where the deadline hit)."""
    info = {} if info is None else info
    from hydra import compose, initialize_config_dir

    import run as shell

    t0 = time.perf_counter()
    problem = shell.null_group(args)
    if problem:
        return "usage", problem, 0.0
    err, out = io.StringIO(), io.StringIO()
    status, detail = "ok", ""
    try:
        with deadline(kill_s), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                with initialize_config_dir(config_dir=str(shell.CONF_DIR), version_base="1.3"):
                    cfg = compose("config", overrides=args)
            except Exception as exc:  # noqa: BLE001
                status = "usage" if shell.from_hydra(exc) else "traceback"
                detail = f"{type(exc).__name__}: {shell.one_line(str(exc))[:200]}"
                info["traceback"] = traceback.format_exc()[-TAIL:]
            else:
                holder = {}

                def body():
                    rc = shell.validate_config(cfg)
                    holder["cfg"] = rc
                    return shell.run(rc, outdir)

                result = None
                try:
                    result = shell.report_errors(body, outdir)
                except SystemExit as exc:
                    result = getattr(exc, "result", None)  # modes.PlanDoesNotFit: a Result, exit 3
                    if result is None:
                        status = "usage" if exc.code == 2 else "traceback"
                        detail = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
                if result is not None:
                    rc = holder["cfg"]
                    bad = result_problem(result, rc.hardware, rc.training.precision.value)
                    if bad:
                        status, detail = "nonsense", bad
    except Deadline:
        info.update(stdout=_text(out.getvalue()), stderr=_text(err.getvalue()), traceback=traceback.format_exc()[-TAIL:])
        return "hang", f"over {kill_s} s", kill_s
    dt = time.perf_counter() - t0
    info.update(stdout=_text(out.getvalue()), stderr=_text(err.getvalue()))
    _error_log(outdir, info)
    if status in ("ok", "usage") and dt > slow_s:
        status = "slow"
    return status, detail, dt


# ---- plan mutations ----------------------------------------------------------------------------
BAD_VALUES = [0, -1, 2**64, 2**40 + 1, float("inf"), float("nan"), 1e300, 1e-300, "x", None, True, [], {}]


#: the override sets of the real plans that plan cases mutate (a saved case names its set)
BASE_SETS = [["+hardware=dgx1", "+model=gpt_tiny", "policy=even", "policy.dp=2"],
             ["+hardware=dgx2", "+model=bert_tiny", "schedule=interleaved_1f1b", "policy=even", "policy.pp=2", "policy.dp=4", "training.microbatch_size=4"],
             ["+hardware=dgx1", "+model=gpt_tiny", "schedule=gpipe", "policy=manual", "policy.pp=4", "policy.dp=2"],
             ["+hardware=capture_cluster", "+model=moe_tiny", "policy=balanced", "training.microbatch_size=8"],
             # issue #22: each planner's real plan (MPress with D2D swaps and recomputation, STRONGHOLD's
             # windows, MAP's sharding and checkpoints, CAPTURE's and the throughput planner's hybrid stages)
             ["experiment=mpress_bert_0b64_pipedream"],
             ["+hardware=local_cpu", "+model=gpt_tiny", "policy=mpress"],
             ["+hardware=v100_single", "+model=gpt_tiny", "policy=stronghold", "policy.window_layers=2"],
             ["+hardware=dgx1", "+model=bert_tiny", "policy=stronghold", "policy.pp=2"],
             ["+hardware=map_8xa100", "+model=gpt_tiny", "policy=map", "policy.devices=4", "policy.pp=2"],
             ["+hardware=map_8xa100", "+model=gpt_tiny", "policy=map", "policy.memory_budget_gib=0.05"],
             ["+hardware=capture_cluster", "+model=gpt_tiny", "policy=capture", "policy.backend=simulator"],
             ["+hardware=capture_cluster", "+model=bert_tiny", "policy=throughput"],
             # issue #23: policy=auto's plan (layouts x per-layer actions x windows, or a single's)
             ["+hardware=local_cpu", "+model=gpt_tiny", "policy=auto", "training.precision=fp32",
              "hardware.device.memory_bytes=10000000"]]


def base_plans(sets: list[list[str]] | None = None):
    """A few real plans (with their model and hardware) from the shipped configs: one per
    override set of ``sets`` (default ``BASE_SETS``)."""
    from hydra import compose, initialize_config_dir

    import run as shell
    from model_costs import model_spec
    from planning import plan_for  # the shell's planning step itself: this tool fuzzes the shell

    sets = BASE_SETS if sets is None else sets
    out = []
    with initialize_config_dir(config_dir=str(shell.CONF_DIR), version_base="1.3"):
        for args in sets:
            rc = shell.validate_config(compose("config", overrides=args))
            with contextlib.redirect_stdout(io.StringIO()):
                model, plan = plan_for(rc, Path(tempfile.gettempdir()))
            out.append((json.loads(plan.model_dump_json()), model_spec(rc), rc.hardware))
    return out


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def mutate_plan(rng: random.Random, plan: dict, hardware) -> tuple[dict, str | None]:
    """A mutated copy of ``plan`` and, for a textual mutation, the JSON text to load instead."""
    p = copy.deepcopy(plan)
    n = hardware.num_devices
    for _ in range(rng.randint(1, 3)):
        try:
            _mutate_once(rng, p, n)
        except Exception:  # noqa: BLE001
            pass  # an earlier mutation broke the shape this one needs: the plan stays as it is
    text = None
    if rng.random() < 0.1:  # a key given twice: json.loads would keep the last one silently
        body = json.dumps(p)
        text = '{"planner": "dup", ' + body[1:]
    return p, text


def _mutate_once(rng: random.Random, p: dict, n: int) -> None:
    """One random mutation of the plan dict ``p`` in place (n: the hardware's device count)."""
    kind = rng.randrange(12)
    leaves = [(path, v) for path, v in _paths(p) if path and not isinstance(v, (dict, list))]
    lists = [(path, v) for path, v in _paths(p) if path and isinstance(v, list) and v]
    if kind == 0 and leaves:  # a leaf to an absurd value
        path, _ = rng.choice(leaves)
        _set(p, path, rng.choice(BAD_VALUES))
    elif kind == 1 and leaves:  # a number nudged
        path, v = rng.choice(leaves)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _set(p, path, v + rng.choice([-1, 1, 2, 10**6]))
    elif kind == 2 and lists:  # drop or duplicate a list entry
        path, v = rng.choice(lists)
        i = rng.randrange(len(v))
        if rng.random() < 0.5:
            v.pop(i)
        else:
            v.insert(i, copy.deepcopy(v[i]))
    elif kind == 3:  # a D2D swap with random targets and weights
        s = rng.randrange(len(p["stages"]))
        st = p["stages"][s]
        layer = rng.randrange(st["layer_start"], max(st["layer_start"] + 1, st["layer_stop"]))
        targets = [{"device": rng.randrange(n + 1), "weight": rng.choice([1.0, 0.5, float("inf"), 1e-300, 1e300])}
                   for _ in range(rng.choice([1, 2, 3, 1000]))]
        st["memory"] = [{"layer": layer, "action": "d2d_swap", "targets": targets}]
    elif kind == 4:
        p["schedule"] = {"kind": "interleaved_1f1b", "virtual_stages": rng.choice([2, 3, len(p["stages"]) + 1])}
        if rng.random() < 0.5:  # Megatron-Core's microbatch groups: valid, out of range, a short last group
            p["schedule"]["microbatch_group_size"] = rng.choice([1, 2, 3, 5, 7, len(p["stages"]), 2**40, 0])
    elif kind == 5:
        p["schema_version"] = rng.choice([0, 1, 2, 999])
    elif kind == 6:
        p["stages"][-1]["layer_stop"] = rng.choice([2**64, 2**40, 2**31, p["stages"][-1]["layer_stop"] + 1])
    elif kind == 7:
        p["training"]["global_batch"] = rng.choice([2**64, 2**40, 2**41, 0])
    elif kind == 8:
        st = p["stages"][rng.randrange(len(p["stages"]))]
        st["offload"] = {"window_layers": rng.choice([1, 2, 2**64, 0]), "optimizer_on_cpu": True, "nvme": rng.random() < .5}
    elif kind == 9:  # a MAP sharding entry: its mesh, a placement string, or an entry moved to another layer
        st = rng.choice([st for st in p["stages"] if st.get("sharding")] or p["stages"])
        if not st.get("sharding"):
            st["sharding"] = [{"layer": st["layer_start"], "mesh": [len(st["devices"])], "nodes": []}]
        entry = rng.choice(st["sharding"])
        what = rng.randrange(4)
        if what == 0:
            entry["mesh"] = rng.choice([[1], [2, 2], [len(st["devices"]) + 1], [0], [], [2**40], [2, 2, 2, 2]])
        elif what == 1 and entry["nodes"]:
            node = rng.choice(entry["nodes"])
            node["output"] = rng.choice(["", "S0", "S9", "S0S0", "P", "RRRRRRRRRRRR", "x", node["output"] + "R"])
        elif what == 2:
            entry["layer"] = rng.choice([entry["layer"] + 1, -1, 2**40, st["layer_stop"]])
        else:
            st["sharding"].append(copy.deepcopy(entry))
    elif kind == 11:  # a zb_auto order: shuffled, short, one position missing, foreign letters
        m = max(1, int(p["training"].get("num_microbatches") or 4))
        order = ["".join(rng.sample("FBW" * m, 3 * m)) for _ in p["stages"]]
        what = rng.randrange(4)
        if what == 1:
            order[0] = order[0][:-1]
        elif what == 2:
            order = order[1:]
        elif what == 3:
            order[-1] = "FBX" * m
        p["schedule"] = {"kind": "zb_auto", "zb_memory_limit": rng.choice([1, 2]), "order": order}
    elif kind == 10:  # per-layer checkpointing (MAP/rotor) or STRONGHOLD's resident layers
        st = p["stages"][rng.randrange(len(p["stages"]))]
        key = rng.choice(["checkpoint", "offload"])
        if key == "checkpoint":
            a, b = st["layer_start"], st["layer_stop"]
            seg = lambda lo, hi, ck=True, ch=(): {"start": lo, "stop": hi, "checkpointed": ck,  # noqa: E731
                                                  "children": list(ch)}
            st["checkpoint"] = rng.choice([[], None, [seg(a, b)], [seg(a, b + 1)], [seg(b, a)], [seg(-1, b)],
                                           [seg(a, b), seg(a, b)], [seg(a, 2**40)], [seg(a, b, "x")],
                                           [seg(a, b, True, [seg(a, b + 1)])], [seg(a, b, False, [seg(a, a)])],
                                           [seg(a, b, True, [seg(a, b, True, [seg(a, b)])])]])
        elif isinstance(st.get("offload"), dict):
            st["offload"]["resident_layers"] = rng.choice([[st["layer_start"]], [-1], [st["layer_stop"]], [0, 0]])


def plan_violation(p: dict, text: str | None, model, hardware) -> str | None:
    """A rule the plan breaks, checked independently of validate_plan (None: looks valid)."""
    if text is not None and text.count('"planner"') > 1:
        return "duplicate key"
    if p.get("schema_version", 1) != 1:
        return f"schema_version {p.get('schema_version')}"
    gb = p.get("training", {}).get("global_batch")
    if isinstance(gb, int) and gb > 2**40:
        return f"global_batch {gb}"
    expected = 0
    for st in p["stages"]:
        if st["layer_start"] != expected:
            return "layer ranges"
        expected = st["layer_stop"]
        for item in st.get("memory", []):
            devs = [t["device"] for t in item.get("targets", [])]
            if len(set(devs)) != len(devs):
                return "duplicate d2d target"
            for t in item.get("targets", []):
                w = t["weight"]
                if not (isinstance(w, (int, float)) and math.isfinite(w) and 1e-6 <= w <= 1e6):
                    return f"d2d weight {w}"
                if not hardware.has_device(t["device"]) or not all(
                        hardware.has_device(d) and hardware.is_peer(d, t["device"]) for d in st["devices"]):
                    return f"d2d target {t['device']} not a peer of all of {st['devices']}"
    if expected != model.num_layers:
        return "layer coverage"
    return None


def plan_case(rng: random.Random, base, kill_s: float, simulate: bool, info: dict | None = None) -> tuple[str, str]:
    """Mutate ``base`` (plan dict, model, hardware) and check the result (:func:`check_plan`);
    ``info`` (optional) receives the mutated plan (``plan``), its exact text (``plan_text``) and a
    traceback."""
    plan0, model, hardware = base
    p, text = mutate_plan(rng, plan0, hardware)
    return check_plan(p, text, model, hardware, kill_s, simulate, info)


def check_plan(p: dict, text: str | None, model, hardware, kill_s: float, simulate: bool,
               info: dict | None = None) -> tuple[str, str]:
    """Load the plan (``text``, else ``json.dumps(p)``) as the shell does, validate, estimate and
    (``simulate``) simulate it: (status, detail)."""
    from pydantic import ValidationError

    from simulator.analytic import estimate
    from reports.outputs import load_plan
    from specs.plan import PlanError, validate_plan

    info = {} if info is None else info
    info["plan"] = p
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        try:
            body = text if text is not None else json.dumps(p)
            info["plan_text"] = body
            path.write_text(body)
        except ValueError:
            return "rejected", "not serialisable"
        try:
            with deadline(kill_s):
                try:
                    plan = validate_plan(load_plan(path), model, hardware)
                except (ValidationError, PlanError, ValueError) as exc:
                    if type(exc) is ValueError and "JSON" not in str(exc) and "twice" not in str(exc):
                        info["traceback"] = traceback.format_exc()[-TAIL:]
                        return "traceback", f"bare ValueError: {exc}"
                    return "rejected", str(exc).splitlines()[0]
                wrong = plan_violation(p, text, model, hardware)
                if wrong:
                    return "wrong_accepted", wrong
                result = estimate(plan, model, hardware)
                bad = result_problem(result, hardware, plan.training.precision.value)
                if bad:
                    return "nonsense", f"analytic: {bad}"
                if simulate:
                    from simulator import simulate as sim

                    try:
                        simulated = sim(plan, model, hardware).result
                    except ValueError as exc:  # the simulator refuses a plan too large to simulate
                        return "sim_refused", str(exc).splitlines()[0][:200]
                    bad = result_problem(simulated, hardware, plan.training.precision.value)
                    if bad:
                        return "nonsense", f"simulator: {bad}"
                return "ok", ""
        except Deadline:
            info["traceback"] = traceback.format_exc()[-TAIL:]  # where the deadline found it
            return "hang", f"over {kill_s} s"
        except Exception as exc:  # noqa: BLE001
            info["traceback"] = traceback.format_exc()[-TAIL:]
            return "traceback", f"{type(exc).__name__}: {str(exc)[:200]}"


BAD_KINDS = ("traceback", "slow", "hang", "nonsense", "wrong_accepted", "multiline")


def save_case(out_dir: Path, case: dict) -> Path:
    """Write one failing case to ``out_dir/<kind>_<index>_<status>.json`` (Python's JSON: a mutated
    plan may hold NaN or Infinity, written as such and read back by ``json.loads``) and return the path.
    ``case``: ``kind`` ("cli" or "plan"), ``index``, ``status``, ``detail`` and, for a CLI case,
    ``args`` and ``subprocess``; for a plan case ``base`` (index into ``base_sets``), ``base_sets``
    (their override lists), ``plan_text`` (the exact text loaded) and ``plan``; whatever else was
    captured (traceback, stdout, stderr, seconds, seed, kill_s, slow_s, simulate)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{case['kind']}_{case['index']:04d}_{case['status']}.json"
    path.write_text(json.dumps(case, indent=1, default=str))
    return path


def _report_saved(path: Path) -> None:
    print(f"  saved {path} (replay: python benchmarks/fuzz_inputs.py --replay {path})", flush=True)


def replay(path: Path, kill_s: float | None = None) -> tuple[str, str]:
    """Rerun the one case saved in ``path`` (:func:`save_case`) as it ran then (in-process or
    subprocess, same deadlines unless ``kill_s``); print and return its (status, detail) now."""
    case = json.loads(Path(path).read_text())
    kill = kill_s if kill_s is not None else case.get("kill_s", 120.0)
    info: dict = {}
    print(f"replaying {path}: {case['kind']} case {case['index']} (seed {case.get('seed')}), which was "
          f"{case['status']}: {case.get('detail', '')}", flush=True)
    if case["kind"] == "cli":
        run_case = cli_case_subprocess if case.get("subprocess") else cli_case_inprocess
        with tempfile.TemporaryDirectory() as tmp:
            status, detail, dt = run_case(case["args"], Path(tmp) / "replay", case.get("slow_s", 60.0), kill, info)
        print(f"[cli {status}] {dt:.1f}s {' '.join(case['args'])} -> {detail}")
    elif case["kind"] == "plan":
        sets = case.get("base_sets") or BASE_SETS
        _, model, hardware = base_plans([sets[case["base"]]])[0]
        status, detail = check_plan(case["plan"], case.get("plan_text"), model, hardware, min(kill, 30.0),
                                    case.get("simulate", False), info)
        print(f"[plan {status}] {detail}")
    else:
        raise ValueError(f"{path}: kind {case['kind']!r} is neither 'cli' nor 'plan'")
    for key in ("traceback", "stderr"):
        if status in BAD_KINDS and info.get(key, "").strip():
            print(f"--- {key} ---\n{info[key].rstrip()}")
    print("still failing" if status in BAD_KINDS else "no longer failing")
    return status, detail


def main(argv: list[str] | None = None) -> Counter:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", type=int, default=200, help="CLI override sets")
    ap.add_argument("--plans", type=int, default=200, help="plan mutations")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--subprocess", action="store_true", help="run `python -m run` per CLI case")
    ap.add_argument("--simulate", action="store_true", help="also simulate accepted plans")
    ap.add_argument("--slow-s", type=float, default=60.0)
    ap.add_argument("--kill-s", type=float, default=None, help="a case's deadline (default 120; with --replay: "
                                                                  "the saved case's)")
    ap.add_argument("--root", type=Path, default=None,
                    help="another memwall tree to fuzz (e.g. an old commit from `git archive`)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the failing cases, one JSON file each (default: a new temporary folder)")
    ap.add_argument("--replay", type=Path, default=None, metavar="FILE",
                    help="rerun the one failing case saved in FILE (exit 0: it no longer fails, 1: it still does)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    global ROOT
    if a.root is not None:
        ROOT = a.root.resolve()
        sys.path.insert(0, str(ROOT))
    if a.replay is not None:
        status, _ = replay(a.replay, a.kill_s)
        raise SystemExit(1 if status in BAD_KINDS else 0)
    a.kill_s = 120.0 if a.kill_s is None else a.kill_s
    seed = a.seed if a.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    print(f"seed {seed}")
    out_dir = a.out
    saved: list[Path] = []

    def keep(case: dict) -> None:
        nonlocal out_dir
        if out_dir is None:  # the default folder is made for the first failing case
            out_dir = Path(tempfile.mkdtemp(prefix="fuzz_inputs_"))
        saved.append(save_case(out_dir, case))
        _report_saved(saved[-1])

    counts: Counter = Counter()
    bad_kinds = BAD_KINDS
    case = cli_case_subprocess if a.subprocess else cli_case_inprocess
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.cli):
            args = draw_overrides(rng)
            info: dict = {}
            status, detail, dt = case(args, Path(tmp) / f"c{i}", a.slow_s, a.kill_s, info)
            counts[f"cli_{status}"] += 1
            if status in bad_kinds or a.verbose:
                print(f"[cli {status}] {dt:.1f}s {' '.join(args)} -> {detail}", flush=True)
            if status in bad_kinds:
                keep({"kind": "cli", "index": i, "status": status, "detail": detail, "seconds": dt, "seed": seed,
                      "args": args, "subprocess": a.subprocess, "slow_s": a.slow_s, "kill_s": a.kill_s, **info})
    if a.cli:
        print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
    bases = base_plans() if a.plans else []
    for i in range(a.plans):
        info = {}
        status, detail = plan_case(rng, bases[i % len(bases)], min(a.kill_s, 30.0), a.simulate, info)
        counts[f"plan_{status}"] += 1
        if status in bad_kinds or a.verbose:
            print(f"[plan {status}] {detail}", flush=True)
        if status in bad_kinds:
            keep({"kind": "plan", "index": i, "status": status, "detail": detail, "seed": seed,
                  "base": i % len(bases), "base_sets": BASE_SETS, "simulate": a.simulate, "kill_s": a.kill_s, **info})
    if saved:
        print(f"{len(saved)} failing case(s) saved in {out_dir} (replay one: python benchmarks/fuzz_inputs.py "
              f"--replay FILE)")
    else:
        print("no failing case to save")
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    total = lambda kind: counts[f"cli_{kind}"] + counts[f"plan_{kind}"]  # noqa: E731
    print(" ".join(f"{name}={total(k)}" for k, name in zip(bad_kinds, ("tracebacks", "slow", "hangs", "nonsense",
                                                                        "wrong_accepted", "multiline_errors"))))
    return counts


if __name__ == "__main__":
    main()
