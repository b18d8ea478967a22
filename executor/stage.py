"""One stage of the plan as one rank holds it: its layers (TP-sharded if tp > 1), its optimizer,
the microbatches in flight, and the boundary sends/receives with resharding between meshes."""
from __future__ import annotations

import contextlib
import math
import queue
import threading

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from executor import user_model
from executor.boundary import release, run_backward
from executor.models import Block, LMHead, MoEBlock, TokenEmbedding, build_layers
from executor.optim_swap import OptimizerSwap
from executor.swap import Swapper
from executor.window import Window
from executor.topology import coords, message_tag, replica_rows, routes
from specs.plan import MemoryAction, Plan, stage_for_microbatch
from specs.training import Optimizer

SWAPS = (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)  # executor.swap
LR = {Optimizer.adam: 1e-3, Optimizer.sgd: 1e-2}


def tensor_parallel(layers, group, device_type: str) -> bool:
    """Megatron TP with DTensor (Shoeybi et al. 2019 §3). Blocks: column-parallel q, k, v, fc1;
    row-parallel projection and fc2. Token embedding: vocab-parallel (row-parallel ``wte``; the
    position table stays replicated, as the spec counts). LM head: column-parallel decoder whose
    sharded logits feed ``loss_parallel`` cross-entropy, so no rank holds the full s·V logits.
    Other layers (Wide-ResNet, MoE experts) stay replicated: exact, but not memory-saving.
    Returns True when the stage's loss is vocab-parallel (backward must run under loss_parallel)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, device_type)
    attn = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel()}
    vocab_parallel = False
    for _, _, mod in layers:
        if isinstance(mod, Block):
            parallelize_module(mod, mesh, {**attn, "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
        elif isinstance(mod, MoEBlock):
            parallelize_module(mod, mesh, attn)
        elif isinstance(mod, TokenEmbedding):
            parallelize_module(mod, mesh, {"wte": RowwiseParallel(input_layouts=Replicate())})
        elif isinstance(mod, LMHead):
            parallelize_module(mod, mesh, {"decoder": ColwiseParallel(output_layouts=Shard(-1),
                                                                      use_local_output=False)})
            mod.vocab_parallel = vocab_parallel = True
    return vocab_parallel


def _loss_context(vocab_parallel: bool):
    if not vocab_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


class SendReaper:
    """Frees each isend's buffer as soon as the send completes.

    gloo's ``Work.is_completed()`` stays False until someone calls ``wait()`` (checked on torch
    2.13), and waiting in the schedule's thread could block on a peer that has not reached its
    recv yet. A helper thread waits on the sends in order (``wait`` releases the GIL) and drops
    each buffer when its send is done, so a 32-microbatch 1F1B run does not keep 32 sent
    activations alive. ``drain`` (end of iteration) waits for all and re-raises a send error."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                item[0].wait()
                if item[2] is not None:
                    item[2]()
            except BaseException as exc:  # noqa: BLE001 - surfaced by drain()
                self._error = exc
            del item
            self._q.task_done()

    def add(self, work, buffer: torch.Tensor, on_done=None) -> None:
        """``on_done()`` (optional) is called in the reaper thread once the send completed."""
        self._q.put((work, buffer, on_done))

    def drain(self) -> None:
        self._q.join()
        if self._error is not None:
            raise self._error


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


class StageRuntime:
    def __init__(self, plan: Plan, cfg, index: int, device: int, rank_of: dict[int, int], groups: dict,
                 torch_device: torch.device, seed: int, tracker, dtype: torch.dtype = torch.float32, d2d=None,
                 nvme_dir: str | None = None, record_window: bool = False):
        """``d2d``: this rank's executor.d2d.D2DClient when the plan d2d-swaps (None: d2d layers
        swap to host, as a stage run alone must). ``nvme_dir``: where a window's NVMe state files
        go (default: the system's temporary directory); ``record_window``: keep the window's
        (event, layer, microbatch) list (executor.window)."""
        st = plan.stages[index]
        self.plan, self.cfg, self.index, self.stage, self.device = plan, cfg, index, st, device
        self.rank_of, self.torch_device, self.tracker, self.dtype = rank_of, torch_device, tracker, dtype
        self.replica, self.tp_rank = coords(st, device)
        self.rows = replica_rows(plan, st, self.replica)
        self.first, self.last = index == 0, index == len(plan.stages) - 1
        self.m = plan.training.microbatches
        self.dp_group = groups.get(("dp", index, self.tp_rank))
        self.tp_group = groups.get(("tp", index, self.replica))
        # a window's streamed layers are built in host memory (executor.window takes them from there)
        self.layers = build_layers(cfg, st.layers, torch_device, seed, dtype, rows=self.rows[1] - self.rows[0],
                                   host=frozenset(st.streamed_layers))
        # a user's own model (executor.user_model): any pytree crosses a boundary, one message per
        # leaf; tied weights on other stages/ranks get summed gradients (one TiedGrads per rank)
        self.bounds = self.ties = None
        if cfg.family == "torch_module":
            b = user_model.boundaries(cfg, seed)
            self.bounds = {"act_in": b[st.layer_start - 1] if index else None, "act_out": b[st.layer_stop - 1]}
            self.leaf_tag_stride = 2 * len(plan.stages) * self.m  # message_tag's range
            self.ties = groups.setdefault("tied_grads", user_model.TiedGrads(cfg, groups, seed))
            self.ties.add(self.layers, st.dp)
        # (index, module, memory action) per layer, looked up once per microbatch variant rather
        # than per microbatch (an action with microbatch_period n applies to every n-th microbatch)
        self._run_as: dict[int, list] = {}  # k mod the periods' lcm -> its list
        self._period = math.lcm(*(item.microbatch_period for item in st.memory)) if st.memory else 1
        # a MAP stage (st.sharding) runs its planned per-operator layouts on one DeviceMesh
        # (executor.map_exec; its parameters become DTensor shards here); plain tp > 1 is Megatron's
        self.map = None
        if st.sharding:
            from executor.map_stage import MapStage

            self.map = MapStage(plan, cfg, index, self.layers, rank_of, groups, torch_device.type, dtype)
        self.vocab_parallel = st.tp > 1 and not st.sharding and tensor_parallel(self.layers, self.tp_group,
                                                                                 torch_device.type)
        self.tied = tied_embedding_weight(self, groups)
        # distinct parameters: a tied LM head shares the embedding's weight (one grad, one step).
        # With a STRONGHOLD window only the resident layers' (executor.window has the others)
        streamed = set(st.streamed_layers)
        self.params = list({id(p): p for i, _, mod in self.layers if i not in streamed
                            for p in mod.parameters()}.values())
        if streamed:
            self._check_streamable(streamed)
        for p in self.params:  # gradients live for the whole run (a Megatron-style grad buffer)
            p.grad = torch.zeros_like(p)
        opt = plan.training.optimizer

        def make_optimizer(params):
            if opt is Optimizer.adam:
                # fused: one kernel updates every tensor in place, no temporaries (as Megatron's fused
                # Adam); the default foreach/for-loop Adam allocates about the parameters' size again
                # during the step, a peak the memory model (16 B/param) does not have. One param group
                # per tensor type: a fused call refuses a mix of DTensors (TP-sharded) and plain tensors
                kinds: dict[type, list] = {}
                for p in params:
                    kinds.setdefault(type(p.data), []).append(p)
                return torch.optim.Adam([{"params": ps} for ps in kinds.values()], lr=LR[opt], fused=True)
            return torch.optim.SGD(params, lr=LR[opt], momentum=0.9)

        # MPress optimizer swap: the state lives on the host, the step streams it per layer
        self.opt_swap = (OptimizerSwap(self.layers, make_optimizer, tracker, torch_device)
                         if st.offload.optimizer_swap else None)
        self.optimizer = make_optimizer(self.params) if self.opt_swap is None and self.params else None
        # STRONGHOLD §III-C: streamed layers pass through w device slots; host state, CPU steps
        self.window = (Window([(i, mod) for i, _, mod in self.layers], st.streamed_layers, st.offload.window_layers,
                              self.m, torch_device, make_optimizer, dtype, nvme=st.offload.nvme, nvme_dir=nvme_dir,
                              tracker=lambda: self.tracker, record=record_window)
                       if streamed else None)
        # the loss of a replica's rows, scaled so that all replicas and microbatches sum to the
        # global mean: every gradient is then d(global loss), and DP all-reduce is a plain SUM
        self.loss_scale = 1.0 / (self.m * st.dp)
        self.loss_sum = 0.0
        self.inputs: dict[int, torch.Tensor | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Megatron's deallocate_output_tensor (training.deallocate_pipeline_outputs): a sent output
        # keeps only its autograd node; its storage goes once the send is done (boundary.release).
        # Every output of a non-last stage is sent before its backward, so all of them are released
        self.release_outputs = plan.training.deallocate_pipeline_outputs and not self.last
        self.sends = SendReaper()
        self.in_routes = routes(plan, index - 1, index) if not self.first else []
        self.out_routes = routes(plan, index, index + 1) if not self.last else []
        self.grad_in_routes = routes(plan, index + 1, index) if not self.last else []
        self.grad_out_routes = routes(plan, index, index - 1) if not self.first else []
        # after TP: the swapper records the (local) parameter storages it must never move
        self.swapper = Swapper(self, d2d) if any(item.action in SWAPS for item in st.memory) else None

    def _check_streamable(self, streamed: set[int]) -> None:
        """A streamed parameter must belong to its layer alone: its home is one layer's slot and
        host buffer (a tied embedding/head, or a user model's tie, must be resident)."""
        owners: dict[int, set[int]] = {}
        for i, _, mod in self.layers:
            for p in mod.parameters():
                owners.setdefault(id(p), set()).add(i)
        tied = {id(self.tied[0])} if self.tied is not None else set()
        if self.ties is not None:
            tied |= {id(p) for copies in self.ties.copies.values() for p, _ in copies}
        for i, _, mod in self.layers:
            if i in streamed and any(len(owners[id(p)]) > 1 or id(p) in tied for p in mod.parameters()):
                raise ValueError(f"stages[{self.index}].offload.resident_layers: layer {i} shares a parameter "
                                 "with another layer (tied weights); a window streams it from one layer's "
                                 "slot, so list it as resident")

    def named_state(self):
        """(``layer.param`` name, weight, gradient) of every parameter of the stage, wherever
        they live (a streamed layer's are its host master copy and accumulator)."""
        for _, name, mod in self.layers:
            for pname, p in mod.named_parameters():
                host = self.window.host_state(p) if self.window is not None else None
                yield (f"{name}.{pname}", *(host if host is not None else (p, p.grad)))

    # ---- compute ---------------------------------------------------------------------------------
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
        return {key: v.clone().to(self.torch_device)
                for key, v in user_model.microbatch(batch, lo, hi).items() if key in need}

    def run_as(self, k: int) -> list:
        """(global layer index, module, memory action) of each layer for microbatch ``k``."""
        found = self._run_as.get(k % self._period)
        if found is None:
            variant = stage_for_microbatch(self.stage, k)
            found = self._run_as[k % self._period] = [(i, mod, variant.action_of(i).action) for i, _, mod in self.layers]
        return found

    def forward(self, k: int, x: torch.Tensor | None, batch: dict) -> None:
        mb = self._microbatch(batch, k)
        if isinstance(x, torch.Tensor):  # a pytree boundary comes with requires_grad set (user_model.assemble)
            x.requires_grad_(True)
        self.inputs[k] = x
        if self.swapper is not None:
            self.swapper.begin_forward(k, x)
        with self.window.pass_("F", k) if self.window is not None else contextlib.nullcontext():
            y = self._layers_forward(k, x, mb)
        if self.last:
            self.loss_sum += float(y.detach()) * self.loss_scale
            y = y * self.loss_scale
        self.outputs[k] = y

    def _layers_forward(self, k: int, y, mb: dict):
        if self.map is not None:  # MAP: rotor's checkpoint segments over DTensor layers (executor.map_exec)
            return self.map.forward(y, mb)
        for i, mod, action in self.run_as(k):
            if self.window is not None and self.window.streams(i):  # executor.window
                recompute = action is MemoryAction.recompute
                y = self.window.forward_layer(
                    i, (lambda y=y, mod=mod: checkpoint(mod, y, mb, use_reentrant=False)) if recompute
                    else (lambda y=y, mod=mod: mod(y, mb)), recompute)
            elif action is MemoryAction.recompute:
                y = checkpoint(mod, y, mb, use_reentrant=False)
            elif action in SWAPS:  # saved tensors leave the device at the layer's end (executor.swap)
                with self.swapper.layer(k, i):
                    y = mod(y, mb)
            else:
                y = mod(y, mb)
        return y

    def swap_in(self, k: int) -> None:
        """The schedule's ``swap_in`` entries: prefetch microbatch ``k``'s first swapped layer."""
        if self.swapper is not None:
            self.swapper.swap_in(k)

    def backward(self, k: int, grad: torch.Tensor | None) -> None:
        y = self.outputs.pop(k)
        if self.swapper is not None:
            self.swapper.begin_backward(k)
        with self.window.pass_("B", k) if self.window is not None else contextlib.nullcontext():
            self._run_backward(y, grad)
        if self.swapper is not None:
            self.swapper.end_backward(k)
        for p in self.params:  # accumulation may have replaced a grad tensor: keep it filed
            self.tracker.tag(p.grad, "gradients")
        x = self.inputs.pop(k)
        if self.bounds is not None:
            self.grad_to_send = user_model.input_grads(x) if x is not None else None
        else:
            self.grad_to_send = x.grad if x is not None else None

    def _run_backward(self, y, grad) -> None:
        if self.last:
            with _loss_context(self.vocab_parallel):
                y.backward()
        elif self.bounds is not None:
            user_model.backward(y, grad, self.release_outputs)
        elif self.release_outputs:
            run_backward([y], [grad])
        else:
            y.backward(grad)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad.zero_()
        if self.window is not None:
            self.window.zero_grad()
        self.loss_sum = 0.0
        if self.ties is not None:
            self.ties.reset()

    def allreduce_grads(self) -> None:
        """One SUM all-reduce of the stage's flattened gradients over its replicas (one bucket, as
        the simulator charges one ring all-reduce per stage; per-tensor calls cost gloo ~0.6 ms
        of latency each on local_cpu). Tied weights of a user model are summed over their copies
        first (user_model.TiedGrads; once per rank and iteration)."""
        if self.ties is not None:
            with self.tracker.phase("buffers"):
                self.ties.sync()
        if self.dp_group is None:
            return
        local = [getattr(p.grad, "_local_tensor", p.grad) for p in self.params]
        with self.tracker.phase("buffers"):
            flat = torch.cat([g.reshape(-1) for g in local])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
            offset = 0
            for g in local:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        del flat

    def allreduce_embedding_grads(self) -> None:
        """Megatron's embedding group (Narayanan et al. 2021; ``_allreduce_word_embedding_grads``
        after the data-parallel sync): the first stage's word embedding and the last stage's
        head copy get the sum of both gradients, so the two copies stay equal. After the DP
        all-reduce every rank of a stage holds its stage's whole gradient (TP shards gathered
        here), so one rank per stage contributes it and the others zeros: the sum is exactly
        embedding grad + head grad, as one process accumulates it."""
        if self.tied is None:
            return
        param, group = self.tied
        g = param.grad
        local = getattr(g, "_local_tensor", g)
        with self.tracker.phase("buffers"):
            full = g.full_tensor() if hasattr(g, "full_tensor") else local.clone()
            if self.replica or self.tp_rank:
                full.zero_()
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
            if self.map is not None:  # a MAP layout: this rank's shard of it (a local split, no communication)
                from torch.distributed.tensor import distribute_tensor

                local.copy_(distribute_tensor(full, g.device_mesh, g.placements, src_data_rank=None).to_local())
            else:
                local.copy_(torch.chunk(full, self.stage.tp, dim=0)[self.tp_rank] if self.stage.tp > 1 else full)
        del full

    def step(self) -> None:
        if self.window is not None:  # the streamed layers' CPU steps (overlapped with the backward)
            self.window.step()
        if self.opt_swap is not None:
            self.opt_swap.step()
            return
        if self.optimizer is None:  # every layer streamed: nothing on the device to step
            return
        with self.tracker.phase("optimizer"):
            self.optimizer.step()
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.tracker.tag(v, "optimizer")

    # ---- boundary communication --------------------------------------------------------------------
    def send(self, kind: str, k: int, tensor: torch.Tensor, on_done=None) -> None:
        """isend the boundary tensor's pieces; ``on_done()`` once each piece's send completed."""
        table = self.out_routes if kind == "act" else self.grad_out_routes
        tag = message_tag(kind, self.index, k, self.m)
        with self.tracker.phase("buffers"):
            for r in table:
                if r.src_device == self.device:
                    lo = self.rows[0]  # the tensor holds this replica's rows only
                    if self.bounds is not None:  # a pytree: one message per leaf, tags kept apart
                        bound = self.bounds["act_out" if kind == "act" else "act_in"]
                        for j, piece in enumerate(user_model.send_pieces(tensor, bound, kind, r.start - lo, r.stop - lo)):
                            work = dist.isend(piece, dst=self.rank_of[r.dst_device], tag=tag + j * self.leaf_tag_stride)
                            self.sends.add(work, piece, on_done)
                        continue
                    piece = tensor.detach()[r.start - lo:r.stop - lo].contiguous()
                    work = dist.isend(piece, dst=self.rank_of[r.dst_device], tag=tag)
                    self.sends.add(work, piece, on_done)
        self.release_output(kind, k, tensor)  # the pieces above keep the storage until sent

    def release_output(self, kind: str, k: int, tensor) -> None:
        """After sending microbatch ``k``'s output: keep only what its backward needs."""
        if kind == "act" and self.release_outputs:
            self.outputs[k] = release(tensor)

    def post_recv(self, kind: str, k: int, peer: int, tail: tuple[int, ...]) -> list:
        """Post the receives of a boundary tensor (``irecv`` into fresh buffers); returns the
        handles for :meth:`wait_recv`. Posted before the data is needed (the worker does so in
        timed gloo iterations), the message arrives while the rank computes; a blocking ``recv``
        at the point of use pays its whole latency on the critical path (issue #10: on pp2 1F1B
        the blocked recv was the largest single item of an iteration, ~25 %)."""
        table = self.in_routes if kind == "act" else self.grad_in_routes
        tag = message_tag(kind, peer, k, self.m)
        posted = []
        with self.tracker.phase("buffers"):
            for r in table:
                if r.dst_device == self.device and self.bounds is not None:  # a pytree: a buffer per leaf
                    posted = user_model.Posted(posted, kind=kind, boundary=self.bounds["act_in" if kind == "act" else "act_out"])
                    bufs = user_model.recv_buffers(posted.boundary, kind, r.stop - r.start, self.torch_device, self.dtype)
                    posted.append(([dist.irecv(b, src=self.rank_of[r.src_device], tag=tag + j * self.leaf_tag_stride)
                                    for j, b in enumerate(bufs)], bufs))
                elif r.dst_device == self.device:
                    buf = torch.empty((r.stop - r.start, *tail), device=self.torch_device, dtype=self.dtype)
                    posted.append((dist.irecv(buf, src=self.rank_of[r.src_device], tag=tag), buf))
        return posted

    def wait_recv(self, posted: list) -> torch.Tensor:
        """The boundary tensor of :meth:`post_recv`'s handles, once every piece has arrived."""
        if isinstance(posted, user_model.Posted):
            for works, _ in posted:
                for work in works:
                    work.wait()
            with self.tracker.phase("buffers"):
                return user_model.assemble(posted.boundary, posted.kind, [bufs for _, bufs in posted])
        for work, _ in posted:
            work.wait()
        if len(posted) == 1:
            return posted[0][1]
        with self.tracker.phase("buffers"):
            return torch.cat([buf for _, buf in posted])

    def recv(self, kind: str, k: int, peer: int, tail: tuple[int, ...]) -> torch.Tensor:
        return self.wait_recv(self.post_recv(kind, k, peer, tail))

    def wait_sends(self) -> None:
        self.sends.drain()
        if self.swapper is not None and self.swapper.d2d is not None:
            self.swapper.d2d.reaper.drain()
