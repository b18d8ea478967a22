"""Real partial swaps (MPress §III-D decides per tensor; ``LayerMemory.tensors``) on gloo ranks,
gpt_tiny on local_cpu: one block moves only some of its saved tensors to host memory, the rest of
the layer runs as kept.

Oracles, computed here without the executor: the block's interior saved storages (a real
forward under ``saved_tensors_hooks``, parameters and the block's input and output storages left
out, first-save order: the index space of ``tensors``). A swap copies bytes, so every loss and
gradient equals the unswapped run's exactly; the host holds, per microbatch, exactly the listed
storages' bytes; the device peak lies between the whole-layer swap's and the kept run's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.launch import launch
from executor.measure import execute_run
from executor.models import build_layers
from planners import make_plan, parse_policy
from executor.swap import PACK_BELOW_BYTES
from specs.plan import D2DTarget, LayerMemory, MemoryAction, ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU
from tests.unit.executor.test_swap_protocol import SPEC

pytestmark = pytest.mark.slow
LAYER = 2  # gpt_tiny's second block: embed, block 0, block 1, ... head
SPLITS = {1: [6], 2: [3, 3]}  # pipeline depth -> layers per stage (LAYER on stage 0)
# GPipe: all m microbatches in flight until the backwards (Huang et al. 2019). Under 1F1B a
# single swapped layer lowers no peak here (measured): stage 0 holds one or two microbatches, and
# the first backward's swapped layer is fetched one pass ahead, before that peak
SCHEDULE = "gpipe"


def _plan(pp: int):
    hardware = LOCAL_CPU.model_copy(update={"devices_per_node": pp})  # one device per stage
    return make_plan(parse_policy({"kind": "manual", "pp": pp, "layers_per_stage": SPLITS[pp]}), SPEC, hardware,
                     CPU_TRAINING, ScheduleSpec(kind=SCHEDULE))


def _with(plan, item: LayerMemory):
    """``plan`` with stage 0 swapping ``item`` (no validate_plan: gpt_tiny's closed-form spec lists
    no saved_tensors, which the plan's indices are checked against)."""
    stages = [st.model_copy(update={"memory": [item]}) if i == 0 else st for i, st in enumerate(plan.stages)]
    return plan.model_copy(update={"stages": stages})


def saved_storages(dtype: torch.dtype = torch.float32) -> tuple[list[int], int]:
    """Block LAYER's saved storages at one microbatch (a real forward): the bytes of each one
    other than its parameters, its input and its output, in first-save order, and the bytes of
    all but the parameters (what a whole-layer swap moves)."""
    ((_, _, block),) = build_layers(GPT_TINY, range(LAYER, LAYER + 1), dtype=dtype)
    x = torch.randn(CPU_TRAINING.microbatch_size, GPT_TINY.seq_len, GPT_TINY.hidden, dtype=dtype, requires_grad=True)
    state = {t.untyped_storage()._cdata for t in (*block.parameters(), *block.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in state:
            seen.setdefault(st._cdata, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, {})
    edge = {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    return [n for key, n in seen.items() if key not in edge], sum(seen.values())


def interior_saved_bytes() -> list[int]:
    return saved_storages()[0]


def _listed() -> list[int]:
    """The half of the interior storages with the most bytes (ties: the earlier), ascending."""
    sizes = interior_saved_bytes()
    top = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))[:len(sizes) // 2]
    return sorted(top)


def _partial(tensors=None) -> LayerMemory:
    return LayerMemory(layer=LAYER, action=MemoryAction.cpu_swap, tensors=tensors)


def _f64(plan):
    opts = {"iterations": 2, "collect": True, "memory_iteration": None, "track_memory": False, "fault": None,
            "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float64"}
    out = launch(plan, GPT_TINY, opts, 120.0)
    assert out.failure is None, out.failure
    return out


def _flat(out, key):
    return {k: v for rep in out.reports.values() for k, v in rep[key].items()}


@pytest.mark.parametrize("pp", sorted(SPLITS))
def test_partial_swap_trains_bit_for_bit(pp):
    kept, part = _f64(_plan(pp)), _f64(_with(_plan(pp), _partial(_listed())))
    assert part.losses == kept.losses
    for key in ("grads", "params"):
        got, want = _flat(part, key), _flat(kept, key)
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name], want[name]), (key, name)


def _measure(plan):
    result, _ = execute_run(plan, GPT_TINY, LOCAL_CPU, iterations=1, warmup=1, timeout_s=180, device="cpu")
    assert result.failure is None, result.failure
    return result.devices[0]


@pytest.fixture(scope="module", params=sorted(SPLITS), ids=lambda pp: f"pp{pp}")
def measured(request):
    pp = request.param
    return pp, {name: _measure(_with(_plan(pp), item) if item else _plan(pp))
                for name, item in {"keep": None, "whole": _partial(None), "partial": _partial(_listed())}.items()}


def test_partial_swap_peak_lies_between_whole_layer_swap_and_keep(measured):
    _, runs = measured
    keep, whole, part = runs["keep"].peak_bytes, runs["whole"].peak_bytes, runs["partial"].peak_bytes
    assert whole <= part < keep, (whole, part, keep)


def test_host_holds_exactly_the_listed_storages(measured):
    """At the host peak some n of the m microbatches have their swapped layer on the host (the
    others' fetched back or not yet run); the whole-layer run, which moves every saved storage but
    the parameters', tells n. The partial run holds n times exactly the listed storages' bytes."""
    _, runs = measured
    (sizes, whole_bytes), listed = saved_storages(), _listed()
    per_microbatch = sum(sizes[i] for i in listed)
    assert 0 < per_microbatch < sum(sizes) < whole_bytes  # a subset; the block also saves its input
    n, rest = divmod(runs["whole"].host_bytes, whole_bytes)
    assert rest == 0 and 1 <= n <= CPU_TRAINING.global_batch // CPU_TRAINING.microbatch_size
    assert runs["partial"].host_bytes == n * per_microbatch
    assert runs["keep"].host_bytes == 0


def test_partial_d2d_swap_stripes_only_the_listed_storages():
    """pp=2, stage 0's block d2d-swaps the listed storages to device 1 (MPress §III-C): trains
    bit for bit, and device 1 receives exactly the listed bytes of every microbatch per iteration
    (they are all above PACK_BELOW_BYTES, so none travels packed with alignment padding)."""
    sizes, listed = interior_saved_bytes(), _listed()
    assert min(sizes[i] for i in listed) >= PACK_BELOW_BYTES
    item = LayerMemory(layer=LAYER, action=MemoryAction.d2d_swap, tensors=listed,
                       targets=[D2DTarget(device=1, weight=1.0)])
    kept, part = _f64(_plan(2)), _f64(_with(_plan(2), item))
    assert part.losses == kept.losses
    for key in ("grads", "params"):
        got, want = _flat(part, key), _flat(kept, key)
        for name in want:
            assert np.array_equal(got[name], want[name]), (key, name)
    received = {rep["device"]: rep.get("d2d_received_bytes") for rep in part.reports.values()}
    m = CPU_TRAINING.global_batch // CPU_TRAINING.microbatch_size
    f64_sizes = saved_storages(torch.float64)[0]  # the numerics runs are float64
    assert received[1] == m * sum(f64_sizes[i] for i in listed)


def test_index_past_the_layers_saved_tensors_fails_by_name():
    n = len(interior_saved_bytes())
    opts = {"iterations": 1, "collect": False, "memory_iteration": None, "track_memory": False, "fault": None,
            "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float32"}
    out = launch(_with(_plan(1), _partial([0, n])), GPT_TINY, opts, 120.0)
    assert out.failure is not None
    assert f"stage 0 layer {LAYER}" in out.failure and f"index {n}" in out.failure
    assert f"saved {n} tensors" in out.failure, out.failure


def test_a_plan_made_for_another_tensor_count_fails_by_name():
    """``tensors_of`` (the count the plan's model listed) differs from what the layer saves: the
    executor refuses rather than move other tensors (CUDA attention saves more than CPU's)."""
    n = len(interior_saved_bytes())
    opts = {"iterations": 1, "collect": False, "memory_iteration": None, "track_memory": False, "fault": None,
            "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float32"}
    item = _partial([0]).model_copy(update={"tensors_of": n + 2})
    out = launch(_with(_plan(1), item), GPT_TINY, opts, 120.0)
    assert out.failure is not None
    assert f"made for {n + 2} saved tensors" in out.failure and f"saved {n} besides" in out.failure, out.failure
    right = launch(_with(_plan(1), _partial([0]).model_copy(update={"tensors_of": n})), GPT_TINY, opts, 120.0)
    assert right.failure is None, right.failure
