"""One stage of a plan on one device in this process, with the plan's schedule bookkeeping.

``run_stage_alone`` walks the stage's entries of its position's action list (the simulator's list,
so 1F1B keeps min(p - i, m) microbatches in flight here too) but replaces every boundary receive
by a seeded random tensor of the right shape and every send by nothing: the device sees the
memory and compute of that stage without the rest of the pipeline. This is how a single GPU
checks a stage of a plan made for many (and a quick in-process check on CPU).

Swaps run as in the pipeline (executor.swap), except that a ``d2d_swap`` layer, whose peers are
not here, swaps to host memory: the stage's own device memory falls exactly as it would with
peers, and the stripes it would have sent are reported as ``host_peak_bytes``.
"""
from __future__ import annotations

import time

import torch

from executor.memtrack import LiveTensorTracker, tag_static
from executor.models import make_batch, output_shapes
from executor.stage import StageRuntime
from executor.worker import group_actions
from specs.plan import Plan
from specs.schedule import ActionKind


class _LocalStage(StageRuntime):
    """A StageRuntime whose boundary traffic is synthetic (one replica, no process group)."""

    def send(self, kind, k, tensor, on_done=None):
        """Nothing to transfer, but a sent output is released as the pipeline releases it
        (training.deallocate_pipeline_outputs), here at once: no send holds it."""
        self.release_output(kind, k, tensor)

    def recv(self, kind, k, peer, tail):
        gen = torch.Generator().manual_seed(1000 * k + (kind == "grad"))
        rows = self.rows[1] - self.rows[0]
        with self.tracker.phase("buffers"):
            if self.bounds is not None:  # a user model's pytree boundary (executor.user_model)
                from executor import user_model

                bound = self.bounds["act_in" if kind == "act" else "act_out"]
                return user_model.synthetic(bound, kind, rows, gen, self.torch_device, self.dtype)
            return torch.randn((rows, *tail), generator=gen).to(self.torch_device)

    def allreduce_grads(self):
        pass  # one replica: nothing to reduce


def run_stage_alone(plan: Plan, model_cfg, stage_index: int, iterations: int = 2,
                    device: str = "cpu", seed: int = 0, collect: bool = False) -> dict:
    """Train ``iterations`` steps of stage ``stage_index`` (its replica 0, TP rank 0; needs
    tp == 1) on ``device``; the last iteration is measured. Returns ``{"peak_bytes",
    "breakdown", "host_peak_bytes", "iteration_time_s"}``: peak = ``torch.cuda.max_memory_allocated``
    on CUDA (breakdown from the live-tensor tracker), the tracker's peak on CPU; host = swapped-out
    bytes in host memory at most (cpu_swap, nvme, and d2d_swap here). ``collect``: also
    ``"grads"`` (the last iteration's gradients by ``layer.param``, on CPU) and ``"loss"``."""
    stage = plan.stages[stage_index]
    if stage.tp != 1:
        raise ValueError(f"stages[{stage_index}].tp: {stage.tp}; a stage alone runs without TP (tp must be 1)")
    if stage.cp != 1:
        raise ValueError(f"stages[{stage_index}].cp: {stage.cp}; a stage alone has no ring partners (cp must be 1)")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" != "cuda:0": tensors carry an index, and the
        dev = torch.device("cuda", torch.cuda.current_device())  # swapper compares t.device with it
    tracker = LiveTensorTracker()
    st = _LocalStage(plan, model_cfg, stage_index, stage.devices[0], {}, {}, dev, seed, tracker)
    position = plan.device_group_of(stage_index)
    # the rank's list as executor.worker runs it: STRONGHOLD §IV-A streams group the microbatches
    actions = [a for a in group_actions(plan, position) if a.stage == stage_index]
    shapes = output_shapes(model_cfg)
    tail = {s: shapes[plan.stages[s].layer_stop - 1] for s in range(len(plan.stages))}
    cuda = dev.type == "cuda"
    elapsed = 0.0
    for it in range(iterations):
        batch = make_batch(model_cfg, plan.training.global_batch, it, seed)
        st.zero_grad()
        last = it == iterations - 1
        if last:
            tag_static(tracker, [st])
            tracker.reset_peak()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with tracker if last else _nothing():
            for a in actions:
                k = a.microbatch
                if a.kind is ActionKind.forward:
                    x = st.recv("act", k, a.stage - 1, tail[a.stage - 1]) if not st.first else None
                    st.forward(k, x, batch)
                    if not st.last:
                        st.send("act", k, st.outputs[k])
                elif a.kind is ActionKind.swap_in:
                    st.swap_in(k)
                elif a.kind is ActionKind.backward:
                    g = st.recv("grad", k, a.stage + 1, tail[a.stage]) if not st.last else None
                    st.backward(k, g)
                    if st.pipedream is not None:  # PipeDream: an update after every backward (executor.worker
                        st.pipedream.update()     # updates once the input gradient is sent: none is sent here)
                elif a.kind is ActionKind.optimizer_step:
                    st.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else tracker.peak_bytes
    out = {"peak_bytes": peak, "breakdown": dict(tracker.peak_breakdown),
           "host_peak_bytes": tracker.host_peak_bytes, "nvme_peak_bytes": tracker.nvme_peak_bytes,
           "iteration_time_s": elapsed}
    if collect:
        out["loss"] = st.loss_sum
        out["grads"] = {name: g.detach().cpu().clone() for name, _, g in st.named_state()}
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
