"""Any model under MAP (issue 26), the parts that need no ranks: a user's whole ``nn.Module``
(family torch_module) traces into MAP's operator graphs on FakeTensor — no forward on meta
tensors, which failed on the device arguments torch's splitter records ("Cannot copy out of meta
tensor") — and a MAP plan of it passes the executor's checks (no family refusal), while a tied
weight over two MAP stages is refused by name before anything runs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from costs.families import parse_model_config
from executor.measure import unsupported
from executor.op_graph import model_op_graphs
from tests.integration.map.test_map_any_model_exec import RESNET, TINY_LM, map_plan

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


def _examples():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))


def test_a_split_user_module_traces_with_its_tied_weight_named_per_piece():
    """TinyLM cut by torch's splitter: four graphs (embedding, two blocks, head), linear nodes
    with their parameters, and the head's graph reading the tied weight under the head's name."""
    cfg = parse_model_config(TINY_LM)
    graphs, keys = model_op_graphs(cfg, 4, "fp32")
    assert len(keys) == 4 and len(set(keys)) == 4  # the last block carries the final code: no sharing
    linears = [n for key in keys[1:3] for n in graphs[key].nodes if n.kind == "linear"]
    assert linears and all(n.params for n in linears)
    head = [p.name for n in graphs[keys[3]].nodes for p in n.params]
    assert any(name.endswith("head.weight") for name in head), head


def test_resnet_traces_convolutions_and_batchnorm():
    _examples()
    graphs, keys = model_op_graphs(parse_model_config(RESNET), 4, "fp32")
    kinds = {n.kind for key in set(keys) for n in graphs[key].nodes}
    assert {"conv2d", "layer_norm"} <= kinds  # batch_norm is a norm node (statistics over b, h, w)


@pytest.mark.slow  # three model splits and traces (~10 s each on a loaded CPU)
@pytest.mark.parametrize("example", ["hf_gpt2", "hf_bert", "hf_llama"])
def test_hugging_face_examples_trace(example):
    pytest.importorskip("transformers")
    _examples()
    cfg = parse_model_config(yaml.safe_load((EXAMPLES / "model" / f"{example}.yaml").read_text()))
    graphs, keys = model_op_graphs(cfg, 2, "fp32")
    assert len(keys) == len(cfg.split_points) + 1
    assert any(n.kind in ("linear", "matmul") for g in graphs.values() for n in g.nodes)


@pytest.mark.slow  # traces the model twice (plan + the tie check's meta split)
def test_a_user_map_plan_is_not_refused_but_a_tie_over_map_stages_is():
    cfg = parse_model_config(TINY_LM)
    plan, sharded = map_plan(cfg)
    assert sharded > 0 and unsupported(plan, cfg) == []
    st = plan.stages[0]
    split = [st.model_copy(update={"layer_stop": 2, "devices": [0, 1], "tp": 2,
                                   "sharding": [s.model_copy(update={"mesh": [2]}) for s in st.sharding[:2]]}),
             st.model_copy(update={"layer_start": 2, "devices": [2, 3], "tp": 2,
                                   "sharding": [s.model_copy(update={"mesh": [2]}) for s in st.sharding[2:]]})]
    problems = unsupported(plan.model_copy(update={"stages": split}), cfg)
    assert any("tied weight across MAP stages" in p for p in problems), problems
