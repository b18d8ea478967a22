"""Issue 22: a model of many identical layers prices each distinct layer once -- its strategy table
(costs.map_strategies.strategies) and its node costs (simulator.sharded_layer.node_compute_s) are computed
per distinct op graph and reused by identity, so the count does not grow with the layer count."""
from __future__ import annotations

from pathlib import Path

import yaml

import planners.map.plan as map_plan
from costs.families import build_model, parse_model_config
from executor.op_graph import model_op_graphs
from planners.policy import MapPolicy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec

CONF = Path(__file__).resolve().parents[3] / "conf"


def _model(layers: int):
    data = yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text()) | {"num_layers": layers}
    cfg = parse_model_config(data)
    model = build_model(cfg, 4)
    graphs, keys = model_op_graphs(cfg, 4, "fp32")
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 4,
                                    "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})


def _counts(monkeypatch, layers: int) -> tuple[int, int, int, int]:
    calls = {"strategies": 0, "node_compute_s": 0}

    def counted(name):
        real = getattr(map_plan, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(map_plan, "strategies", counted("strategies"))
    monkeypatch.setattr(map_plan, "node_compute_s", counted("node_compute_s"))
    model = _model(layers)
    hw = HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text()))
    tr = TrainingSpec(global_batch=8, microbatch_size=4, precision="fp32")
    out = map_plan.map_search(MapPolicy(budgets=2, refine=0), model, hw, tr, ScheduleSpec())
    monkeypatch.undo()
    distinct = {(model.layers[l].op_graph, n.name) for l in range(model.num_layers)
                for n in model.op_graphs[model.layers[l].op_graph].nodes}
    assert len(out.plan.stages[0].sharding) == model.num_layers
    return calls["strategies"], calls["node_compute_s"], len(distinct), len(model.op_graphs)


def test_identical_layers_are_priced_once(monkeypatch):
    few = _counts(monkeypatch, 4)
    many = _counts(monkeypatch, 24)
    assert few[3] == many[3] == 3                 # embed, one block graph shared by every block, head
    assert few[0] == few[2] and many[0] == many[2]  # one strategy table per distinct (graph, node)
    assert many[0] == few[0]                        # ... whatever the number of repeated layers
    assert many[1] == few[1]                        # node costs: per distinct graph (and chain end), not per layer
