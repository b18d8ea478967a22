"""One stage of the plan as one rank holds it: its layers (TP-sharded if tp > 1), its optimizer,
the microbatches in flight, and the boundary sends/receives with resharding between meshes.

StageRuntime builds the stage here; what it does is in its mixins: the forward/backward passes
and memory actions (executor.stage_passes), the gradient sync and optimizer step
(executor.stage_grads) and the boundary communication (executor.stage_comm)."""
from __future__ import annotations

import math

import torch

from executor import user_model
from executor.megatron_tp import boundary_split, tensor_parallel
from executor.models import build_layers
from executor.optim_swap import OptimizerSwap
from executor.stage_comm import SendReaper, StageComm
from executor.stage_grads import StageGrads, tied_embedding_weight
from executor.stage_passes import SWAPS, StagePasses
from executor.swap import Swapper
from executor.timeline import NO_STAMPS, Stamps
from executor.window import Window
from costs.buffers import p2p_split
from executor.topology import mesh_coords, replica_rows, routes
from specs.plan import SPLIT_BACKWARD, V_SHAPED, Plan, ScheduleKind
from specs.training import Optimizer

LR = {Optimizer.adam: 1e-3, Optimizer.sgd: 1e-2}


class StageRuntime(StagePasses, StageGrads, StageComm):
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
        self.nvme_dir = nvme_dir  # ZeRO-Offload's NVMe state files too (executor.zero_offload, via stage_grads)
        # (replica, cp rank, tp rank); cp > 1: this rank holds its cp rank's sequence positions of
        # its replica's rows (executor.ring_attention.cp_positions)
        self.replica, self.cp_rank, self.tp_rank = mesh_coords(st, device)
        self.rows = replica_rows(plan, st, self.replica)
        self.first, self.last = index == 0, index == len(plan.stages) - 1
        self.m = plan.training.microbatches
        self.dp_group = groups.get(("dp", index, self.tp_rank))
        self.tp_group = groups.get(("tp", index, self.replica * st.cp + self.cp_rank))
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
        # sequence-parallel neighbours pass s/t shards across the boundary (executor.stage_comm.post_recv)
        self.split_in = index > 0 and boundary_split(plan, index - 1, index)
        self.split_out = not self.last and boundary_split(plan, index, index + 1)
        # Narayanan et al. SC'21 §4.1: a boundary scattered over the tp ranks, 1/t each, all-gathered
        # by the receivers (plan.p2p_scatter_gather; costs.buffers.p2p_split, the simulator's rule)
        self.scatter_in = p2p_split(plan, plan.stages[index - 1], st) if index > 0 else 1
        self.scatter_out = p2p_split(plan, st, plan.stages[index + 1]) if not self.last else 1
        # ZeRO-3 with tp > 1: torchtitan's 2-D [dp, tp] mesh, TP on its tp axis here, FSDP2 on its dp
        # axis below (executor.fsdp.stage_mesh)
        self.mesh_2d = None
        if st.tp > 1 and not st.sharding and self.dp_group is not None and plan.zero_stage >= 3:
            from executor.fsdp import stage_mesh

            self.mesh_2d = stage_mesh(st, rank_of, self.dp_group, self.tp_group, torch_device.type)
        self.vocab_parallel = st.tp > 1 and not st.sharding and tensor_parallel(
            self.layers, self.tp_group, torch_device.type, sequence_parallel=st.sequence_parallel,
            split_in=self.split_in, split_out=self.split_out,
            mesh=self.mesh_2d["tp"] if self.mesh_2d is not None else None)
        # context parallelism (executor.context_parallel): attention as a ring over the stage's cp
        # ranks, position tables at this cp rank's positions, which _microbatch's columns follow
        self.positions = None
        if st.cp > 1:
            from executor.context_parallel import apply as context_parallel

            context_parallel(self)
        # a V placement (zbv, dualpipev) puts the first and last chunk on one rank: one shared embedding/head
        borrowed = None
        if plan.schedule.kind in V_SHAPED:
            from executor.split_backward import share_tied_embedding

            borrowed = share_tied_embedding(self, groups)
        self.tied = tied_embedding_weight(self, groups) if borrowed is None else None
        # ZeRO-3 with torch's FSDP2 (executor.fsdp): sharded DTensor parameters; ZeRO-2: executor.zero2 below
        self.fsdp = None
        if self.dp_group is not None and plan.zero_stage >= 3:
            from executor.fsdp import Fsdp

            self.fsdp = Fsdp(self, reshard_after_forward=True)
        # distinct parameters: a tied LM head shares the embedding's weight (one grad, one step).
        # With a STRONGHOLD window only the resident layers' (executor.window has the others)
        # A weight-swapped layer's (MPress §II-D) are homed on the host too (executor.weight_swap)
        streamed = set(st.streamed_layers)
        homed = streamed | set(st.offload.weight_swap_layers)
        self.params = list({id(p): p for i, _, mod in self.layers if i not in homed
                            for p in mod.parameters() if id(p) not in (borrowed or ())}.values())
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
        self.opt_swap = (OptimizerSwap([t for t in self.layers if t[0] not in homed], make_optimizer, tracker,
                                       torch_device)
                         if st.offload.optimizer_swap else None)
        # Megatron's distributed optimizer (ZeRO-1) / bucketed overlapped dp reduction (executor.zero1):
        # flat parameter and gradient buffers per bucket; with ZeRO-1 the optimizer steps this rank's shards
        self.zero1 = self.fsdp  # FSDP2 has Zero1's interface: its own reduction, the stage's step
        if self.fsdp is None and self.dp_group is not None and self.params and plan.zero_stage == 2:
            from executor.zero2 import Zero2  # Zero1's buckets without the whole gradient buffer

            self.zero1 = Zero2(self, plan.overlap_param_gather)
        elif self.fsdp is None and self.dp_group is not None and self.params and (plan.zero_stage == 1
                                                                                   or plan.overlap_grad_reduce):
            from executor.zero1 import Zero1

            self.zero1 = Zero1(self, plan.zero_stage == 1, plan.overlap_grad_reduce, plan.overlap_param_gather)
        sharded_opt = self.zero1 is not None and self.zero1.shard
        self.optimizer = (make_optimizer(self.zero1.masters) if sharded_opt else
                          make_optimizer(self.params) if self.opt_swap is None and self.params else None)
        # STRONGHOLD §III-C: streamed layers pass through w device slots; host state, CPU steps.
        # §IV-A: S workers share the window, one group pass per S microbatches (executor.window_streams)
        self.streams = st.offload.streams if streamed else 1
        self.window = (Window([(i, mod) for i, _, mod in self.layers], st.streamed_layers, st.offload.window_layers,
                              self.m // self.streams, torch_device, make_optimizer, dtype, nvme=st.offload.nvme,
                              nvme_dir=nvme_dir, tracker=lambda: self.tracker, record=record_window,
                              dp_group=self.dp_group, streams=self.streams)
                       if streamed else None)
        self.workers = None
        if self.streams > 1:
            from executor.preflight import streams_unsupported
            from executor.window_streams import Workers

            problems = streams_unsupported(plan)
            if problems:
                raise ValueError("; ".join(problems))
            self.workers = Workers(self.streams, self.window, torch.get_num_threads(), self.window.worker_streams)
            self.window.gate_resident(self.params)
        # MPress §II-D: listed layers' live weights, gradients and optimizer state in host memory,
        # fetched for each pass, stepped by the CPU (executor.weight_swap)
        self.weight_swap = None
        if st.offload.weight_swap_layers:
            from executor.weight_swap import WeightSwap

            self.weight_swap = WeightSwap(self, st.offload.weight_swap_layers, make_optimizer, dtype,
                                          record=record_window)
        # the loss of a replica's rows, scaled so that all replicas and microbatches sum to the
        # global mean: every gradient is then d(global loss), and DP all-reduce is a plain SUM
        self.loss_scale = 1.0 / (self.m * st.dp * st.cp)  # cp ranks: equal token counts, summed too
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
        self.d2d = d2d  # executor.pipedream sends stashed versions to peers with it (offload.stash_targets)
        self.swapper = Swapper(self, d2d) if any(item.action in SWAPS for item in st.memory) else None
        # PipeDream: an update after every backward, weight versions stashed (executor.pipedream);
        # each microbatch's gradient is that of its own mean loss (it is PipeDream's minibatch):
        # a replica's rows scaled by 1/dp, so its replicas' SUM all-reduce is that gradient
        self.pipedream = None
        if plan.schedule.kind is ScheduleKind.pipedream_async:
            from executor.pipedream import PipeDreamStash

            self.pipedream = PipeDreamStash(self)
            self.loss_scale = 1.0 / st.dp
            if self.swapper is not None and self.pipedream.swap_slots:
                self.swapper.param_pack = self.pipedream.pack
        ws = self.weight_swap
        if ws is not None:  # its saved-weight hooks hand the rest to PipeDream's; the swapper's to its
            if self.pipedream is not None and self.pipedream.swap_slots:
                ws.fallback_pack, ws.fallback_unpack = self.pipedream.pack, self.pipedream.unpack
            if self.swapper is not None:
                ws.swapper = self.swapper
                self.swapper.param_pack = lambda t, prev=self.swapper.param_pack: ws.pack_or(t, prev)
        # zero-bubble schedules: backward actions are B, backward_weight actions W (executor.split_backward;
        # schedule.weight_store: the paper's WeightGradStore, executor.weight_store)
        self.split = None
        if plan.schedule.kind in SPLIT_BACKWARD and plan.schedule.weight_store:
            from executor.weight_store import WeightStore

            self.split = WeightStore(self)
        elif plan.schedule.kind in SPLIT_BACKWARD:
            from executor.split_backward import SplitBackward

            self.split = SplitBackward(self)

    def set_stamps(self, rec, event=None) -> None:
        """Host traffic of this iteration (a window's and a weight swap's fetches, gradient copies
        and CPU steps) goes to ``rec`` (an executor.timeline.Recorder; None: nowhere); ``event``:
        CUDA's timing-event factory (executor.timeline.Stamps)."""
        stamps = Stamps(rec, self.index, event) if rec is not None else NO_STAMPS
        for part in (self.window, self.weight_swap):
            if part is not None:
                part.rec = stamps

    def finish_host(self) -> None:
        """Wait for the host work still running after an iteration: a window's CPU steps and
        gradient copies (STRONGHOLD eq. 3 lets them run into the next iteration) and a weight
        swap's; the run's end, before its report (and the timelines they stamp) is read."""
        if self.window is not None:
            self.window.finish()
        if self.weight_swap is not None:
            self.weight_swap.finish()
        if self.zero1 is not None:  # overlap_param_gather: the last step's all-gathers
            self.zero1.finish()

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
        they live (a streamed or weight-swapped layer's are its host master copy and accumulator)."""
        for _, name, mod in self.layers:
            for pname, p in mod.named_parameters():
                host = self.window.host_state(p) if self.window is not None else None
                if host is None and self.weight_swap is not None:
                    host = self.weight_swap.host_state(p)
                yield (f"{name}.{pname}", *(host if host is not None else (p, p.grad)))
