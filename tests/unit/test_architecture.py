"""The layering of the source tree (docs/architecture.md), checked from the imports with ``ast``.

specs <- costs <- simulator <- planners; the executor on specs and costs (and reports' file and
progress helpers) only; calibration above the executor, the simulator and the planners; the shell
(run, runconfig, modes, model_costs) above everything. Every import counts, a lazy one inside a
function and one under ``TYPE_CHECKING`` too: a layer that needs another only "sometimes" still
needs it. No module may import itself around a loop.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specs", "costs", "simulator", "planners", "executor", "calibration", "reports")
SHELL = ("run", "runconfig", "modes", "planning", "model_costs")
#: what each layer may import of ours (besides itself)
ALLOWED = {
    "specs": set(),
    "costs": {"specs"},
    "simulator": {"specs", "costs"},
    "planners": {"specs", "costs", "simulator"},
    "executor": {"specs", "costs", "reports"},
    "reports": {"specs"},
    "calibration": {"specs", "costs", "simulator", "planners", "executor", "reports"},
    **{m: set(PACKAGES) | set(SHELL) for m in SHELL},
}
#: the executor may use these two helpers of reports (atomic file writes, the progress bar), not
#: reports' figures or tables
EXECUTOR_REPORTS = {"reports.files", "reports.progress"}
#: only these layers may import torch (the planners and the simulator are pure; costs too)
TORCH_LAYERS = {"executor", "calibration", "model_costs", "modes", "run"}


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    for name in SHELL:
        if (root / f"{name}.py").exists():
            mods[name] = root / f"{name}.py"
    return mods


def _targets(mod: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[str]:
    """The modules of ours that one import statement names (a package's name counts as its
    __init__; ``from pkg import sub`` as the submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != mod:
            out.append(name)
    return out


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules of ours it imports, module -> third-party top-level packages it imports)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[mod].update(_targets(mod, path, node, mods))
                if isinstance(node, ast.Import):
                    external[mod].update(a.name.split(".")[0] for a in node.names)
                elif not node.level and node.module:
                    external[mod].add(node.module.split(".")[0])
    return graph, external


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        layer = mod.split(".")[0]
        for t in sorted(targets):
            tl = t.split(".")[0]
            if tl == layer:
                continue
            if tl not in ALLOWED[layer]:
                bad.append(f"{mod} imports {t} ({layer} may import {sorted(ALLOWED[layer]) or 'nothing of ours'})")
            elif layer == "executor" and tl == "reports" and t not in EXECUTOR_REPORTS:
                bad.append(f"{mod} imports {t} (the executor may use only {sorted(EXECUTOR_REPORTS)} of reports)")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_layers_import_downward_only():
    graph, _ = import_graph()
    assert len(graph) > 100  # the walk found the tree
    assert layer_violations(graph) == []


def test_no_import_cycles():
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_torch_stays_in_the_executor_and_calibration():
    _, external = import_graph()
    bad = sorted(m for m, ext in external.items() if "torch" in ext and m.split(".")[0] not in TORCH_LAYERS)
    assert bad == []


#: which other techniques' packages a technique may build on: MPress starts from a balanced or a
#: CAPTURE pipeline (§III-B's base pipeline), STRONGHOLD and MAP from the even split
TECHNIQUES = ("baselines", "capture", "mpress", "stronghold", "map")
SHARED_TECHNIQUES = {"baselines", "capture"}


def test_techniques_do_not_import_each_others_search():
    graph, _ = import_graph()
    bad = []
    for mod, targets in graph.items():
        p = mod.split(".")
        if p[0] != "planners" or len(p) < 3 or p[1] not in TECHNIQUES:
            continue
        for t in targets:
            q = t.split(".")
            if q[0] == "planners" and len(q) > 1 and q[1] in TECHNIQUES and q[1] != p[1] \
                    and q[1] not in SHARED_TECHNIQUES:
                bad.append(f"{mod} imports {t}")
    assert bad == []


def test_each_technique_is_a_package():
    for pkg in ("planners/capture", "planners/mpress", "planners/stronghold", "planners/map", "planners/baselines"):
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
    assert not [p.name for p in (ROOT / "planners").glob("*.py")
                if p.stem.startswith(("map_", "mpress", "capture", "stronghold"))]


# ---- the checker itself must catch what it names ----------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize("rel, text, needle", [
    ("specs/a.py", "import costs.b\n", "specs.a imports costs.b"),
    ("simulator/a.py", "def f():\n    from planners.p import x\n", "simulator.a imports planners.p"),
    ("executor/a.py", "from simulator import s\n", "executor.a imports simulator.s"),
    ("executor/a.py", "from planners.p import x\n", "executor.a imports planners.p"),
    ("executor/a.py", "from reports import figures\n", "executor.a imports reports.figures"),
    ("costs/a.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from simulator import s\n",
     "costs.a imports simulator.s"),
])
def test_checker_flags_an_upward_import(tmp_path, rel, text, needle):
    root = _tree(tmp_path, {rel: text, "costs/b.py": "", "simulator/s.py": "", "planners/p.py": "x = 1\n",
                            "reports/figures.py": ""})
    graph, _ = import_graph(root)
    assert any(v.startswith(needle) for v in layer_violations(graph)), layer_violations(graph)


def test_checker_finds_a_loop_through_three_modules(tmp_path):
    root = _tree(tmp_path, {"costs/a.py": "from costs import b\n", "costs/b.py": "import costs.c\n",
                            "costs/c.py": "def f():\n    from costs.a import g\n"})
    graph, _ = import_graph(root)
    assert cycles(graph) == [["costs.a", "costs.b", "costs.c"]]
