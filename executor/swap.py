"""Activation swapping (MPress §III-E "Memory swapping"; D2D striping §III-C): the saved tensors of
a ``cpu_swap`` / ``nvme`` / ``d2d_swap`` layer leave the device at the end of the layer's forward
and come back before its backward, through ``torch.autograd.graph.saved_tensors_hooks``.

* **What moves.** Whole storages, each once per layer (several saved tensors are often views of
  one storage); a saved tensor comes back as a view with its original offset, shape, strides and
  dtype, so the backward sees the same bits (swapping is a copy: numerics are exact). Kept in
  place: parameters and views of them (the optimizer owns them), the stage's input (the stage
  keeps it for the backward anyway, so a copy would free nothing), tensor subclasses other than
  DTensor (under TP a DTensor's local shard moves and the DTensor is rebuilt with its spec),
  other devices' tensors and, on CUDA, storages under :data:`MIN_CUDA_SWAP_BYTES`.
* **cpu_swap / nvme** (nvme runs as cpu_swap: no NVMe tier here). Each storage is copied to a
  host buffer when saved and the device copy is dropped at the layer's end. CPU ranks: the copy
  is filed with the tracker as ``host`` (executor.memtrack), so device bytes fall and the host
  bytes are reported (DeviceResult.host_bytes). CUDA: pinned buffers from torch's caching host
  allocator (MPress's "host pinned memory pool"), D2H on a side stream; the device storage is
  ``record_stream``-ed on it, so the allocator reuses it only once the copy is done; H2D back on
  the side stream, the compute stream waits on its event (torchtune's OffloadActivations and
  TransformerEngine's CPU offload do the same with their own code).
* **d2d_swap**: stripes to peer ranks (executor.d2d); storages under :data:`PACK_BELOW_BYTES`
  are packed into one message per target (the saved tensors come back as views into it), larger
  ones go zero-copy. Without peers (a stage run alone,
  executor.single) a d2d layer is swapped to host instead: the stage's own device memory falls
  exactly as it would, the stripes are reported as host bytes.
* **Single tensors** (MPress §III-D decides per tensor; ``LayerMemory.tensors``). A partial item
  moves only the listed saved tensors; the layer otherwise runs as kept (its input, its output
  and its other saved tensors stay on the device). Index ``j`` is the ``j``-th unique storage the
  layer's forward saves (pack-hook order), parameters and buffers (and views of them), the
  layer's input storage(s) and its output storage(s) left out: the order of
  executor.profile_symbolic's ``saved_tensors``. Which storages those are is known only at the
  layer's exit (its output), so the storages are collected during the forward and the choice
  (and, for cpu_swap, the host copy; d2d: the stripes of the moved storages only) is made at the
  exit; the unmoved ones are then held by autograd's packed objects alone, freed as a kept
  layer's are. A listed index past what the layer saved raises (a plan for other modules).
* **When.** Swap-out at the end of each swapped layer's forward (earlier than the schedule's
  ``swap_out`` entry, which follows the whole stage forward: memory falls sooner). Swap-in: a
  microbatch's swapped layers are fetched last layer first, the first at the first ``swap_in``
  schedule entry of its backward (one pass ahead, as the simulator prefetches), each next one
  when the backward first touches the previous (one layer ahead, the simulator's double
  buffering: the layer in the backward, the next one and the next backward's first can be on the
  device at once), and any left at the backward's end (never touched) in order: executor.d2d's
  targets rely on that order. A layer's swapped-in copy goes when autograd has released the last
  of its packed tensors (:meth:`_Record.release`: the layer's backward has run), not at the
  backward's end, so the double buffering above is what the device holds (simulator/walk.py
  ``_layered_backward`` frees each layer's copy as its backward ends).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

from specs.plan import MemoryAction, stage_for_microbatch

#: CUDA: storages below this stay on the device. A PCIe copy of 1 MiB takes ~40-80 us at 12-25 GB/s,
#: comparable to a copy's launch + event cost (~10 us) only below ~100 KiB; layer-sized activations
#: of the models swapped for memory are MiBs, LayerNorm statistics and masks KiBs. CPU ranks swap all
#: (a memcpy costs no launch), so the measured bytes are exactly the layer's saved bytes.
MIN_CUDA_SWAP_BYTES = 1 << 20


#: d2d: storages below this travel packed into one buffer per layer (one copy, 64-byte aligned
#: offsets), larger ones as zero-copy views. The trade-off, measured on local_cpu (gpt_tiny pp4,
#: stages 0-1 d2d to 2 devices, ~15 storages of 256 B-64 KiB per block, 2 runs each): zero-copy
#: 0.106 s per iteration, source peak 1.79-1.80 MB; packing everything (1 MiB) 0.067-0.073 s,
#: 1.92-2.20 MB (the packed copy and the originals coexist at the layer's end; gloo charges
#: ~0.1-1 ms per message); 4 KiB 0.090-0.105 s, 1.79-1.92 MB (no swap: 0.03 s, 2.30 MB). Memory
#: is what a swap is for.
PACK_BELOW_BYTES = 4096
ALIGN = 64


def _same(t):
    return t


def _raw(storage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Saved:
    """What autograd holds for a swapped saved tensor: where its storage went and its view.

    Autograd drops it when the node that saved it has run its backward (``release_variables``:
    the SavedVariable resets its hooks' packed object, unless ``retain_graph``), so when the
    record's last one goes, no unpack can come any more and the swapped-in copy is let go
    (:meth:`_Record.release`) — the layer's backward is over, as the simulator frees it."""

    __slots__ = ("record", "index", "offset", "size", "stride", "dtype", "kept")

    def __init__(self, record, index, t: torch.Tensor):
        self.record, self.index = record, index
        self.offset, self.size, self.stride, self.dtype = t.storage_offset(), t.size(), t.stride(), t.dtype
        self.kept = None  # a partial layer's unmoved storage (set at the layer's exit): stays on the device
        record.handles += 1

    def __del__(self):
        rec = self.record
        rec.handles -= 1
        if not rec.handles:
            rec.release()


class _SavedDTensor:
    """A DTensor (tensor parallelism) whose local shard was swapped: rebuilt with its spec."""

    __slots__ = ("local", "spec")

    def __init__(self, local: _Saved, spec):
        self.local, self.spec = local, spec


class _Record:
    """One swapped layer of one microbatch."""

    def __init__(self, stage: int, k: int, layer: int, action: MemoryAction, targets: list[tuple[int, float]],
                 tensors: list[int] | None = None, tensors_of: int | None = None):
        self.stage, self.k, self.layer, self.action, self.targets = stage, k, layer, action, targets
        self.tensors = tensors                # LayerMemory.tensors: None moves the whole layer
        self.tensors_of = tensors_of          # LayerMemory.tensors_of: the count the plan was made for
        self.ptrs: dict[int, int] = {}        # storage key -> index (dedupe within the layer)
        self.storages: list | None = []       # device storages, until the layer's end
        self.pending: list = []               # partial: the layer's _Saved, until its end
        self.moved: list[int] = []            # indices of the storages that leave the device
        self.host: list = []                  # host copies (cpu_swap), one per moved storage
        self.where: dict[int, tuple[int, int]] = {}  # moved storage index -> (chunk, byte offset in it)
        self.sizes: list[int] = []            # chunk bytes (a host copy, or a d2d message)
        self.events: list = []                # CUDA: the H2D copy's event
        self.fetched: list | None = None      # device storages after the swap-in
        self.works: list = []                 # d2d: pending stripe receives
        self.started = False                  # swap-in issued
        self.touched = False                  # the backward has unpacked from it
        self.handles = 0                      # live _Saved of this record (autograd's packed objects)

    def release(self) -> None:
        """Autograd holds no packed tensor of this layer any more: drop the swapped-in copy
        (the views handed out keep their storage while a node still uses them). Without this
        the queue held every fetched layer until ``end_backward``, so a backward's swapped-in
        bytes grew to the whole microbatch's instead of the two layers double buffering keeps
        (measured, local_cpu GPT 4 blocks all cpu_swap: 2.31 MB vs ~1.06 MB). Only once touched:
        then its copy has been waited for (``_wait``: d2d receives done, CUDA events recorded);
        one never touched goes with the queue at ``end_backward``."""
        if self.touched:
            self.fetched = None


class Swapper:
    """The saved-tensor hooks of one stage on one rank. ``st``: the StageRuntime (its device,
    tracker, layers, plan); ``d2d``: an executor.d2d.D2DClient, or None (d2d swaps to host)."""

    def __init__(self, st, d2d=None):
        self.st, self.d2d = st, d2d
        self.device = st.torch_device
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.params = {getattr(t, "_local_tensor", t).untyped_storage().data_ptr()
                       for _, _, mod in st.layers for t in (*mod.parameters(), *mod.buffers())}
        self.keep: set[int] = set()
        self.param_pack = _same  # a saved tensor the swap leaves in place (executor.pipedream replaces it)
        self.queues: dict[int, list[_Record]] = {}  # microbatch -> its records, backward order
        self.next: dict[int, int] = {}              # microbatch -> index of the next record to fetch

    # ---- forward ------------------------------------------------------------------------------
    def begin_forward(self, k: int, x) -> None:
        """Before microbatch ``k``'s forward: the swap-outs issued so far must be done (the
        simulator's forward waits alike: a copy channel slower than the forwards stalls compute
        instead of piling swapped bytes up on the device, MPress §II-D); the stage input ``x``
        stays where it is."""
        if self.cuda:  # a device-side wait: the compute stream follows the side stream's copies
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        if self.d2d is not None:  # the stripe sends (gloo: until the target posted its receive)
            self.d2d.reaper.drain()
        self.keep = {t.untyped_storage().data_ptr() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)}
        self.queues[k], self.next[k] = [], 0

    @contextlib.contextmanager
    def layer(self, k: int, layer: int, x=None):
        """Run one swapped layer's forward under this; its saved tensors leave at the exit.
        ``x``: the layer's input (a pytree; the batch dict for a first layer that takes none).
        Yields ``output``, through which the caller passes the layer's output
        (``y = output(mod(y, mb))``): a partial item (``tensors``) leaves the input and output
        storages on the device and counts its indices without them."""
        item = stage_for_microbatch(self.st.stage, k).action_of(layer)
        targets = [(t.device, t.weight) for t in item.targets]
        rec = _Record(self.st.index, k, layer, item.action, targets, item.tensors, item.tensors_of)
        out = []

        def output(y):
            out.append(y)
            return y

        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(rec, t), self._unpack):
            yield output
        if rec.tensors is not None:
            if not out:
                raise RuntimeError(f"swap of stage {self.st.index} layer {layer}: a partial item (tensors "
                                   f"{rec.tensors}) needs the layer's output: pass it through layer()'s output")
            self._choose(rec, (x, out))
        self._swap_out(rec)
        self.queues[k].insert(0, rec)  # backward order: last layer first

    def _offloadable(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.device != self.device or t.layout is not torch.strided:
            return False  # parameters (nn.Parameter), subclasses (DTensor), other devices
        return self._movable(t.untyped_storage())

    def _movable(self, st) -> bool:
        ptr = st.data_ptr()
        if st.device != self.device or not st.nbytes() or ptr in self.params or ptr in self.keep:
            return False
        return not self.cuda or st.nbytes() >= MIN_CUDA_SWAP_BYTES

    def _pack(self, rec: _Record, t: torch.Tensor):
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor) and hasattr(t, "_spec") and not isinstance(t, torch.nn.Parameter):
            inner = self._pack(rec, local)  # a DTensor: swap its shard, keep its placement spec
            return _SavedDTensor(inner, t._spec) if isinstance(inner, _Saved) else t
        if rec.tensors is not None:
            return self._pack_partial(rec, t)
        if not self._offloadable(t):
            return self.param_pack(t)  # PipeDream's stash swap keeps no view of a stale version
        storage = t.untyped_storage()
        index = rec.ptrs.get(storage.data_ptr())
        if index is None:  # the storage is held until the layer's end, so its address is not reused
            index = rec.ptrs[storage.data_ptr()] = len(rec.storages)
            rec.storages.append(storage)
            if not self._to_peers(rec):  # one chunk per storage: its host copy
                self._host_chunk(rec, index)
        return _Saved(rec, index, t)

    def _host_chunk(self, rec: _Record, index: int) -> None:
        rec.where[index] = (len(rec.sizes), 0)
        rec.sizes.append(rec.storages[index].nbytes())
        rec.host.append(self._to_host(rec.storages[index]))

    def _pack_partial(self, rec: _Record, t: torch.Tensor):
        """A partial layer: every saved storage but the parameters' is collected (keyed by the
        storage itself, as the profiler's StorageWeakRef: distinct empty storages stay apart);
        which of them leave is decided at the layer's exit (:meth:`_choose`)."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return self.param_pack(t)  # parameters (nn.Parameter), other subclasses: neither counted nor moved
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() in self.params:
            return self.param_pack(t)  # a view of a parameter or buffer
        index = rec.ptrs.get(storage._cdata)
        if index is None:  # held until the layer's end: the key is not reused meanwhile
            index = rec.ptrs[storage._cdata] = len(rec.storages)
            rec.storages.append(storage)
        saved = _Saved(rec, index, t)
        rec.pending.append(saved)
        return saved

    def _choose(self, rec: _Record, boundary) -> None:
        """At a partial layer's exit: the listed interior storages (index semantics: the module
        docstring) that can leave are ``rec.moved``; every other one goes to its packed objects,
        which keep it on the device as a kept layer's saved tensor. cpu_swap: host copies now."""
        edge = {getattr(t, "_local_tensor", t).untyped_storage()._cdata
                for t in tree_flatten(boundary)[0] if isinstance(t, torch.Tensor)}
        interior = [i for i, st in enumerate(rec.storages) if st._cdata not in edge]
        if rec.tensors_of is not None and rec.tensors_of != len(interior):
            raise RuntimeError(
                f"partial swap of stage {rec.stage} layer {rec.layer}: the plan was made for {rec.tensors_of} saved "
                f"tensors (tensors_of) but the layer saved {len(interior)} besides its parameters, input and output: "
                "other kernels (a profile traced on another device type?) save other tensors, so its indices "
                f"{rec.tensors} would move other tensors")
        late = [j for j in rec.tensors if j >= len(interior)]
        if late:
            raise RuntimeError(
                f"partial swap of stage {rec.stage} layer {rec.layer}: the plan moves saved tensor index {late[0]} "
                f"(tensors {rec.tensors}) but the layer saved {len(interior)} tensors besides its parameters, "
                f"input and output (indices 0..{len(interior) - 1}): the plan was made for other modules")
        rec.moved = [interior[j] for j in rec.tensors if self._movable(rec.storages[interior[j]])]
        moved = set(rec.moved)
        for saved in rec.pending:
            if saved.index not in moved:
                saved.kept = rec.storages[saved.index]
        rec.pending = []
        if not self._to_peers(rec):
            for i in rec.moved:
                self._host_chunk(rec, i)

    def _to_peers(self, rec: _Record) -> bool:
        return rec.action is MemoryAction.d2d_swap and self.d2d is not None

    def _to_host(self, storage) -> torch.Tensor:
        src = _raw(storage)
        with self.st.tracker.phase("host"):
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=self.cuda)
        if not self.cuda:
            host.copy_(src)
            return host
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # the producer's kernels first
        with torch.cuda.stream(self.side):
            host.copy_(src, non_blocking=True)
        src.record_stream(self.side)  # freed by the allocator only once the copy has run
        return host

    def _swap_out(self, rec: _Record) -> None:
        """End of the layer's forward: d2d stripes go out (small storages packed into one chunk,
        large ones zero-copy: each is freed when its sends complete); host copies are already
        made. The record lets go of the device."""
        if rec.tensors is None:
            rec.moved = list(range(len(rec.storages)))
        if self._to_peers(rec):
            from executor.d2d import swap_code

            chunks = self._chunks(rec)
            self.d2d.send(swap_code(self.st.plan, rec.stage, rec.k, rec.layer), rec.targets, chunks)
        # CUDA host copies: the swap-in's H2D follows them on the same side stream, and each
        # device storage was record_stream-ed on it, so dropping the references here is safe
        rec.storages = None
        rec.ptrs = {}

    def _chunks(self, rec: _Record) -> list[torch.Tensor]:
        """The d2d messages of a layer's moved storages: chunk 0 packs the small ones (if any),
        then one chunk per large one; fills ``rec.where`` and ``rec.sizes``."""
        small = [i for i in rec.moved if rec.storages[i].nbytes() < PACK_BELOW_BYTES]
        rec.where = {}
        chunks = []
        if small:
            offsets, end = [], 0
            for i in small:
                offsets.append(end)
                end += -(-rec.storages[i].nbytes() // ALIGN) * ALIGN  # aligned for any dtype's view
            packed = torch.empty(end, dtype=torch.uint8, device=self.device)
            for i, off in zip(small, offsets):
                packed[off:off + rec.storages[i].nbytes()].copy_(_raw(rec.storages[i]))
                rec.where[i] = (0, off)
            chunks.append(packed)
        for i in rec.moved:
            if rec.storages[i].nbytes() >= PACK_BELOW_BYTES:
                rec.where[i] = (len(chunks), 0)
                chunks.append(_raw(rec.storages[i]))
        rec.sizes = [c.numel() for c in chunks]
        return chunks

    # ---- backward -----------------------------------------------------------------------------
    def swap_in(self, k: int) -> None:
        """The schedule's first ``swap_in`` entry of microbatch ``k``'s backward (one pass
        ahead): start fetching the first layer the backward needs."""
        if self.next.get(k, 0) == 0 and self.queues.get(k):
            self._fetch_next(k)

    def begin_backward(self, k: int) -> None:
        self.swap_in(k)  # reached here without a swap_in entry (a stage run alone, say)

    def end_backward(self, k: int) -> None:
        """Fetch (and drop) what the backward never touched, in order (the d2d targets expect
        every request); forget the microbatch."""
        queue = self.queues.get(k, [])
        while self.next.get(k, 0) < len(queue):
            self._fetch_next(k)  # reads self.queues[k]: popped only after (the first H200 run's KeyError)
        self.queues.pop(k, None)
        for rec in queue:
            self._wait(rec)
        self.next.pop(k, None)

    def _fetch_next(self, k: int) -> None:
        i = self.next[k]
        self._start(self.queues[k][i])
        self.next[k] = i + 1

    def _start(self, rec: _Record) -> None:
        """Issue the swap-in of ``rec``: destination buffers allocated now (filed ``swapped``)."""
        rec.started = True
        with self.st.tracker.phase("swapped"):
            if self._to_peers(rec):
                from executor.d2d import swap_code

                bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in rec.sizes]
                rec.works = self.d2d.request(swap_code(self.st.plan, rec.stage, rec.k, rec.layer), rec.targets, bufs)
            elif self.cuda:
                with torch.cuda.stream(self.side):  # allocated on the side stream, used on the compute one
                    bufs = [h.to(self.device, non_blocking=True) for h in rec.host]
                    ev = torch.cuda.Event()
                    ev.record(self.side)
                rec.events = [ev]
            else:
                bufs = [h.clone() for h in rec.host]  # born in the "swapped" phase: device memory
        rec.fetched = [b.untyped_storage() for b in bufs]
        rec.host = []  # the host copy is free once the device copy exists (the copy holds its source)

    def _wait(self, rec: _Record) -> None:
        for w in rec.works:
            w.wait()
        rec.works = []
        if self.cuda and rec.events:
            stream = torch.cuda.current_stream(self.device)
            for ev in rec.events:
                stream.wait_event(ev)
            if rec.action is not MemoryAction.d2d_swap or self.d2d is None:
                for s in rec.fetched:
                    _raw(s).record_stream(stream)
            rec.events = []

    def _unpack(self, saved):
        if isinstance(saved, _SavedDTensor):
            from torch.distributed.tensor import DTensor

            return DTensor(self._unpack(saved.local), saved.spec, requires_grad=False)
        if not isinstance(saved, _Saved):
            return saved.unpack() if hasattr(saved, "unpack") else saved  # executor.pipedream._ParamView
        rec = saved.record
        if not rec.touched:  # the backward has reached this layer: the next one comes in meanwhile
            rec.touched = True
            queue, k = self.queues.get(rec.k, []), rec.k
            while not rec.started:  # fetched on demand, in order (never skip a d2d request)
                self._fetch_next(k)
            if self.next.get(k, 0) < len(queue):
                self._fetch_next(k)
            self._wait(rec)
        if saved.kept is not None:  # a partial layer's unmoved storage: it never left
            storage, element_offset = saved.kept, saved.offset
        else:
            chunk, byte_offset = rec.where[saved.index]
            storage, element_offset = rec.fetched[chunk], byte_offset // saved.dtype.itemsize + saved.offset
        return torch.empty(0, dtype=saved.dtype, device=saved.kept.device if saved.kept is not None
                           else self.device).set_(storage, element_offset, saved.size, saved.stride)
