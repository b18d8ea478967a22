"""executor.traffic: the bytes a pass's memory-bound operators move, counted operator by operator
as the docstring defines them, on passes whose traffic is known by hand; and the symbolic profile
of a user's layer gives it to the model spec, which prices it (costs.layer_time._mem_s)."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from executor.traffic import Traffic

N = 4 * 8  # elements of the test activation


class CastScaleAdd(nn.Module):
    """Eager mixed precision in miniature: a bias-free projection (a GEMM: priced by FLOPs, no
    traffic), then a cast up, a scale, a cast down and a residual add (traffic) and views (none)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        y = self.proj(x).float()                # mm (no traffic); _to_copy: reads 2N, writes 4N
        y = (y * 3.0).to(torch.bfloat16)        # mul: 4N + 4N; _to_copy: 4N + 2N
        return (y + x).view(-1).view(4, 8)      # add: 2N + 2N + 2N; views: nothing


def _keys(tensors) -> set:
    return {StorageWeakRef(t.untyped_storage()) for t in tensors}


def test_forward_traffic_by_hand():
    mod = CastScaleAdd().to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    traffic = Traffic(_keys(mod.parameters()), set())
    with traffic:
        mod(x)
    assert traffic.bytes == (2 + 4) * N + (4 + 4) * N + (4 + 2) * N + (2 + 2 + 2) * N


def test_a_linear_on_a_batched_activation_moves_nothing():
    """F.linear on a 3-D input runs view, mm and ``_unsafe_view`` (the GEMM's output reshaped back,
    sharing its storage): a GEMM, priced by FLOPs, and no bytes of traffic; its backward likewise
    (mm for the input and the weight gradients, views), the weight gradient's add into .grad aside."""
    mod = nn.Linear(8, 8, bias=False)
    mod.weight.grad = torch.zeros_like(mod.weight)
    x = torch.randn(2, 4, 8, requires_grad=True)
    fwd = Traffic(_keys(mod.parameters()), _keys([mod.weight.grad]))
    with fwd:
        y = mod(x)
    assert fwd.bytes == 0
    grad, bwd = torch.ones_like(y), Traffic(_keys(mod.parameters()), _keys([mod.weight.grad]))
    with bwd:
        y.backward(grad)
    assert bwd.bytes == 0 and mod.weight.grad.abs().sum() > 0


def test_grad_accumulation_and_parameters_are_not_traffic():
    """The backward of a scale by a parameter (fp32, N elements): what its operators move, less the
    add of the weight's gradient into its pre-allocated .grad buffer and the parameter operand."""
    w = nn.Parameter(torch.ones(8))
    w.grad = torch.zeros_like(w)
    x = torch.randn(4, 8, requires_grad=True)
    y = x * w                              # forward: x read (4N), y written (4N); w not counted
    fwd = Traffic(_keys([w]), _keys([w.grad]))
    with fwd:
        x * w
    assert fwd.bytes == 8 * N
    grad, bwd = torch.ones_like(y), Traffic(_keys([w]), _keys([w.grad]))
    with bwd:
        y.backward(grad)
    # grad·w (4N in, 4N out; w not counted), grad·x (8N in, 4N out), its sum over the rows
    # (4N in, 8 floats out); the add_ of those 8 floats into w.grad not counted
    assert bwd.bytes == 8 * N + 12 * N + 4 * N + 8 * 4
    assert w.grad.abs().sum() > 0


def test_a_profiled_user_layer_prices_its_traffic():
    """tests/byom_models' blocks: the profile's per-pass traffic reaches the model spec and its
    backward's time (measured bytes, not BWD_MEM_FACTOR x the forward's)."""
    from costs.families import parse_model_config
    from costs.layer_time import _mem_s
    from executor.profile_symbolic import profile_model
    from specs.hardware import HardwareSpec
    from specs.profile import model_from_profile
    from tests.conftest import conf

    cfg = parse_model_config({"family": "torch_module", "name": "tiny_rope_layers",
                              "factory": "tests.byom_models:layered"})
    prof = profile_model(cfg, microbatch=2, dtype="fp32")
    model = model_from_profile(prof)
    block = model.layers[1]
    assert prof.layers[1].fwd_mem_bytes > 0 and prof.layers[1].bwd_mem_bytes > 0
    assert block.fwd_mem_bytes_per_sample == -(-prof.layers[1].fwd_mem_bytes // 2)
    hw = HardwareSpec.model_validate(conf("hardware", "h100_node"))
    assert _mem_s(block, 2, 1, hw, backward=True) == 2 * block.bwd_mem_bytes_per_sample / hw.device.hbm_bytes_per_s
