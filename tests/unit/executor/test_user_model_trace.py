"""Tracing a user's whole module (executor.user_model, executor.pipesplit) for the symbolic
profiler: model code that branches on its tensors' device takes the branch it runs (the meta
model is traced as fake CPU tensors), and a model torch cannot trace is reported with torch's
reason and the model's line, not a message cut mid-URL. Tiny models built here."""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from costs.families import parse_model_config
from executor import user_model
from executor.pipesplit import split, trace_failure
from executor.profile_symbolic import profile_model

VOCAB, D, S = 16, 8, 4


class DeviceBranching(nn.Module):
    """As HF's MoE experts (transformers integrations/moe.py): histc of float ids on CPU, of int
    ids elsewhere — CPU's histc has no int kernel, so a trace that took the other branch fails
    where it runs."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        ids = input_ids.float() if x.device.type == "cpu" else input_ids.int()
        counts = torch.histc(ids.reshape(-1), bins=VOCAB, min=0, max=VOCAB - 1)
        x = self.mid(x) * (counts.sum() / counts.numel())
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def device_branching():
    def make_batch(samples, generator):
        ids = torch.randint(0, VOCAB, (samples, S), generator=generator)
        return {"input_ids": ids, "labels": ids}
    return DeviceBranching(), make_batch


CFG = {"family": "torch_module", "name": "device_branching", "split_points": ["mid", "head"],
       "factory": "tests.unit.executor.test_user_model_trace:device_branching"}


def test_device_branching_model_profiles_as_it_runs_on_cpu():
    """The symbolic profile runs the CPU branch (before: the meta trace took the int branch and
    the profile failed with '"histogram_cpu" not implemented for 'torch.int32''); the layers it
    hands on hold meta tensors only, and copy without touching a fake tensor's data pointer."""
    cfg = parse_model_config(CFG)
    prof = profile_model(cfg, microbatch=2, dtype="fp32")
    assert [layer.params for layer in prof.layers] == [VOCAB * D, D * D + D, D * VOCAB + VOCAB]
    named = user_model.layers(cfg, rows=2, meta=True)
    tensors = [t for _, m in named for t in (*m.parameters(), *m.buffers())]
    assert tensors and all(t.device.type == "meta" and type(t) in (torch.Tensor, nn.Parameter) for t in tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(named)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
            y = y * 2
        return y.mean()


def test_trace_failure_keeps_torchs_reason_and_the_models_line():
    """Before: the message was cut at 300 characters, inside the docs URL and before the line."""
    line = next(i for i, text in enumerate(inspect.getsourcelines(DataDependent.forward)[0])
                if "y.sum() > 0" in text) + inspect.getsourcelines(DataDependent.forward)[1]
    with pytest.raises(ValueError) as info:
        split(DataDependent(), [], {"x": torch.randn(2, D)})
    msg = str(info.value)
    assert msg.startswith("model.split_points: torch.distributed.pipelining could not trace the model")
    assert "see https://pytorch.org/docs/stable/export.html;" in msg  # the URL whole
    assert f"{__file__}:{line} in forward: if y.sum() > 0:" in msg, msg
    assert "\n" not in msg and "TORCH_LOGS" not in msg  # one line, no debugging hints


def test_trace_failure_drops_what_follows_the_first_paragraph():
    graph = "\n".join(f"    add_{i}: f32[2, 8] = torch.ops.aten.add.Tensor(x, {i})" for i in range(300))
    try:
        try:
            raise TypeError("unsupported op foo\n\nGraph:\n" + graph)
        except TypeError as inner:
            raise RuntimeError("cannot capture the model, see https://example.org/a/very/long/url.html") from inner
    except RuntimeError as exc:
        text = trace_failure(exc)
    assert text.startswith("RuntimeError: cannot capture the model, see https://example.org/a/very/long/url.html; "
                           "caused by TypeError: unsupported op foo (at ")
    assert "add_" not in text and len(text) < 600
