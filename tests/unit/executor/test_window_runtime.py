"""executor.window in one process: the order of fetches, releases and gradient copies is the
contract's (specs.plan.OffloadPolicy, the order the simulator times), training through the slot
pool equals plain training bit for bit (a fetch and a gradient copy move bytes; host += slot is
autograd's own order of accumulation), and the NVMe state leaves no file behind.

The toy stage: five layers of unequal sizes (so slots are reused by layers of another shape),
layer 0 resident, 1..4 streamed, float64 on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from executor.window import Window

F64 = torch.float64
SIZES = [8, 16, 12, 16, 8, 8]  # feature widths between layers: layer i maps SIZES[i] -> SIZES[i + 1]
STREAMED = [1, 2, 3, 4]


class Layer(nn.Module):
    def __init__(self, a: int, b: int):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(a), nn.Linear(a, b)

    def forward(self, x):
        return torch.tanh(self.fc(self.ln(x)))


def toy() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Layer(a, b).to(F64) for a, b in zip(SIZES, SIZES[1:])]


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, fused=True)


def data(it: int, k: int):
    g = torch.Generator().manual_seed(100 * it + k)
    return torch.randn(3, SIZES[0], generator=g, dtype=F64), torch.randn(3, SIZES[-1], generator=g, dtype=F64)


def passes(m: int, schedule: str) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in reversed(range(m))]
    return [p for k in range(m) for p in (("F", k), ("B", k))]  # one stage: 1F1B is F0 B0 F1 B1 ...


def train_window(w: int, m: int = 3, iterations: int = 2, schedule: str = "1f1b", recompute=(), nvme_dir=None):
    mods = toy()
    win = Window(list(enumerate(mods)), STREAMED, w, m, torch.device("cpu"), adam, F64,
                 nvme=nvme_dir is not None, nvme_dir=nvme_dir, record=True)
    resident = adam(list(mods[0].parameters()))
    for p in mods[0].parameters():
        p.grad = torch.zeros_like(p)
    for it in range(iterations):
        win.zero_grad()
        for p in mods[0].parameters():
            p.grad.zero_()
        losses = {}
        for kind, k in passes(m, schedule):
            with win.pass_(kind, k):
                if kind == "F":
                    x, t = data(it, k)
                    y = mods[0](x)
                    for i in STREAMED:
                        if i in recompute:
                            run = lambda y=y, i=i: checkpoint(mods[i], y, use_reentrant=False)  # noqa: E731
                        else:
                            run = lambda y=y, i=i: mods[i](y)  # noqa: E731
                        y = win.forward_layer(i, run, recompute=i in recompute)
                    losses[k] = ((y - t) ** 2).mean() / m
                else:
                    losses.pop(k).backward()
        win.step()
        resident.step()
    weights = {(i, n): (win.host_state(p) or (p, p.grad))[0].clone() for i, mod in enumerate(mods)
               for n, p in mod.named_parameters()}
    grads = {(i, n): (win.host_state(p) or (p, p.grad))[1].clone() for i, mod in enumerate(mods)
             for n, p in mod.named_parameters()}
    return win, weights, grads


def train_plain(m: int = 3, iterations: int = 2, schedule: str = "1f1b"):
    mods = toy()
    params = [p for mod in mods for p in mod.parameters()]
    opt = adam(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    for it in range(iterations):
        for p in params:
            p.grad.zero_()
        losses = {}
        for kind, k in passes(m, schedule):
            if kind == "F":
                x, t = data(it, k)
                y = x
                for mod in mods:
                    y = mod(y)
                losses[k] = ((y - t) ** 2).mean() / m
            else:
                losses.pop(k).backward()
        opt.step()
    return ({(i, n): p.detach().clone() for i, mod in enumerate(mods) for n, p in mod.named_parameters()},
            {(i, n): p.grad.clone() for i, mod in enumerate(mods) for n, p in mod.named_parameters()})


def contract(order: list[int], w: int, schedule: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """The fetch/release/evict sequence the OffloadPolicy docstring prescribes, written from its
    text: a pass ensures the first min(w, n) layers of its order (present ones stay, missing ones
    come in order into slots holding layers it does not need, empty slots first); the layer at
    j + w comes when the slot of the layer at j is released; the last w layers are not released."""
    slots: list[int | None] = [None] * w
    out = []
    n = len(order)
    for kind, k in schedule:
        seq = order if kind == "F" else order[::-1]
        need = seq[:w]
        for layer in need:
            if layer not in slots:
                free = [s for s, held in enumerate(slots) if held is None] or \
                       [s for s, held in enumerate(slots) if held not in need]
                if slots[free[0]] is not None:
                    out.append(("evict", slots[free[0]], k))
                slots[free[0]] = layer
                out.append(("fetch", layer, k))
        for j in range(n - w):
            s = slots.index(seq[j])
            out.append(("release", seq[j], k))
            slots[s] = seq[j + w]
            out.append(("fetch", seq[j + w], k))
    return out


@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fetch_and_release_order_is_the_contracts(w, schedule):
    m = 3
    win, _, _ = train_window(w, m=m, iterations=1, schedule=schedule)
    got = [e for e in win.events if e[0] in ("fetch", "release", "evict")]
    assert got == contract(STREAMED, w, passes(m, schedule))
    # gradients leave in the backward's order, every microbatch; the last one's steps follow
    d2h = [e for e in win.events if e[0] == "d2h"]
    assert d2h == [("d2h", layer, k) for kind, k in passes(m, schedule) if kind == "B" for layer in STREAMED[::-1]]
    last = passes(m, schedule)[-1][1]
    assert [e for e in win.events if e[0] == "step"] == [("step", layer, last) for layer in STREAMED[::-1]]


def test_hand_written_w1_trace():
    """One forward and one backward, w = 1, streamed 1..4, in words: the forward fetches 1, and
    each layer's end brings the next; the backward starts with 4 (kept), each gradient copy
    frees the slot for the layer below; layer 1 stays for the next forward."""
    win, _, _ = train_window(1, m=1, iterations=1)
    assert [e[:2] for e in win.events if e[0] != "step"] == [
        ("fetch", 1), ("release", 1), ("fetch", 2), ("release", 2), ("fetch", 3), ("release", 3), ("fetch", 4),
        ("d2h", 4), ("release", 4), ("fetch", 3), ("d2h", 3), ("release", 3), ("fetch", 2),
        ("d2h", 2), ("release", 2), ("fetch", 1), ("d2h", 1)]


@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_training_through_the_window_equals_plain_training_bit_for_bit(w, schedule):
    _, weights, grads = train_window(w, schedule=schedule)
    want_w, want_g = train_plain(schedule=schedule)
    for key in want_w:
        assert torch.equal(weights[key], want_w[key]), ("weight", key)
        assert torch.equal(grads[key], want_g[key]), ("grad", key)


def test_recomputed_layers_in_the_window_train_bit_for_bit():
    """torch.utils.checkpoint re-runs a streamed layer in its backward, when it is in a slot
    again (possibly another one): the recompute reads the right weights."""
    _, weights, grads = train_window(1, recompute=(2, 3), schedule="gpipe")
    want_w, want_g = train_plain(schedule="gpipe")
    for key in want_w:
        assert torch.equal(weights[key], want_w[key]) and torch.equal(grads[key], want_g[key]), key


def test_the_pool_is_w_slots_of_the_largest_streamed_layer():
    mods = toy()
    largest = max(sum(p.numel() for p in mods[i].parameters()) for i in STREAMED)
    for w in (1, 3):
        win = Window(list(enumerate(copy.deepcopy(mods))), STREAMED, w, 1, torch.device("cpu"), adam, F64)
        assert len(win.slots) == w
        assert all(s.wbuf.numel() == largest and s.gbuf.numel() == largest for s in win.slots)
        # a released layer holds no device bytes: its parameters point at an empty tensor
        assert all(p.numel() == 0 for L in win.order for p in L.params)


def test_nvme_state_is_file_backed_and_leaves_no_file(tmp_path):
    win, weights, grads = train_window(2, nvme_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # unlinked at set-up: nothing to leak, even on SIGKILL
    maps = open("/proc/self/maps").read()
    assert f"{tmp_path}/" in maps and "(deleted)" in maps  # the state is mapped from those files
    assert win.nvme_bytes == 2 * 8 * sum(L.numel for L in win.order)  # exp_avg + exp_avg_sq, float64
    want_w, want_g = train_plain()
    for key in want_w:
        assert torch.equal(weights[key], want_w[key]) and torch.equal(grads[key], want_g[key]), key
