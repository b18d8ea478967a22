"""The user's own mistakes end in one line naming the field, exit status 2, not "internal error"
(issue #22): a typo in a torch_module model's kwargs, a factory whose import fails (its module,
or a dependency it imports), policy=map with a batch the simulator it plans with refuses. Library
callers get the typed error (executor.user_model.ModelBuildError, a ValueError)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_asserts import one_line_exit_2

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"


def run_cli(tmp_path: Path, *args: str, pythonpath: tuple[Path, ...] = (), cache: Path | None = None
            ) -> subprocess.CompletedProcess:
    path = os.pathsep.join(str(p) for p in (ROOT, DOCS, *pythonpath))
    return subprocess.run([sys.executable, "-m", "run", *args, f"profile_cache={cache or tmp_path / 'cache'}",
                           f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": path})


def user_model(factory: str, kwargs: str = "{}") -> str:
    return f'+model={{family: torch_module, name: u, factory: "{factory}", kwargs: {kwargs}}}'


@pytest.mark.parametrize("mode", ["simulate", "profile"])
def test_a_typo_in_the_model_kwargs_names_model_kwargs(tmp_path, mode):
    proc = run_cli(tmp_path, "+hardware=local_cpu", user_model("user_model_example:build", "{widht: 64}"),
                   f"mode={mode}")
    one_line_exit_2(proc, "model.kwargs:", "unexpected keyword argument 'widht'", "width")


@pytest.mark.parametrize("source,needles", [
    ("import no_such_dependency_xyz\ndef build():\n    pass\n", ["model.factory:", "no_such_dependency_xyz"]),
    ("def build(:\n", ["model.factory:", "SyntaxError", "bad_factory_mod.py:1"]),
    ("raise RuntimeError('broken at import')\n", ["model.factory:", "RuntimeError: broken at import"]),
    ("def build():\n    import no_such_dependency_xyz\n", ["model.factory:", "cannot import what it needs",
                                                           "bad_factory_mod.py:2"]),
    ("def other():\n    pass\n", ["model.factory:", "has no 'build'"]),
], ids=["missing_dependency", "syntax_error", "raises", "dependency_inside_build", "no_such_function"])
def test_a_factory_whose_import_fails_names_model_factory(tmp_path, source, needles):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "bad_factory_mod.py").write_text(source)
    proc = run_cli(tmp_path, "+hardware=local_cpu", user_model("bad_factory_mod:build"), pythonpath=(mods,))
    one_line_exit_2(proc, *needles)


def test_library_callers_get_a_typed_error():
    from costs.families import parse_model_config
    from executor.user_model import ModelBuildError, layers

    sys.path.insert(0, str(DOCS))
    try:
        cfg = parse_model_config({"family": "torch_module", "name": "u", "factory": "user_model_example:build",
                                  "kwargs": {"widht": 64}})
        with pytest.raises(ModelBuildError, match="model.kwargs: got an unexpected keyword argument 'widht'"):
            layers(cfg)
        cfg = parse_model_config({"family": "torch_module", "name": "u", "factory": "no_such_module_xyz:build"})
        with pytest.raises(ModelBuildError, match="model.factory: cannot import"):
            layers(cfg)
    finally:
        sys.path.remove(str(DOCS))
    assert issubclass(ModelBuildError, ValueError)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One profile cache for the MAP runs: the op graphs are traced once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow  # MAP traces its op graphs first: 5-8 s a run
@pytest.mark.parametrize("estimator", ["simulator", "analytic"])
def test_map_with_a_batch_the_simulator_refuses_is_one_line(tmp_path, shared_cache, estimator):
    """MAP refines its plan against the simulator whatever the estimator: a batch past the
    simulator's limit was "internal error: ValueError"."""
    from simulator import MAX_SIMULATED_PASSES

    batch = 2 * MAX_SIMULATED_PASSES + 2
    proc = run_cli(tmp_path, "+hardware=local_cpu", "+model=gpt_tiny", "policy=map",
                   f"training.global_batch={batch}", "training.microbatch_size=1", f"estimator={estimator}",
                   cache=shared_cache)
    one_line_exit_2(proc, "policy 'map'", "training.global_batch", "training.microbatch_size")
