"""PipeDream's asynchronous 1F1B with weight stashing (Narayanan et al., SOSP'19 §3.3; MPress
§II-B/C runs Bert on it), for a stage of ``schedule.kind = pipedream_async``.

* **Updates.** After every backward the stage steps its optimizer with that microbatch's gradient
  alone (no accumulation: each microbatch is PipeDream's minibatch; its loss is not scaled by
  1/m). The iteration's closing optimizer entry steps nothing more.
* **Replicated stages** (PipeDream §3.1: a stage may run on several workers, each a share of
  the microbatch's rows): before each update the replicas SUM-all-reduce that microbatch's
  gradients (one flat bucket, executor.stage_grads ``allreduce_dp``; the loss of a replica's rows
  is scaled by 1/dp, so the sum is the microbatch's mean-loss gradient), then each applies the
  same update: replicas stay bit-identical, each stashes its own versions.
* **Stashing.** The forward of microbatch k uses the live weights; its backward computes the
  gradient with exactly those weights (the stashed version), and the update is applied to the
  then-live weights. A parameter that an in-flight microbatch's graph still holds is updated out
  of place: a new ``nn.Parameter`` takes its slot in the modules and the optimizer (its state is
  re-keyed), the old one lives on only through the graphs (and :attr:`PipeDreamStash.used`) that
  need it and is filed ``stashed`` with the memory tracker; a parameter no graph holds is stepped
  in place. So stage i holds one version per in-flight microbatch (p - i at most), as
  simulator/stash.py counts them. Why not torch.func.functional_call over per-version leaves: the
  modules' own attributes must hold the version a backward uses, because a recomputed layer
  (torch.utils.checkpoint) re-runs the module as it is at backward time; so the backward of k
  installs k's version in the modules and restores the live one after.
* **Tied embedding over two stages** (Megatron's shared input/output embedding, stage 0 and the
  last stage): both copies apply the same updates, update k with the summed gradient
  g_first(k) + g_last(k). The last stage sends g_last(k) after its backward k; stage 0 adds it,
  steps, and sends the sum back. The last stage applies tied update k just before its forward of
  microbatch k + p (stage 0's backward k precedes its forward k + p, so the sum is on its way:
  no stall), and the ones left at the iteration's end. Replicated stages: replica r of stage 0
  pairs with replica r of the last stage (equal dp, executor.measure), each message after both
  sides' DP all-reduce, so every pair sums the same replica-complete gradients. Both copies
  then have version max(0, j - p + 1) at forward j (stage 0 has run j - p + 1 backwards by
  then), the version the float64 reference (executor.reference.train_reference_pipedream) gives
  both.
* **Tensor-parallel stages** (Megatron TP, executor.megatron_tp: DTensor parameters): each tp
  rank updates its own shard after every backward. The TP collectives inside the layers already
  make every rank's gradient exact (Shoeybi et al. 2019 §3: the column-parallel input's backward
  all-reduces, a row-parallel output's forward does), so there is no extra reduction: a sharded
  weight's gradient is its shard's, a replicated one's (LayerNorm, a row-parallel bias) is the
  same on every tp rank, and the copies stay bit-identical. A stale version is a DTensor of the
  live one's mesh and placements (``old.detach().clone()`` keeps both); whatever moves bytes (the
  host copy, the peers' stripes, the tied-gradient messages) moves the rank's local shard. The
  tied embedding/head is vocab-parallel on both stages (the embedding row-, the decoder
  column-parallel: the same rows per tp rank), so tp rank t of stage 0 pairs with tp rank t of the
  last stage (equal tp, executor.measure).
* **Stashed versions in host memory** (``offload.stash_swap_layers``, MPress §II-D): a listed
  layer's parameter that goes stale is copied to host memory and its device storage released
  (the graphs hold it through :class:`_ParamView` handles, not views of its storage: see
  :meth:`PipeDreamStash.pack`); it comes back before the backward that needs it. CUDA: pinned
  host buffers, both copies on a side stream (the allocator keeps a released storage until its
  copy is done: ``record_stream``), a backward waits only for its own version's copy (an event).
* **Stashed versions on peers** (``offload.stash_targets``, MPress §III-C): instead of the host
  copy, the stale parameters' storages are striped over the target ranks (executor.d2d: one
  message per version, sent when the update makes it stale, over the pair's stash group; the
  stripes are views of the storages, held by the sends until done, then the device storage goes),
  and one request per backward that needs the version fetches the stripes into a fresh device
  buffer at the same points as the host copy (one pass ahead); the backward waits for them. The
  targets replay this class's rule (executor.d2d.stash_events) to know what comes when. A version
  only the next backward needs stays on the device (no round trip), as simulator/stash.py does.
  Needs the rank's executor.d2d.D2DClient as ``StageRuntime.d2d``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

#: p2p tags of the tied-gradient messages (their own process group: no clash with boundaries)
_TO_FIRST, _TO_LAST = 0, 1 << 20


def _local(t):
    """The rank's local tensor of a DTensor (its shard or replica), else ``t`` itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class _ParamView:
    """A saved tensor that is (a view of) a stash-swapped layer's parameter: the parameter object
    and the view's geometry. Unpacked from the parameter's data as it is then (back on the device
    for the backward), so the graph never pins the device storage of a stale version."""

    __slots__ = ("param", "offset", "size", "stride", "dtensor")

    def __init__(self, param, t: torch.Tensor):
        local = _local(t)
        self.param, self.offset, self.size, self.stride = param, local.storage_offset(), local.size(), local.stride()
        # a DTensor (a tp stage's saved weight): its mesh, placements and global geometry
        self.dtensor = ((t.device_mesh, t.placements, t.size(), t.stride()) if local is not t else None)

    def unpack(self) -> torch.Tensor:
        local = _local(self.param).detach().as_strided(self.size, self.stride, self.offset)
        if self.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class PipeDreamStash:
    def __init__(self, st):
        """``st``: the executor.stage.StageRuntime (its layers, params, optimizer(s), tracker)."""
        self.st = st
        self.p = st.plan.pipeline_depth
        # every place a parameter sits in the modules: (module, attribute) per distinct parameter
        self.slots: dict[int, list] = {}
        for _, _, mod in st.layers:
            for sub in mod.modules():
                for name, param in sub._parameters.items():
                    if param is not None:
                        self.slots.setdefault(id(param), []).append((sub, name))
        self.live: list = list(st.params)
        self.bufs = [p.grad for p in self.live]  # one gradient buffer per slot, for the whole run
        layer_of: dict[int, int] = {}  # a tied parameter belongs to its first layer
        for i, _, mod in st.layers:
            for param in mod.parameters():
                layer_of.setdefault(id(param), i)
        swapped = set(st.stage.offload.stash_swap_layers)
        self.swap_slots = {j for j, p in enumerate(self.live) if layer_of.get(id(p)) in swapped}
        self.used: dict[int, list] = {}  # in-flight microbatch -> the parameters its forward used
        self.swap_ptrs: dict[int, torch.nn.Parameter] = {}
        self.swap_base = (st.swapper.params - {_local(p).untyped_storage().data_ptr() for p in self.live}
                          if st.swapper is not None else set())  # the modules' buffers
        self.on_host: dict[int, torch.Tensor] = {}  # id(stale parameter) -> its host copy
        # D2D to peers instead (offload.stash_targets): (device, weight) per target; per stale
        # parameter on the peers its version number (executor.d2d.stash_code) and geometry
        self.peers = [(t.device, t.weight) for t in st.stage.offload.stash_targets]
        self.on_peer: dict[int, tuple[int, torch.Size]] = {}
        self.peer_works: dict[int, list] = {}  # id(parameter) -> the stripe receives of its fetch
        self.updates = 0  # updates this iteration: the number of the live version
        self.client = None
        if self.peers and self.swap_slots:
            self.client = getattr(st, "d2d", None) or getattr(st.swapper, "d2d", None)
            if self.client is None and not hasattr(st, "d2d"):
                raise RuntimeError(f"stage {st.index}: offload.stash_targets needs the rank's d2d client "
                                   "(executor.d2d.D2DClient as StageRuntime.d2d)")
            # None: a stage run alone (executor.single), its peers not here: to host memory, as
            # its d2d_swap layers go (the stage's own device memory falls alike)
        # CUDA: the versions' copies run on a side stream (pinned buffers), as executor.swap's do,
        # so an update and a backward do not wait for PCIe; a fetched version's backward waits on
        # its copy's event (``ready``)
        cuda = st.torch_device.type == "cuda" and bool(self.swap_slots)
        self.side = torch.cuda.Stream(st.torch_device) if cuda else None
        self.ready: dict[int, torch.cuda.Event] = {}
        tied = st.tied  # (parameter, group) across two stages, or None
        self.tied_slot = next(j for j, p in enumerate(self.live) if p is tied[0]) if tied is not None else None
        self.group = tied[1] if tied is not None else None
        self.peer = None
        if tied is not None:
            first, last = st.plan.stages[0], st.plan.stages[-1]
            other = last if st.first else first
            if (first.dp, first.tp) != (last.dp, last.tp):
                raise ValueError(f"schedule pipedream_async: a tied embedding/head over stages of (dp, tp) "
                                 f"{(first.dp, first.tp)} and {(last.dp, last.tp)} (replica r, tp rank t of the "
                                 "first stage pairs with replica r, tp rank t of the last)")
            self.peer = st.rank_of[other.devices[st.replica * other.tp + st.tp_rank]]
        self.sends: list = []
        # this stage's passes in order ("F"/"B", microbatch): the prefetch looks one pass ahead
        from specs.schedule import ActionKind, position_schedule

        self.order = [("F" if a.kind is ActionKind.forward else "B", a.microbatch)
                      for a in position_schedule(st.plan, st.index)
                      if a.kind in (ActionKind.forward, ActionKind.backward)]
        self.pass_i = -1
        self.awaiting: int | None = None  # next pass's backward, whose version is still live
        self.pending: list[int] = []  # backwards whose update has not run yet
        self.tied_done = 0  # last stage: tied updates applied this iteration
        self.iteration_forwards = 0

    # ---- forward ------------------------------------------------------------------------------
    def begin_forward(self, k: int) -> None:
        if self.tied_slot is not None and self.st.last:
            while self.tied_done <= k - self.p:  # tied update k - p before forward k (module doc)
                self._tied_update_last()
            self._reap(k - self.p)  # g_last(k - p) was taken by stage 0's update k - p by now
        self.used[k] = list(self.live)
        # the swapped slots' live storages, looked up by every saved tensor of this forward (pack)
        self.swap_ptrs = {_local(self.live[j]).untyped_storage().data_ptr(): self.live[j] for j in self.swap_slots}
        self._pass_start()

    def _reap(self, upto: int) -> None:
        """Let go of the tied messages numbered <= ``upto``: their receiver has taken them by now
        (the schedule orders it), so the wait returns at once. Deterministic, where polling
        gloo's completion would hold a message as long as the sender happens not to look; the
        simulator books the same holds (simulator/stash.py ``_tied_update``)."""
        keep = []
        for k, work, msg in self.sends:
            if k <= upto:
                work.wait()
            else:
                keep.append((k, work, msg))
        self.sends = keep

    def pack(self, t: torch.Tensor):
        """saved_tensors_hooks pack for a stage with stash-swapped layers: a saved tensor sharing a
        swapped slot's live storage becomes a :class:`_ParamView` (else ``t`` itself)."""
        local = _local(t)  # a tp stage saves DTensors: their local tensors share the storage
        if type(local) is torch.Tensor and local.layout is torch.strided:
            p = self.swap_ptrs.get(local.untyped_storage().data_ptr())
            if p is not None:
                return _ParamView(p, t)
        return t

    @staticmethod
    def unpack(saved):
        return saved.unpack() if isinstance(saved, _ParamView) else saved

    # ---- backward -----------------------------------------------------------------------------
    def begin_backward(self, k: int) -> None:
        """Install microbatch k's version in the modules (a recomputed layer re-runs with it), its
        host-resident parameters back on the device, and the gradient buffers, zeroed, on it."""
        self._pass_start()
        used = self.used[k]
        if self.client is not None:
            self._fetch_peer(self._stale_swapped(used))  # not prefetched (the pass before held it)
            self._wait_peer(used)
        for j, p in enumerate(used):
            self._fetch(p)  # not prefetched (the first backward of a run without a pass before it)
            self.bufs[j].zero_()
            p.grad = self.bufs[j]
            if p is not self.live[j]:
                self._install(self.live[j], p)
        if self.side is not None:
            self._wait_fetched(used)

    def end_backward(self, k: int) -> None:
        """Restore the live version; the update waits for :meth:`update` (after the gradient
        send, where simulator/walk.py ``_update`` steps)."""
        used = self.used.pop(k)
        held = {id(q) for ps in self.used.values() for q in ps}
        for j, p in enumerate(used):
            if p is not self.live[j]:
                p.grad = None
                self._install(p, self.live[j])
                if id(p) in self.on_host:  # a stash-swapped version: its device copy goes now
                    if id(p) in held:
                        self._drop(p)
                    else:
                        del self.on_host[id(p)]
                elif id(p) in self.on_peer:  # on the peers (they let it go after its last fetch)
                    if id(p) in held:
                        self._drop(p)
                    else:
                        del self.on_peer[id(p)]
        self.pending.append(k)

    def update(self) -> None:
        """PipeDream's update for the microbatch whose backward ended last (stage 0 right after
        it, the others after sending its input gradient)."""
        if not self.pending:
            return
        k = self.pending.pop(0)
        st = self.st
        st.allreduce_dp(self.bufs)  # replicas: the microbatch's gradient, summed over its rows' shares
        skip = set()
        if self.tied_slot is not None:
            j = self.tied_slot
            if st.last:  # g_last(k) to stage 0; the last stage's own tied update comes later
                with st.tracker.phase("buffers"):
                    msg = _local(self.bufs[j]).clone()
                self.sends.append((k, dist.isend(msg, self.peer, group=self.group, tag=_TO_FIRST + k), msg))
                skip.add(j)
            else:  # stage 0: g_first(k) + g_last(k), the sum back to the last stage
                self._reap(k - self.p)  # the last stage took sum(k - p) before its backward k
                with st.tracker.phase("buffers"):
                    other = torch.empty_like(_local(self.bufs[j]))
                dist.recv(other, self.peer, group=self.group, tag=_TO_FIRST + k)
                _local(self.bufs[j]).add_(other)
                other.copy_(_local(self.bufs[j]))
                self.sends.append((k, dist.isend(other, self.peer, group=self.group, tag=_TO_LAST + k), other))
        self._update(skip)

    # ---- the update ---------------------------------------------------------------------------
    def _update(self, skip: set[int], only: int | None = None) -> None:
        """Step the live parameters (all but ``skip``, or slot ``only``) with the gradient
        buffers. A parameter an in-flight graph holds is replaced first (out of place)."""
        st = self.st
        held = {id(p) for ps in self.used.values() for p in ps}
        slots = [only] if only is not None else [j for j in range(len(self.live)) if j not in skip]
        renamed = {}
        to_peer = []  # stale parameters of stash-swapped layers for the peers (offload.stash_targets)
        for j, old in enumerate(self.live):
            if j in slots and id(old) in held:
                with st.tracker.phase("parameters"):
                    new = torch.nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
                renamed[id(old)] = new
                self._install(old, new)
                self.live[j] = new
                st.tracker.tag(old, "stashed")
                if j in self.swap_slots and self.client is not None:
                    to_peer.append((j, old))
                elif j in self.swap_slots:
                    self._to_host(old)
                    if self.awaiting is None or self.used.get(self.awaiting, [None] * (j + 1))[j] is not old:
                        self._drop(old)  # (kept for a backward that is the next pass: no round trip)
        if only is None:
            if to_peer:
                self._to_peer(to_peer)
            self.updates += 1
        for j, p in enumerate(self.live):
            p.grad = self.bufs[j] if j in slots else None
        if renamed:
            self._rekey(renamed)
        st.params[:] = self.live
        st.step_optimizer()
        for j, p in enumerate(self.live):  # filed with the tracker as the stage's gradients
            p.grad = self.bufs[j]
        if renamed and st.swapper is not None:
            # the storages the swapper must never move: the live weights' (and the modules'
            # buffers), rebuilt rather than grown: a freed version's address is reused by
            # activations, which a stale entry would keep on the device
            st.swapper.params = self.swap_base | {_local(p).untyped_storage().data_ptr() for p in self.live}

    def _tied_update_last(self) -> None:
        """The last stage's tied update number ``tied_done``: stage 0's sum g_first + g_last."""
        j, k = self.tied_slot, self.tied_done
        with self.st.tracker.phase("buffers"):
            total = torch.empty_like(_local(self.bufs[j]))
        dist.recv(total, self.peer, group=self.group, tag=_TO_LAST + k)
        _local(self.bufs[j]).copy_(total)
        del total
        self._update(set(), only=j)
        self.tied_done += 1

    def end_iteration(self, m: int) -> None:
        """The last stage's tied updates still due; every tied message delivered."""
        self.update()
        if self.tied_slot is not None and self.st.last:
            while self.tied_done < m:
                self._tied_update_last()
            self.tied_done = 0
        self._reap(m)
        self.pass_i = -1
        self.updates = 0
        if self.client is not None:
            self.client.reaper.drain()  # every stripe sent (and its source storage let go)
        if self.st.last:  # the loss reported: each replica added its rows' mean loss / m
            self.st.loss_sum /= self.st.stage.dp  # (executor.stage_passes), the global mean over all

    def digest(self) -> str:
        """``<replicated>:<sharded>``: SHA-256 of the stage's live weights that every tp rank holds
        whole (plain tensors, Replicate-only DTensors), then of this rank's shards of the others, in
        order. Replicas of a stage must agree on both bit for bit, the tp ranks of a replica on the
        first (identical gradients keep their copies identical)."""
        import hashlib

        from torch.distributed.tensor import Replicate

        whole, shards = hashlib.sha256(), hashlib.sha256()
        for p in self.live:
            sharded = any(not isinstance(q, Replicate) for q in getattr(p, "placements", ()))
            (shards if sharded else whole).update(
                _local(p).detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        return f"{whole.hexdigest()}:{shards.hexdigest()}"

    def _install(self, old, new) -> None:
        for mod, name in self.slots.get(id(old), ()):
            mod._parameters[name] = new
        self.slots[id(new)] = self.slots.pop(id(old), [])

    def _rekey(self, renamed: dict) -> None:
        st = self.st
        if st.tied is not None and id(st.tied[0]) in renamed:
            st.tied = (renamed[id(st.tied[0])], st.tied[1])
        opts = [st.optimizer] if st.optimizer is not None else []
        if st.opt_swap is not None:
            opts += st.opt_swap.optimizers
        for opt in opts:
            for group in opt.param_groups:
                group["params"] = [renamed.get(id(p), p) for p in group["params"]]
            for old in [p for p in opt.state if id(p) in renamed]:
                opt.state[renamed[id(old)]] = opt.state.pop(old)

    # ---- stashed versions in host memory (offload.stash_swap_layers) ----------------------------
    def _pass_start(self) -> None:
        """At each pass: if the next pass of this stage is a backward whose version waits in host
        memory, fetch it now (one pass ahead, as simulator/stash.py ``_stash_pass``); if its
        version is still live, it stays on the device when it goes stale (:attr:`awaiting`)."""
        self.pass_i += 1
        self.awaiting = None
        if not self.swap_slots or self.pass_i + 1 >= len(self.order):
            return
        kind, k2 = self.order[self.pass_i + 1]
        if kind != "B" or k2 not in self.used:
            return
        used = self.used[k2]
        stale = [used[j] for j in self.swap_slots if used[j] is not self.live[j]]
        if not stale:
            self.awaiting = k2
        if self.client is not None:
            self._fetch_peer(self._stale_swapped(used))
            return
        for p in stale:
            self._fetch(p)

    def _to_host(self, param) -> None:
        """A stale version of a stash-swapped layer gets its host copy (kept until its last
        backward); :meth:`_drop` then lets go of the device storage (the graphs hold it through
        :class:`_ParamView`, the modules no longer)."""
        st = self.st
        local = _local(param).detach()  # a tp stage's: the rank's shard
        with st.tracker.phase("host"):
            host = torch.empty(local.shape, dtype=local.dtype, pin_memory=st.torch_device.type == "cuda")
        if self.side is None:
            host.copy_(local)
        else:  # after the update's kernels that read it; the allocator keeps the device storage
            compute = torch.cuda.current_stream(st.torch_device)  # until the side stream's copy is done
            self.side.wait_stream(compute)
            with torch.cuda.stream(self.side):
                host.copy_(local, non_blocking=True)
            local.record_stream(self.side)
        self.on_host[id(param)] = host

    @staticmethod
    def _drop(param) -> None:
        local = _local(param)  # a DTensor keeps its global geometry; its local storage goes
        local.data = torch.empty(0, dtype=local.dtype, device=local.device)

    def _fetch(self, param) -> None:
        """Back on the device (a fresh copy per backward, as the simulator books it)."""
        host = self.on_host.get(id(param))
        local = _local(param)
        if host is None or local.numel() == host.numel():
            return
        dev = self.st.torch_device
        with self.st.tracker.phase("stashed"):
            if self.side is None:
                local.data = host.to(dev, copy=True)
                return
            with torch.cuda.stream(self.side):  # after its own device->host copy (same stream)
                copy = host.to(dev, non_blocking=True)
            copy.record_stream(torch.cuda.current_stream(dev))  # the backward reads it on the compute stream
            self.ready[id(param)] = self.side.record_event()
            local.data = copy

    def _wait_fetched(self, params) -> None:
        """The compute stream waits for the copies of ``params`` fetched on the side stream."""
        for p in params:
            ev = self.ready.pop(id(p), None)
            if ev is not None:
                torch.cuda.current_stream(self.st.torch_device).wait_event(ev)

    # ---- stashed versions on peers (offload.stash_targets, MPress §III-C) ------------------------
    def _stale_swapped(self, used: list) -> list:
        """The stale parameters of stash-swapped layers in a microbatch's version, in slot order."""
        return [used[j] for j in sorted(self.swap_slots) if used[j] is not self.live[j]]

    def _to_peer(self, stale: list) -> None:
        """An update made these (slot, parameter) stale: unless only the backward that is the next
        pass needs them (kept, no round trip), their storages go to the peers as one message (the
        version), and the device copies go once the stripes are sent (the sends hold them)."""
        from executor.d2d import stash_code

        j0, p0 = stale[0]
        others = [k for k, ps in self.used.items() if k != self.awaiting and ps[j0] is p0]
        if not others:
            return  # only the awaiting backward needs it: it stays (executor.d2d.stash_events)
        keep = self.awaiting is not None and self.awaiting in self.used and self.used[self.awaiting][j0] is p0
        version = self.updates
        chunks = []
        for _, p in stale:
            data = _local(p).detach()
            chunks.append(data.reshape(-1).view(torch.uint8))
            self.on_peer[id(p)] = (version, data.shape)
        self.client.send(stash_code(self.st.plan, self.st.index, version), self.peers, chunks, stash=True)
        del chunks
        if not keep:
            for _, p in stale:
                self._drop(p)

    def _fetch_peer(self, params: list) -> None:
        """Request ``params`` (one version's stale parameters, all dropped or all present) back from
        the peers into fresh device storage, filed ``stashed``; the receives run until
        :meth:`_wait_peer`."""
        from executor.d2d import stash_code

        params = [p for p in params if id(p) in self.on_peer and _local(p).numel() == 0]
        if not params:
            return
        bufs = []
        with self.st.tracker.phase("stashed"):
            for p in params:
                shape = self.on_peer[id(p)][1]
                local = _local(p)
                local.data = torch.empty(shape, dtype=local.dtype, device=self.st.torch_device)
                bufs.append(local.data.reshape(-1).view(torch.uint8))
        version = self.on_peer[id(params[0])][0]
        works = self.client.request(stash_code(self.st.plan, self.st.index, version), self.peers, bufs, stash=True)
        self.peer_works[id(params[0])] = works  # one list per version: a gloo work is waited once

    def _wait_peer(self, params) -> None:
        """Before a backward: its version's stripes have landed."""
        for p in params:
            for w in self.peer_works.pop(id(p), ()):
                w.wait()
