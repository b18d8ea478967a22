"""A stage's gradients and optimizer step: zeroing, the data-parallel all-reduce of the stage's
gradients (one bucket), Megatron's embedding-group all-reduce of a tied input/output embedding
split over two stages (Narayanan et al. 2021), and the optimizer step (resident parameters on
the device, a STRONGHOLD window's streamed layers on the CPU, MPress's optimizer swap,
ZeRO-Offload's CPU step, executor.zero_offload, or Megatron's distributed optimizer, executor.zero1; a weight-swapped layer's CPU steps,
executor.weight_swap, run as its gradients land).

StageGrads is a mixin of executor.stage.StageRuntime: it reads the runtime's parameters, groups,
optimizer, window and tracker set up there."""
from __future__ import annotations

import torch
import torch.distributed as dist


def tied_embedding_weight(st, groups: dict):
    """(parameter, process group) of a tied input/output embedding that ``st`` must keep in sync
    with another stage (see StageRuntime.allreduce_embedding_grads), or None. Where embedding
    and head sit in this one stage, executor.models tied them into one Parameter; TP
    parallelisation replaced both with DTensors (same vocabulary rows per TP rank: the embedding
    is row-, the decoder column-parallel), so they are tied again here."""
    if not getattr(st.cfg, "tie_embeddings", False) or not (st.first or st.last):
        return None
    mods = {i: mod for i, _, mod in st.layers}
    last = len(st.plan.stages) - 1
    head_index = st.plan.stages[last].layer_stop - 1
    if 0 in mods and head_index in mods:
        mods[head_index].decoder.weight = mods[0].wte.weight
        return None
    if set(st.plan.stages[0].devices) & set(st.plan.stages[last].devices):
        raise ValueError("model.tie_embeddings: the first and last pipeline stages share devices but not a "
                         "stage; the executor ties them only within one stage or across disjoint devices "
                         "(set model.tie_embeddings=false)")
    group = groups.get(("embed", 0, 0))  # topology.process_groups makes it; a stage run alone has none
    if group is None:
        return None
    return (mods[0].wte.weight if st.first else mods[head_index].decoder.weight), group


class StageGrads:
    """Gradient sync and optimizer step of executor.stage.StageRuntime (a mixin: the state is the
    runtime's)."""

    @property
    def zero_offload(self):
        """ZeRO-Offload's host side (executor.zero_offload) of a stage with ``offload.optimizer_on_cpu``
        and no window, made on first use (before the first pass: zero_grad starts every
        iteration); None for any other stage."""
        zo = self.__dict__.get("_zero_offload", False)
        if zo is False:
            off = self.stage.offload
            zo = None
            if off.optimizer_on_cpu and off.window_layers is None:
                from executor.zero_offload import ZeroOffload

                zo = ZeroOffload(self, getattr(self, "nvme_dir", None))
            self.__dict__["_zero_offload"] = zo
        return zo

    def zero_grad(self) -> None:
        if self.zero_offload is not None:
            self.zero_offload.zero_grad()
        if self.zero1 is not None:  # executor.zero1: its buckets' last-microbatch counters
            self.zero1.zero_grad()
        for p in self.params:
            if p.grad is not None:  # ZeRO-2 keeps no whole gradient between microbatches (executor.zero2)
                p.grad.zero_()
        if self.window is not None:
            self.window.zero_grad()
        if self.weight_swap is not None:
            self.weight_swap.zero_grad()
        self.loss_sum = 0.0
        if self.ties is not None:
            self.ties.reset()

    def allreduce_grads(self) -> None:
        """One SUM all-reduce of the stage's flattened gradients over its replicas (one bucket, as
        the simulator charges one ring all-reduce per stage; per-tensor calls cost gloo ~0.6 ms
        of latency each on local_cpu). Tied weights of a user model are summed over their copies
        first (user_model.TiedGrads; once per rank and iteration). PipeDream: each microbatch's
        gradient was all-reduced before its update (executor.pipedream), nothing is left here."""
        if self.pipedream is not None:
            return
        if self.ties is not None:
            with self.tracker.phase("buffers"):
                self.ties.sync(self.tracker.release)
        if self.zero1 is not None:  # ZeRO-1's reduce-scatter / overlapped buckets (executor.zero1)
            self.zero1.reduce()
            return
        self.allreduce_dp([p.grad for p in self.params])

    def allreduce_dp(self, grads: list) -> None:
        """SUM all-reduce of ``grads`` (the stage's gradient buffers) over the stage's replicas, as
        one flat bucket; nothing without replicas."""
        if self.dp_group is None:
            return
        local = [getattr(g, "_local_tensor", g) for g in grads]
        with self.tracker.phase("buffers"):
            flat = torch.cat([g.reshape(-1) for g in local])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
            offset = 0
            for g in local:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.tracker.release(flat)  # not del: gloo's worker thread may still hold it (memtrack)

    def allreduce_embedding_grads(self) -> None:
        """Megatron's embedding group (Narayanan et al. 2021; ``_allreduce_word_embedding_grads``
        after the data-parallel sync): the first stage's word embedding and the last stage's
        head copy get the sum of both gradients, so the two copies stay equal. After the DP
        all-reduce every rank of a stage holds its stage's whole gradient (TP shards gathered
        here), so one rank per stage contributes it and the others zeros: the sum is exactly
        embedding grad + head grad, as one process accumulates it."""
        if self.tied is None or self.pipedream is not None:  # PipeDream: executor.pipedream syncs it
            return
        param, group = self.tied
        if hasattr(self.zero1, "tied_acc"):  # ZeRO-2 (executor.zero2): no whole gradient, its shard only
            self._sum_tied_shards(param, group)
            return
        if getattr(self, "fsdp", None) is not None:  # ZeRO-3 (executor.fsdp): FSDP2's Shard(0) DTensor gradient
            self._sum_tied_dtensor_shards(param, group)
            return
        g = param.grad
        local = getattr(g, "_local_tensor", g)
        with self.tracker.phase("buffers"):
            if self.zero1 is not None and self.zero1.shard:
                # ZeRO-1: each replica holds the dp sum of its shard of its tp rank's vocabulary rows
                # only (the same elements on both stages, executor.zero1), so every (replica, tp rank)
                # contributes that shard in its rows' place, zeros elsewhere
                lo, hi = self.zero1.tied_shard(param)
                full = torch.zeros(g.shape, dtype=local.dtype, device=local.device)
                mine = torch.chunk(full, self.stage.tp, dim=0)[self.tp_rank] if self.stage.tp > 1 else full
                mine.view(-1)[lo:hi] = local.reshape(-1)[lo:hi]
            else:
                full = g.full_tensor() if hasattr(g, "full_tensor") else local.clone()
                if self.replica or self.cp_rank or self.tp_rank:
                    full.zero_()
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
            if self.map is not None:  # a MAP layout: this rank's shard of it (a local split, no communication)
                from torch.distributed.tensor import distribute_tensor

                local.copy_(distribute_tensor(full, g.device_mesh, g.placements, src_data_rank=None).to_local())
            else:
                local.copy_(torch.chunk(full, self.stage.tp, dim=0)[self.tp_rank] if self.stage.tp > 1 else full)
        if full.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
            self.tracker.release(full)  # a copy (a replicated DTensor's full_tensor() is its local tensor)

    def _sum_tied_shards(self, param, group) -> None:
        """ZeRO-2's embedding group: each replica's reduced shard of the tied weight (the same
        elements on both stages, executor.zero2), elements [lo, hi) of the flattened weight."""
        lo, hi = self.zero1.tied_shard(param)
        self._sum_tied_part(param.shape, self.zero1.tied_acc(param), lambda full: full.view(-1)[lo:hi], group)

    def _sum_tied_dtensor_shards(self, param, group) -> None:
        """ZeRO-3's embedding group: both stages shard the tied weight alike (FSDP2's Shard(0) rows
        over the same dp degree, of the TP shard where tp > 1; executor.fsdp), so a rank's reduced
        gradient shard (FSDP2's last reduce-scatter of the iteration has landed: its final callback
        waited for it) covers the same rows as the matching rank's on the other stage. Both stages
        add the same two numbers, so the copies' gradients, and with them their Adam states and
        weights, stay bitwise equal."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        g = param.grad
        shape, offset = compute_local_shape_and_global_offset(g.shape, g.device_mesh, g.placements)
        rows = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        self._sum_tied_part(g.shape, g._local_tensor, lambda full: full[rows], group)

    def _sum_tied_part(self, shape, local: torch.Tensor, part, group) -> None:
        """A sharded tied gradient summed over the embedding group: ``local`` (this rank's shard) at
        its place ``part(full)`` in a zero tensor of the weight's ``shape``, one all-reduce (the
        whole-size buffer costs.buffers ``tied_sync_buffer_bytes`` holds), the sum copied back: every
        rank then holds its shard of g_first + g_last."""
        with self.tracker.phase("buffers"):
            full = torch.zeros(shape, dtype=local.dtype, device=local.device)
        view = part(full)
        view.copy_(local)
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        local.copy_(view)
        self.tracker.release(full)  # gloo's worker thread may still hold it (executor.memtrack.release)

    def step(self) -> None:
        if self.weight_swap is not None:  # its CPU steps were submitted as the gradients landed
            self.weight_swap.finish()
        if self.pipedream is not None:  # the updates ran after each backward: the tied ones left
            self.pipedream.end_iteration(self.m)
            return
        self.step_optimizer()

    def step_optimizer(self) -> None:
        if self.zero_offload is not None:  # ZeRO-Offload: the CPU steps, the device's optimizer never does
            self.zero_offload.step()
            return
        if self.window is not None:  # the streamed layers' CPU steps (overlapped with the backward)
            self.window.step()
        if self.opt_swap is not None:
            self.opt_swap.step()
            return
        if self.optimizer is None:  # every layer streamed: nothing on the device to step
            return
        if self.zero1 is not None and self.zero1.shard:  # ZeRO-1: the shards' step, then the all-gather
            self.zero1.step(self.optimizer, self.tracker)
            self._tag_optimizer_state()
            return
        with self.tracker.phase("optimizer"):
            self.optimizer.step()
        self._tag_optimizer_state()

    def _tag_optimizer_state(self) -> None:
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.tracker.tag(v, "optimizer")
