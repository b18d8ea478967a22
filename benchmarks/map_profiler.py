"""MAP §4.1's Fig. 2 (profiling time) and Fig. 4 (profiler memory, memory accuracy) on local_cpu:
memwall's symbolic profiler (executor/profile_symbolic.py: the user's model built on the meta
device, split by torch.export, every layer's forward and backward run on FakeTensor) against a
real-run profiler (the same layers materialised and initialised, one forward + backward with real
tensors, timed per layer, saved tensors counted by ``torch.autograd.graph.saved_tensors_hooks``).

    python benchmarks/map_profiler.py [--small] [--models vgg16,resnet50,vit,gpt2]

Models (docs/examples/{vgg16,resnet50,vit,hf_gpt2}.py), fp32, microbatch 1, the paper's shapes:
VGG16 and ResNet-50 on 224x224 images with 1000 classes, ViT-B/16 on 224x224, GPT-2 small (12
layers, hidden 768, 12 heads, vocabulary 50257, sequence 1024). ``--small`` runs the narrow
test-size shapes (:data:`SMALL`) in seconds. Each (model, profiler) runs in a fresh process so that
its peak RSS is its own: the peak is VmHWM after a reset (``/proc/self/clear_refs``) taken once
torch, transformers and the tracing machinery are imported, minus VmRSS at that moment.

The paper gives no numbers for either figure: §4.1 says symbolic profiling "greatly reduces the time
overhead, as shown in figure 2" (Fig. 2 is a diagram of symbolic execution, not a plot), that it
"does not require any physical memory", and that on "VGG_16, Resnet50, ViT, GPT2, etc. the memory
estimation result is very close to the value of real execution (figure 4)", a plot without values.
The table prints those claims beside what we measure.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
for _p in (str(ROOT), str(EXAMPLES)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

MiB = 1 << 20


def _gpt2(n_layer: int, **kw) -> dict:
    return {"factory": "hf_gpt2:build", "kwargs": {"n_layer": n_layer, **kw},
            "split_points": [f"transformer.h.{i}" for i in range(n_layer)] + ["lm_head"]}


def _vit(depth: int, **kw) -> dict:
    return {"factory": "vit:build", "kwargs": {"depth": depth, **kw},
            "split_points": [f"blocks.{i}" for i in range(depth)] + ["head"]}


VGG_SPLIT = ["stages.1", "stages.2", "stages.3", "stages.4", "classifier"]
RESNET50_SPLIT = [f"layer.{i}" for i in range(1, 16)]
#: the paper's models at their usual (paper) shapes; microbatch 1
PAPER = {
    "vgg16": {"factory": "vgg16:build", "kwargs": {}, "split_points": VGG_SPLIT},
    "resnet50": {"factory": "resnet50:build", "kwargs": {}, "split_points": RESNET50_SPLIT},
    "vit": _vit(12),
    "gpt2": _gpt2(12, n_embd=768, n_head=12, vocab_size=50257, seq_len=1024),
}
#: narrow shapes for tests and --small (seconds on 2 cores)
SMALL = {
    "vgg16": {"factory": "vgg16:build", "kwargs": {"width": 8, "fc": 64, "classes": 10, "image": 32},
              "split_points": VGG_SPLIT},
    "resnet50": {"factory": "resnet50:build", "kwargs": {"width": 8, "classes": 10, "image": 64},
                 "split_points": RESNET50_SPLIT},
    "vit": _vit(2, image=32, patch=8, dim=64, heads=4, classes=10),
    "gpt2": _gpt2(2, n_embd=64, n_head=4, vocab_size=256, seq_len=32),
}
SHAPES = {"vgg16": "224x224 img, 1000 cls", "resnet50": "224x224 img, 1000 cls", "vit": "B/16, 224x224 img",
          "gpt2": "12L h768 s1024 V50257"}


def model_cfg(name: str, small: bool = False, kwargs: dict | None = None):
    """The torch_module config of ``name`` at the paper's (or SMALL) shape, ``kwargs`` overriding."""
    from costs.families import parse_model_config

    spec = dict((SMALL if small else PAPER)[name])
    spec["kwargs"] = {**spec["kwargs"], **(kwargs or {})}
    return parse_model_config({"family": "torch_module", "name": f"{name}{'_small' if small else ''}", **spec})


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _keys(tree) -> dict:
    return {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in _tensors(tree)}


def real_profile(cfg, microbatch: int, dtype: torch.dtype = torch.float32) -> dict:
    """The real-run profiler: materialise every layer, run one forward (each layer timed, its saved
    storages counted once by the pack hook, parameters and buffers excluded, as the symbolic
    profiler counts them) and one backward layer by layer from the loss. Out: build_s, per layer
    name / fwd_s / bwd_s / saved_bytes, param_bytes."""
    from executor.models import build_layers, make_batch

    start = time.perf_counter()
    layers = build_layers(cfg, rows=microbatch, dtype=dtype)
    build_s = time.perf_counter() - start
    batch = make_batch(cfg, microbatch, 0, dtype=dtype)
    x, recs = None, []
    for _, name, module in layers:
        inp = None if x is None else tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, x)
        state = _keys([*module.parameters(), *module.buffers()])
        saved: dict = {}

        def pack(t):
            key = StorageWeakRef(t.untyped_storage())
            if key not in state and key not in saved:
                saved[key] = t.untyped_storage().nbytes()
            return t

        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(inp, batch)
        recs.append({"name": name, "inp": inp, "out": y, "fwd_s": time.perf_counter() - t0,
                     "saved_bytes": sum(saved.values())})
        x = y
    grads = None  # gradients of the next layer's inputs that require grad, in tree_flatten order
    for rec in reversed(recs):
        outs = [t for t in _tensors(rec["out"]) if t.requires_grad]
        pairs = [(o, torch.ones_like(o)) for o in outs] if grads is None else [
            (o, g) for o, g in zip(outs, grads) if g is not None]
        t0 = time.perf_counter()
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        rec["bwd_s"] = time.perf_counter() - t0
        grads = [t.grad for t in _tensors(rec["inp"]) if t.requires_grad] if rec["inp"] is not None else []
    params = {id(p): p for _, _, m in layers for p in m.parameters()}
    return {"build_s": build_s, "param_bytes": sum(p.untyped_storage().nbytes() for p in params.values()),
            "layers": [{k: r[k] for k in ("name", "fwd_s", "bwd_s", "saved_bytes")} for r in recs]}


def symbolic_profile(cfg, microbatch: int) -> dict:
    """memwall's symbolic profiler, timed end to end (meta build, split, FakeTensor trace)."""
    from executor.profile_symbolic import profile_model

    start = time.perf_counter()
    prof = profile_model(cfg, microbatch=microbatch, dtype="fp32")
    return {"total_s": time.perf_counter() - start, "distinct_layers": prof.distinct_layers,
            "params": prof.total_params,
            "layers": [{"name": layer.name, "saved_bytes": layer.saved_bytes} for layer in prof.layers]}


def op_graph_profile(cfg, microbatch: int) -> dict:
    """MAP's per-operator trace the planner reads (executor/op_graph.model_op_graphs: torch.export of
    each distinct layer on FakeTensor, replayed node by node for FLOPs and §4.1's memory split)."""
    from executor.op_graph import model_op_graphs

    start = time.perf_counter()
    graphs, keys = model_op_graphs(cfg, microbatch, "fp32")
    return {"total_s": time.perf_counter() - start, "graphs": len(graphs), "layers": len(keys),
            "nodes": sum(len(g.nodes) for g in graphs.values())}


def _status(field: str) -> int:
    """A VmXXX line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(mode: str, name: str, small: bool, microbatch: int, kwargs: dict | None = None) -> dict:
    """One profiler on one model in this (fresh) process, with its peak RSS above the imports."""
    cfg = model_cfg(name, small, kwargs)
    # import what either profiler imports lazily, so that neither is charged for the libraries
    import torch._dynamo  # noqa: F401  (torch.export's tracer, used by the split)
    import torch.export  # noqa: F401

    import executor.models  # noqa: F401
    import executor.op_graph  # noqa: F401
    import executor.profile_symbolic  # noqa: F401
    importlib.import_module(cfg.factory.split(":")[0])
    if name == "gpt2":
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    base = _status("VmRSS")
    out = {"symbolic": symbolic_profile, "opgraph": op_graph_profile, "real": real_profile}[mode](cfg, microbatch)
    out["peak_rss_bytes"] = max(_status("VmHWM") - base, 0)
    return out


def run_child(mode: str, name: str, small: bool, microbatch: int, kwargs: dict | None = None,
              timeout_s: float = 1800) -> dict:
    """:func:`child` in a fresh process (its own peak RSS): the JSON it prints."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--models", name,
           "--microbatch", str(microbatch), "--kwargs", json.dumps(kwargs or {})] + (["--small"] if small else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{mode} {name}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare(sym: dict, real: dict) -> dict:
    """Per-layer saved bytes, symbolic vs real: exact layers, worst relative error, totals."""
    pairs = [(s["saved_bytes"], r["saved_bytes"]) for s, r in zip(sym["layers"], real["layers"])]
    worst = max((abs(s - r) / r if r else float(s != 0) for s, r in pairs), default=0.0)
    return {"layers": len(pairs), "same_count": len(sym["layers"]) == len(real["layers"]),
            "exact": sum(s == r for s, r in pairs), "worst_err_pct": 100 * worst,
            "sym_total": sum(s for s, _ in pairs), "real_total": sum(r for _, r in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="test-size shapes (SMALL)")
    ap.add_argument("--models", default="vgg16,resnet50,vit,gpt2")
    ap.add_argument("--microbatch", type=int, default=1)
    ap.add_argument("--kwargs", default="{}", help="JSON overriding the factory's kwargs")
    ap.add_argument("--child", choices=["symbolic", "opgraph", "real"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.models.split(",")
    if args.child:
        print(json.dumps(child(args.child, names[0], args.small, args.microbatch, json.loads(args.kwargs))))
        return
    rows = []
    for name in names:
        sym = run_child("symbolic", name, args.small, args.microbatch, json.loads(args.kwargs))
        real = run_child("real", name, args.small, args.microbatch, json.loads(args.kwargs))
        ops = run_child("opgraph", name, args.small, args.microbatch, json.loads(args.kwargs))
        rows.append((name, sym, real, ops, compare(sym, real)))
    shape = "SMALL shapes" if args.small else "paper shapes"
    print(f"MAP §4.1 on local_cpu ({os.cpu_count()} cores, torch {torch.__version__}), fp32, microbatch "
          f"{args.microbatch}, {shape}")
    print("\nFig. 2 — profiling time (s). symbolic = per-layer profile (profile_symbolic), op graph = MAP's "
          "per-operator trace (op_graph); real = materialise + init (build) and one fwd+bwd timed per layer")
    print(f"{'model':9} {'shape':22} {'params M':>8} {'layers':>6} {'traced':>6} {'symbolic s':>10} "
          f"{'op graph s':>10} {'real build s':>12} {'real fwd+bwd s':>14} {'real total s':>12} {'real/sym':>8}  paper")
    for name, sym, real, ops, _ in rows:
        step = sum(r["fwd_s"] + r["bwd_s"] for r in real["layers"])
        total = real["build_s"] + step
        print(f"{name:9} {(SHAPES[name] if not args.small else 'small'):22} {sym['params'] / 1e6:8.1f} "
              f"{len(sym['layers']):6d} {sym['distinct_layers']:6d} {sym['total_s']:10.2f} {ops['total_s']:10.2f} "
              f"{real['build_s']:12.2f} {step:14.2f} {total:12.2f} {total / sym['total_s']:8.2f}  "
              "Fig. 2 is a diagram; text: 'greatly reduces the time overhead'")
    print("\nFig. 4 — profiler memory (peak RSS above imports, MiB) and saved-activation bytes, symbolic vs real "
          "pack hook")
    print(f"{'model':9} {'param MiB':>9} {'sym RSS':>8} {'opg RSS':>8} {'real RSS':>8} {'saved sym MiB':>13} "
          f"{'saved real MiB':>14} {'exact layers':>12} {'worst err %':>11}  paper")
    for name, sym, real, ops, cmp in rows:
        print(f"{name:9} {real['param_bytes'] / MiB:9.1f} {sym['peak_rss_bytes'] / MiB:8.1f} "
              f"{ops['peak_rss_bytes'] / MiB:8.1f} {real['peak_rss_bytes'] / MiB:8.1f} "
              f"{cmp['sym_total'] / MiB:13.2f} {cmp['real_total'] / MiB:14.2f} "
              f"{cmp['exact']:>5d} / {cmp['layers']:<4d} {cmp['worst_err_pct']:11.2f}  "
              "plot only: 'very close to real execution'")
        if not cmp["same_count"]:
            print(f"  !! {name}: {len(sym['layers'])} symbolic layers vs {len(real['layers'])} real")


if __name__ == "__main__":
    main()
