"""A stage's forward and backward passes: a microbatch's rows, each layer run as its memory
action says (kept, recomputed under ``torch.utils.checkpoint``, its saved tensors swapped out by
executor.swap, or streamed through a STRONGHOLD window, executor.window; a weight-swapped layer's
weights fetched from host memory around each pass, executor.weight_swap), a MAP stage's
checkpoint segments (executor.map_stage), and the backward from the loss or a received gradient.

StagePasses is a mixin of executor.stage.StageRuntime: it reads the runtime's layers, window,
swapper, boundaries and microbatch tables set up there."""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from executor import op_sac, user_model
from executor.boundary import run_backward
from executor.megatron_tp import loss_context
from executor.selective import SelectiveCore
from specs.plan import MemoryAction, stage_for_microbatch

SWAPS = (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)  # executor.swap


class StagePasses:
    """Forward/backward of executor.stage.StageRuntime (a mixin: the state is the runtime's)."""

    def _microbatch(self, batch: dict, k: int) -> dict:
        base = k * self.plan.training.samples_per_microbatch
        lo, hi = base + self.rows[0], base + self.rows[1]
        need = set()
        if self.first:
            need |= {"ids", "token_types", "images"}
        if self.last:
            need.add("targets")
        # keys of a user's own model (family torch_module) may be read by any layer: every stage gets them
        need |= {key for key in batch if key not in ("ids", "token_types", "images", "targets")}
        # clone: a loader hands each rank its own rows, not a view of the global batch; values that
        # are not per sample (a user model's (1, s) position ids) go whole (user_model.Batch)
        out = {key: v.clone().to(self.torch_device)
               for key, v in user_model.microbatch(batch, lo, hi).items() if key in need}
        if self.positions is not None:  # context parallelism: this cp rank's tokens of each sequence
            cols = self.positions.to(self.torch_device)
            out = {key: v[:, cols] if key in ("ids", "token_types", "targets") else v for key, v in out.items()}
        return out

    def run_as(self, k: int) -> list:
        """(global layer index, module, memory action) of each layer for microbatch ``k``."""
        found = self._run_as.get(k % self._period)
        if found is None:
            variant = stage_for_microbatch(self.stage, k)
            found = self._run_as[k % self._period] = [(i, mod, variant.action_of(i).action) for i, _, mod in self.layers]
        return found

    def forward(self, k: int, x: torch.Tensor | None, batch: dict) -> None:
        if self.workers is not None:  # STRONGHOLD §IV-A: the group of S microbatches from k
            return self._forward_group(k, batch)
        mb = self._microbatch(batch, k)
        if isinstance(x, torch.Tensor):  # a pytree boundary comes with requires_grad set (user_model.assemble)
            x.requires_grad_(True)
        self.inputs[k] = x
        if self.swapper is not None:
            self.swapper.begin_forward(k, x)
        pd = self.pipedream
        if pd is not None:
            pd.begin_forward(k)
        if self.weight_swap is not None:
            self.weight_swap.begin_pass("F", k)
        with (self.window.pass_("F", k) if self.window is not None else
              torch.autograd.graph.saved_tensors_hooks(pd.pack, pd.unpack) if pd is not None and pd.swap_slots
              else contextlib.nullcontext()):
            y = self._layers_forward(k, x, mb)
        if self.last:
            # PipeDream: the loss reported is the microbatches' mean, the gradient each one's own
            self.loss_sum += float(y.detach()) * (self.loss_scale if pd is None else 1.0 / self.m)
            y = y * self.loss_scale
        self.outputs[k] = y

    def _layers_forward(self, k: int, y, mb: dict):
        if self.map is not None:  # MAP: rotor's checkpoint segments over DTensor layers (executor.map_exec)
            return self.map.forward(y, mb)
        ws = self.weight_swap  # MPress §II-D live weights in host memory (executor.weight_swap)
        for pos, (i, mod, action) in enumerate(self.run_as(k)):
            if ws is not None:  # the next layer's fetch issued, this one's waited for
                ws.before_forward(pos)
            if self.window is not None and self.window.streams(i):  # executor.window
                recompute = action is MemoryAction.recompute
                y = self.window.forward_layer(
                    i, (lambda y=y, mod=mod: checkpoint(mod, y, mb, use_reentrant=False)) if recompute
                    else (lambda y=y, mod=mod: mod(y, mb)), recompute)
            elif action is MemoryAction.recompute:
                y = checkpoint(mod, y, mb, use_reentrant=False)
            elif action is MemoryAction.selective:  # Korthikanti §5: the attention core recomputed
                with SelectiveCore():
                    y = mod(y, mb)
            elif action is MemoryAction.op_sac:  # torchtitan's op-level selective checkpointing
                y = op_sac.run(mod, y, mb)
            elif action in SWAPS:  # saved tensors leave the device at the layer's end (executor.swap)
                with self.swapper.layer(k, i, y if y is not None else mb) as output:  # a first layer reads mb
                    y = output(mod(y, mb))
            elif ws is not None:
                with ws.hooks(pos):  # saved weights re-made from the backward's fetch
                    y = mod(y, mb)
            else:
                y = mod(y, mb)
            if ws is not None:  # a swapped layer's weights go; the backward's fetch hook
                y = ws.after_forward(pos, y)
        return y

    def swap_in(self, k: int) -> None:
        """The schedule's ``swap_in`` entries: prefetch microbatch ``k``'s first swapped layer."""
        if self.swapper is not None:
            self.swapper.swap_in(k)

    def backward(self, k: int, grad: torch.Tensor | None) -> None:
        if self.workers is not None:
            return self._backward_group(k)
        y = self.outputs.pop(k)
        if self.swapper is not None:
            self.swapper.begin_backward(k)
        if self.pipedream is not None:  # k's stashed weight version in the modules (executor.pipedream)
            self.pipedream.begin_backward(k)
        if self.weight_swap is not None:
            self.weight_swap.begin_pass("B", k)
        with self.window.pass_("B", k) if self.window is not None else contextlib.nullcontext():
            self._run_backward(y, grad)
        if self.weight_swap is not None:
            self.weight_swap.end_backward(k)
        if self.swapper is not None:
            self.swapper.end_backward(k)
        if self.pipedream is not None:
            self.pipedream.end_backward(k)
        for p in self.params:  # accumulation may have replaced a grad tensor: keep it filed
            self.tracker.tag(p.grad, "gradients")
        x = self.inputs.pop(k)
        if self.bounds is not None:
            self.grad_to_send = user_model.input_grads(x) if x is not None else None
        else:
            self.grad_to_send = x.grad if x is not None else None

    def _run_backward(self, y, grad) -> None:
        if self.last:
            with loss_context(self.vocab_parallel):
                y.backward()
        elif self.bounds is not None:
            user_model.backward(y, grad, self.release_outputs)
        elif self.release_outputs:
            run_backward([y], [grad])
        else:
            y.backward(grad)

    # ---- STRONGHOLD §IV-A: S workers, one group pass (executor.window_streams) ----------------
    def _forward_group(self, k0: int, batch: dict) -> None:
        """Microbatches k0 .. k0 + S - 1, worker w running k0 + w through every layer in its thread;
        a streamed layer is fetched once for the group. A one-stage pipeline (preflight): no
        boundary comes in, every worker's output is its loss; the losses are summed in worker
        order, as the single worker sums them in microbatch order."""
        tracker = self.tracker

        def run(w: int):
            k = k0 + w
            with tracker:  # a dispatch mode is thread-local: the tracked iteration counts each worker's tensors
                y = self._layers_forward(k, None, self._microbatch(batch, k))
                loss = float(y.detach())
                return y * self.loss_scale, loss

        with self.window.pass_("F", k0):
            outs = self.workers.run(run, self.window._check)
        for w, (y, loss) in enumerate(outs):
            self.inputs[k0 + w] = None
            self.loss_sum += loss * self.loss_scale
            self.outputs[k0 + w] = y

    def _backward_group(self, k0: int) -> None:
        tracker = self.tracker
        ys = [self.outputs.pop(k0 + w) for w in range(self.streams)]

        def run(w: int):
            with tracker:
                self._run_backward(ys[w], None)

        with self.window.pass_("B", k0):
            if self.torch_device.type == "cuda":  # one autograd call over the S outputs: the device's one
                with loss_context(self.vocab_parallel):  # autograd thread runs every worker's backward
                    torch.autograd.backward(ys)  # anyway, each op on its forward's stream (window_streams)
            else:
                self.workers.run(run, self.window._check)
        ys.clear()  # the outputs' graphs go now (the workers' closures read the list)
        for p in self.params:
            self.tracker.tag(p.grad, "gradients")
        for w in range(self.streams):
            self.inputs.pop(k0 + w, None)
        self.grad_to_send = None
