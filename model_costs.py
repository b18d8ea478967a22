"""A config's way to its costs, in one place: the ModelSpec a run plans with, and the profiles
that feed it.

    model_spec(cfg)                   closed forms (costs.families), or model_costs=symbolic / a
                                      torch_module model: costs from the symbolic profile
    symbolic_profile(cfg)             the symbolic (FakeTensor) profile, cached on disk by content
    capture_profile_for(cfg, outdir)  CAPTURE's profile (M_i/M_a), cached by capture_fingerprint
    capture_profiling_runs(cfg, outdir)  CAPTURE's profiling runs themselves (resumable)

It sits at the shell level beside modes.py (which calls it): it reads and writes the profile
cache through reports.profile_io, traces modules with executor.profile_symbolic and runs
CAPTURE's profiling plans on the executor or the simulator. The pure halves stay below it:
costs.families (closed forms) and specs.profile (the profile types, apply_profile,
model_from_profile, cache_key). Bad model input raises CostsError (a ValueError), which
modes.run reports as a usage error.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from costs.families import build_model
from specs.model import ModelSpec
from specs.profile import Profile

if TYPE_CHECKING:  # only the type is named here
    from runconfig import RunConfig


class CostsError(ValueError):
    """The config's model cannot be costed (bad model input, a profile that does not line up,
    CAPTURE profiling that cannot plan): one clear message."""


_NOTED: list = []  # the torch_module notes are printed once per process


def profile_cache_dir(cfg: RunConfig) -> Path:
    """``profile_cache`` from the config, else ~/.cache/memwall/profiles."""
    return Path(cfg.profile_cache or Path.home() / ".cache" / "memwall" / "profiles")


def symbolic_cache_key(cfg: RunConfig, attention: str = "default") -> str:
    """The profile cache's key for cfg (specs.profile.cache_key); a torch_module model's also
    hashes its factory's source file (executor.user_model.source_hash)."""
    import torch

    from specs.profile import cache_key

    from executor.profile_symbolic import PROFILE_REVISION

    ident = cfg.model.model_dump(mode="json")
    ident["profile_revision"] = PROFILE_REVISION  # what the profiler measures: older profiles lack fields
    if cfg.model.family == "torch_module":
        from executor.user_model import source_hash

        ident["factory_source_sha256"] = source_hash(cfg.model)
    return cache_key(ident, cfg.training.samples_per_microbatch, cfg.training.precision.value, attention,
                     torch.__version__)


def symbolic_profile(cfg: RunConfig, attention: str = "default") -> Profile:
    """The symbolic profile of cfg.model at the run's microbatch and precision, from the cache
    (keyed by model config, microbatch, dtype, attention path and torch version; for a
    torch_module model also by a hash of the factory's source file, so an edited model is traced
    again) or traced now."""
    from executor.profile_symbolic import profile_model
    from reports import profile_io

    if cfg.model.family == "torch_module" and "runs_code" not in _NOTED:
        _NOTED.append("runs_code")
        print(f"note: family torch_module RUNS CODE: memwall imports and calls {cfg.model.factory!r} "
              "(here and in every rank); name only modules you trust")
    mb, dtype = cfg.training.samples_per_microbatch, cfg.training.precision.value
    cache = profile_cache_dir(cfg)
    key = symbolic_cache_key(cfg, attention)
    prof = profile_io.cached_profile(cache, key)
    if prof is None:
        prof = profile_model(cfg.model, microbatch=mb, dtype=dtype, attention=attention,
                             progress=lambda k, i, name: print(f"[profile] tracing layer {i} ({name}), distinct #{k}",
                                                                flush=True))
        profile_io.store_profile(cache, key, prof)
    return prof


def closed_form_spec(cfg: RunConfig, act_dtype_bytes: int | None = None) -> ModelSpec:
    """The closed-form model spec (costs.families) at the run's activation width, or at
    ``act_dtype_bytes`` when given (the executor trains in fp32: 4)."""
    return build_model(cfg.model, act_dtype_bytes or cfg.training.act_dtype_bytes)


def costs_source(cfg: RunConfig) -> str:
    """``closed_form`` or ``symbolic``. ``model_costs=auto`` (the default) is symbolic when the run
    executes the torch modules (mode=execute/compare): the prediction it is compared with is then
    made from the modules that run. The closed forms model Megatron's layers (dropout masks,
    unfused attention), which memwall's tiny CPU modules do not have; measured on local_cpu
    (benchmarks/memory_fidelity.py) they over-count those modules' activations by up to ~20 %."""
    if cfg.model.family == "torch_module":  # no closed forms: always traced (model_spec says so once)
        return "symbolic"
    if cfg.model_costs != "auto":
        return cfg.model_costs
    return "symbolic" if cfg.mode in ("execute", "compare") else "closed_form"


def model_spec(cfg: RunConfig) -> ModelSpec:
    """The model spec a run plans with: closed forms, or (model_costs=symbolic) the same layers
    with costs measured by the symbolic profiler (specs.profile.apply_profile); a torch_module
    model has no closed forms and is always profiled (model_costs=closed_form says so, once).
    Bad model input -> CostsError."""
    try:
        if cfg.model.family == "torch_module":
            from specs.profile import model_from_profile

            if cfg.model_costs == "closed_form" and "closed_form" not in _NOTED:
                _NOTED.append("closed_form")
                print(f"note: model_costs=closed_form: {cfg.model.name} is a torch_module model, which has no "
                      "closed-form costs; using its traced (symbolic) costs")
            model = model_from_profile(symbolic_profile(cfg))
            return _op_graphs_for_policy(cfg, model) if wants_op_graphs(cfg) else model
        model = closed_form_spec(cfg)
        if costs_source(cfg) == "symbolic":
            from specs.profile import apply_profile

            model = apply_profile(model, symbolic_profile(cfg))
        if wants_op_graphs(cfg):
            model = _op_graphs_for_policy(cfg, model)
        return model
    except CostsError:
        raise
    except ValueError as exc:
        raise CostsError(str(exc)) from None


def wants_op_graphs(cfg: RunConfig) -> bool:
    """MAP plans from operator graphs: policy=map, and policy=auto when MAP is among its singles,
    for any model (issue 26: executor.op_graph traces every family and a user's torch_module;
    MAP §1 parallelises any model). Under auto a model that cannot be traced plans without them
    (:func:`_op_graphs_for_policy` says why)."""
    kind = cfg.policy.kind
    return kind == "map" or (kind == "auto" and "map" in cfg.policy.singles)


def _op_graphs_for_policy(cfg: RunConfig, model: ModelSpec) -> ModelSpec:
    """:func:`with_op_graphs`; under policy=auto a trace failure leaves MAP out (its single then
    reports "no operator graphs") with a note naming the error, instead of failing the whole run."""
    if cfg.policy.kind != "auto":
        return with_op_graphs(cfg, model)
    try:
        return with_op_graphs(cfg, model)
    except Exception as exc:  # noqa: BLE001 — torch.export / FakeTensor raise many kinds on an untraceable module
        print(f"note: policy=auto: {model.name}'s operator graphs could not be traced "
              f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); MAP's sharding is left out", flush=True)
        return model


#: what executor.op_graph measures per node: a cached graph set of another revision is traced again
#: (2: backward scratch measured below FlopCounterMode's decompositions, e.g. silu_backward)
#: (3: one backward stretch per node across its autograd functions: cross-entropy's nll -> log-softmax gradient)
OP_GRAPH_REVISION = 3


def with_op_graphs(cfg: RunConfig, model: ModelSpec) -> ModelSpec:
    """``model`` with MAP's operator graphs (MAP §4.1) traced at the run's microbatch and precision,
    one trace per distinct layer (executor.op_graph.model_op_graphs; FakeTensor, seconds), cached
    beside the symbolic profiles (keyed like them: model config, factory source, microbatch, dtype,
    torch version, and this revision)."""
    from executor.op_graph import model_op_graphs
    from reports.files import write_text
    from specs.op_graph import OpGraph

    mb, dtype = cfg.training.samples_per_microbatch, cfg.training.precision.value
    key = symbolic_cache_key(cfg, attention=f"op_graphs-r{OP_GRAPH_REVISION}")
    path = profile_cache_dir(cfg) / f"op_graphs-{key}.json"
    graphs = keys = None
    if path.exists():
        try:
            data = json.loads(path.read_text())
            graphs = {k: OpGraph.model_validate(v) for k, v in data["graphs"].items()}
            keys = list(data["keys"])
            if len(keys) != model.num_layers or set(keys) - set(graphs):
                raise ValueError(f"{len(keys)} layer keys for {model.num_layers} layers")
        except (ValueError, KeyError, TypeError) as exc:
            print(f"note: ignoring the cached operator graphs {path} ({' '.join(str(exc).split())[:200]}); "
                  "tracing again", flush=True)
            graphs = keys = None
    if graphs is None:
        graphs, keys = model_op_graphs(cfg.model, mb, dtype, progress=lambda k, i, name: print(
            f"[map] tracing the operator graph of layer {i} ({name}), distinct #{k}", flush=True))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({"graphs": {k: g.model_dump(mode="json") for k, g in graphs.items()},
                                     "keys": keys}))
    layers = [layer.model_copy(update={"op_graph": k}) for layer, k in zip(model.layers, keys)]
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": mb, "layers": layers})


# ---------------------------------------------------------------- CAPTURE's profile (§III-A)

def capture_backend_name(cfg: RunConfig) -> str:
    """The profiling backend: the executor for hardware that is here (local_cpu), else the simulator."""
    if cfg.policy.backend != "auto":
        return cfg.policy.backend
    return "executor" if cfg.hardware.name == "local_cpu" and cfg.model.family != "custom" else "simulator"


def capture_fingerprint(cfg: RunConfig) -> str:
    """Everything that decides a CAPTURE profile (not the planner knobs)."""
    from planners.capture.profile import PROFILER_VERSION

    ident = {"model": cfg.model.model_dump(mode="json"), "hardware": cfg.hardware.model_dump(mode="json", exclude={"nodes"}),
             "training": cfg.training.model_dump(mode="json"), "schedule": cfg.schedule.model_dump(mode="json"),
             "policy": cfg.policy.profile_fields(), "backend": capture_backend_name(cfg), "costs": cfg.model_costs,
             "profiler_version": PROFILER_VERSION}
    if cfg.model.family == "torch_module":  # the config names the factory, not its code
        from executor.user_model import source_hash

        ident["factory_source_sha256"] = source_hash(cfg.model)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


_PROFILES: dict[str, Profile] = {}  # this process's CAPTURE profiles by fingerprint (one run asks several times)


def capture_profile_for(cfg: RunConfig, outdir: Path) -> Profile:
    """The CAPTURE profile for cfg: this process's copy, the on-disk cache
    (``<profile_cache>/capture_<fingerprint>.json``), or — profiling first — a new one (§III-A),
    cached for the next run."""
    from reports import profile_io

    fp = capture_fingerprint(cfg)
    if fp in _PROFILES:
        return _PROFILES[fp]
    path = profile_cache_dir(cfg) / f"capture_{fp}.json"
    prof = profile_io.cached_profile(path.parent, path.stem)  # a damaged cache file is profiled again
    if prof is not None and prof.capture is None:
        print(f"note: ignoring the cached profile {path} (it has no CAPTURE section); profiling again")
        prof = None
    if prof is not None:
        print(f"[capture] using the cached profile {path}")
    else:
        print(f"[capture] no cached profile for this model/hardware/batch: profiling first "
              f"({capture_backend_name(cfg)} backend)", flush=True)
        closed = model_spec(cfg)
        prof = Profile(model=closed.name, family=cfg.model.family, microbatch=cfg.training.samples_per_microbatch,
                       dtype=cfg.training.precision.value, total_params=closed.total_params,
                       capture=capture_profiling_runs(cfg, outdir))
        profile_io.write_profile(path, prof)
        print(f"[capture] cached the profile at {path}")
    _PROFILES[fp] = prof
    return prof


def capture_profiling_runs(cfg: RunConfig, outdir: Path):
    """CAPTURE's profiling runs for cfg (planners.capture.profile.profile_capture) on the executor
    or the simulator -> a specs.profile.CaptureProfile. Resumable: each finished run is appended
    to ``<outdir>/capture_runs.jsonl`` and a rerun skips the runs recorded there."""
    from planners import PlanningError
    from planners.capture.profile import profile_capture, runnable_scenarios
    from reports import profile_io
    from specs.plan import validate_plan

    pol, hw = cfg.policy, cfg.hardware
    backend_name = capture_backend_name(cfg)
    if backend_name == "executor":
        from executor import execute

        act = 4  # the executor trains in fp32 on CPU (executor.execute)

        def backend(plan, model, hardware):
            return execute(plan, cfg.model, hardware, iterations=1, warmup=1, timeout_s=300)
    else:
        from simulator import simulate

        act = cfg.training.act_dtype_bytes

        def backend(plan, model, hardware):
            return simulate(validate_plan(plan, model, hardware), model, hardware).result
    closed_form = costs_source(cfg) == "closed_form" and cfg.model.family != "torch_module"
    model = closed_form_spec(cfg, act) if closed_form else model_spec(cfg)
    fingerprint = capture_fingerprint(cfg)
    log = outdir / "capture_runs.jsonl"
    done = {r["key"]: r["peaks"] for r in profile_io.read_records(log) if r.get("fingerprint") == fingerprint}
    if done:
        print(f"[capture] resuming: {len(done)} runs already recorded in {log}")
    kept, dropped = runnable_scenarios(model, list(pol.scenarios))
    print(f"[capture] backend {backend_name}; scenarios {', '.join(kept)}"
          + (f" ({', '.join(dropped)} left out: above a layer's max tensor-parallel degree)" if dropped else ""),
          flush=True)

    from reports.progress import interactive, task

    with task(f"CAPTURE profiling ({backend_name})") as advance:
        def on_run(run, peaks, i, n):
            profile_io.append_record(log, {"fingerprint": fingerprint, "key": run.key, "peaks": peaks})
            advance()
            if not interactive() and (i == n or i % max(1, n // 10) == 0):  # a line per ~10 % in logs
                print(f"[capture {i}/{n}] {run.key}: max stage peak {max(peaks.values()) / 2**20:.2f} MiB", flush=True)

        try:
            cap = profile_capture(model, hw, cfg.training, cfg.schedule, backend, backend_name,
                                  scenarios=list(pol.scenarios), batch_sizes=pol.batch_sizes,
                                  num_microbatches=pol.num_microbatches, done=done, on_run=on_run,
                                  recompute=pol.recompute)
        except PlanningError as exc:
            raise CostsError(f"CAPTURE profiling: {exc}") from None
    print(f"[capture] {cap.runs} profiling runs ({cap.runs - len(done)} this time) for {model.num_layers} layers; "
          f"the paper's count is 10(L-1) = {cap.paper_runs}; M_i/M_a for {len(cap.scenarios)} scenario x batch sets")
    return cap


__all__ = ["CostsError", "capture_backend_name", "capture_fingerprint", "capture_profile_for",
           "capture_profiling_runs", "closed_form_spec", "costs_source", "model_spec", "profile_cache_dir",
           "symbolic_cache_key", "symbolic_profile"]
