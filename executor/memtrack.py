"""Peak live-tensor bytes on CPU, by the simulator's categories, from a dispatch-level tracker.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it raises NotImplementedError when a
module runs forward twice in one iteration ("does not support memory tracking for multiple
iterative calls", torch 2.13), and a pipeline stage runs every layer once per microbatch. Here a
``TorchDispatchMode`` sees every op output, counts each storage once (views share it) and learns
of its release through a weakref finalizer on the storage (torch keeps one Python object per
storage, so the finalizer fires when the memory is freed). Categories come from the phase the
tensor was born in (forward/backward: activations, recv/send: buffers, optimizer step: optimizer)
and are corrected by :meth:`tag` for parameters, gradients and optimizer state.
A functional collective's output (DTensor's gathers and reductions) that gloo's worker thread
frees after this thread let it go is counted as freed at its last use here (:meth:`_comm_freed`).
DTensor ops are left to DTensor (the mode returns NotImplemented for them), so the local ops its
sharding rules run, temporaries included, are counted on their local tensors (what the rank really
holds).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORY_FIELDS = {
    "parameters": "parameters_bytes", "gradients": "gradients_bytes", "optimizer": "optimizer_bytes",
    "activations": "activations_bytes", "buffers": "buffers_bytes",
    # swap-ins on the source and stripes held for d2d peers (executor.swap, executor.d2d)
    "swapped": "swapped_in_bytes",
    # PipeDream's stale weight versions that in-flight microbatches still need (executor.pipedream)
    "stashed": "stashed_weights_bytes",
}
#: the one category that is not device memory: swapped-out copies in host RAM (executor.swap).
#: On a CPU rank host and "device" are the same DRAM, so only this tag tells them apart.
HOST = "host"
#: file-backed tensors (STRONGHOLD's NVMe tier, executor.window): neither device nor host RAM
NVME = "nvme"
_APART = (HOST, NVME)
_CATEGORIES = tuple(CATEGORY_FIELDS)
#: operator namespaces of torch's functional collectives (DTensor's redistributions run these)
_COMM_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _local(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)  # DTensor
    return inner if isinstance(inner, torch.Tensor) else t


#: debug: a folder to write every tracked allocation and free to, one ``mem_<rank>.log`` per process (its pid outside torch.distributed)
#: (lines ``t_ns +|- key bytes category total_device_bytes op where``), the measured memory timeline
#: to set beside the simulator's trace.json counters
MEMLOG_ENV = "MEMWALL_MEMLOG"


def _where() -> str:
    """The innermost caller outside torch and this module (debug log only)."""
    import traceback

    for fr in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in fr.filename and not fr.filename.endswith("memtrack.py"):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}:{fr.name}"
    return "?"


class MemoryBudgetExceeded(RuntimeError):
    """A CPU rank went over its device's ``memory_bytes``: the CPU analogue of a CUDA OOM."""


class LiveTensorTracker(TorchDispatchMode):
    """``with tracker:`` counts storages created inside; ``tag`` registers or re-categorises
    tensors made outside (parameters) or mis-filed (gradients). ``peak_bytes`` and
    ``peak_breakdown`` (category -> bytes at the moment of the peak) are the result. With
    ``capacity_bytes`` an allocation past it raises :class:`MemoryBudgetExceeded` (a CPU process
    has no OOM wall; this makes the hardware spec's budget one)."""

    def __init__(self, capacity_bytes: int | None = None):
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self._keys = WeakIdKeyDictionary()  # storage -> key
        self._live: dict[int, list] = {}  # key -> [nbytes, category]
        self._ids = itertools.count()
        self.totals = {c: 0 for c in CATEGORY_FIELDS}
        self.total_bytes = 0
        self._peak = (0, tuple(self.totals.values()))  # settled: (bytes, totals) at the peak
        # functional collectives' outputs (executor.memtrack._comm_freed): key -> the allocation
        # count at their last use on the owner thread; while any lives, every allocation's
        # (total, totals) is kept in _hist (the first one is allocation number _hist_seq0)
        self._owner = threading.get_ident()
        self._comm: dict[int, int] = {}
        self._hist: list[tuple[int, tuple]] = []
        self._hist_seq0 = 0
        self._seq = 0  # device allocations so far
        self.comm_lag_bytes = 0  # the most a worker-thread free was moved back (diagnostic)
        self.category = "activations"
        self.host_bytes = 0  # live HOST-tagged bytes: counted apart, never against capacity_bytes
        self.host_peak_bytes = 0
        self.nvme_bytes = 0  # live NVME-tagged bytes, likewise apart
        self.nvme_peak_bytes = 0
        self._lock = threading.RLock()
        folder = os.environ.get(MEMLOG_ENV)
        if folder:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else os.getpid()
            self._log = open(os.path.join(folder, f"mem_{rank}.log"), "w")
        else:
            self._log = None
        self._op = ""

    def _write(self, sign: str, key: int, nbytes: int, category) -> None:
        self._log.write(f"{time.perf_counter_ns()} {sign} {key} {nbytes} {category} {self.total_bytes} "
                        f"{self._op} {_where() if sign == '+' else ''}\n")
        self._log.flush()

    # -- bookkeeping ---------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        with self._lock:  # finalizers also run on the send-reaper thread (executor.stage)
            nbytes, cat = self._live.pop(key, (0, None))
            if self._log is not None and cat is not None:
                self._write("-", key, nbytes, cat)
            if key in self._comm:
                self._comm_freed(key, nbytes, cat)
            if cat == HOST:
                self.host_bytes -= nbytes
            elif cat == NVME:
                self.nvme_bytes -= nbytes
            elif cat is not None:
                self.totals[cat] -= nbytes
                self.total_bytes -= nbytes

    def _comm_freed(self, key: int, nbytes: int, cat) -> None:
        """A functional collective's output is gone. gloo's worker thread holds a collective's
        tensors until its run loop drops the finished work, after the caller's ``wait`` returned
        (ProcessGroupGloo::runLoop resets ``workInProgress_`` under its lock, then the GIL is needed
        to drop the storage's Python object), so a temporary the program let go at its last use
        (DTensor's raw all-gather buffer, dropped once ``cat`` reordered it) can stay counted a few
        milliseconds longer when that thread is not scheduled: seen on 4 ranks sharing 2 cores as a
        random +128 KiB on one rank of pp 2 x tp 2 with sequence parallelism (3 of 416 gathers). The
        program's memory is what the simulator predicts and what a rank holds when its
        communication thread keeps up, so a free that comes from another thread is moved back to
        the storage's last use on this one: every allocation recorded since then is lowered by its
        bytes. A free on this thread is the program's own, counted where it happens."""
        last = self._comm.pop(key)
        if threading.get_ident() != self._owner and cat is not None and cat not in _APART:
            i = _CATEGORIES.index(cat)
            start = max(0, last + 1 - self._hist_seq0)
            for j in range(start, len(self._hist)):
                total, totals = self._hist[j]
                self._hist[j] = (total - nbytes, totals[:i] + (totals[i] - nbytes,) + totals[i + 1:])
            if start < len(self._hist):
                self.comm_lag_bytes = max(self.comm_lag_bytes, nbytes)
        if not self._comm:
            self._settle()

    def _settle(self) -> None:
        """Fold the kept allocations into the settled peak: no free can move before them now."""
        for entry in self._hist:
            if entry[0] > self._peak[0]:
                self._peak = entry
        self._hist = []

    @property
    def peak_bytes(self) -> int:
        return max([self._peak[0]] + [e[0] for e in self._hist])

    @property
    def peak_breakdown(self) -> dict:
        best = self._peak
        for entry in self._hist:
            if entry[0] > best[0]:
                best = entry
        return dict(zip(_CATEGORIES, best[1]))

    def tag(self, t: torch.Tensor | None, category: str, retag: bool = True) -> None:
        if t is None:
            return
        t = _local(t)
        if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
            return
        st = t.untyped_storage()
        with self._lock:
            self._tag_storage(st, category, retag)

    def resized(self, t: torch.Tensor, category: str) -> None:
        """Re-count ``t``'s storage after an in-place ``untyped_storage().resize_`` (FSDP2 frees and
        re-allocates its unsharded parameters so, unseen by dispatch: executor.fsdp): forgotten at
        its old size, filed ``category`` at its new one (nothing when it is now empty)."""
        st = _local(t).untyped_storage()
        with self._lock:
            key = self._keys.get(st)
            if key is not None:
                self._free(key)
                del self._keys[st]
            if st.nbytes():
                self._tag_storage(st, category, retag=False)

    def release(self, t: torch.Tensor) -> None:
        """Free ``t``'s memory now, its last use done. A gloo collective's tensors are also held by
        the process group's worker thread, which lets them go only after the caller's ``wait()``
        returned (ProcessGroupGloo's run loop resets its work in progress after the work completed
        its future), so a plain ``del`` frees them at a moment that races this thread's next
        allocations: a peak that holds them in some runs and not in others (seen: one PipeDream
        rank +0.125 MiB in 2 of 20 runs, its all-reduce bucket alive at the next update)."""
        local = _local(t)
        if local.device.type != "cpu":
            return  # NCCL: its stream uses order the free; max_memory_allocated is the measure there
        local.untyped_storage().resize_(0)
        self.resized(local, "buffers")  # forgotten at its old size; nothing re-filed when empty

    def _tag_storage(self, st, category: str, retag: bool) -> None:
        key = self._keys.get(st)
        if key is None:
            key = next(self._ids)
            nbytes = st.nbytes()
            self._keys[st] = key
            self._live[key] = [nbytes, category]
            weakref.finalize(st, self._free, key)
            if self._log is not None:
                self._write("+", key, nbytes, category)
            if category == HOST:
                self.host_bytes += nbytes
                self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
                return
            if category == NVME:
                self.nvme_bytes += nbytes
                self.nvme_peak_bytes = max(self.nvme_peak_bytes, self.nvme_bytes)
                return
            self.totals[category] += nbytes
            self.total_bytes += nbytes
            self._seq += 1
            if self._comm:  # a functional collective's output lives: kept until it is freed
                if not self._hist:
                    self._hist_seq0 = self._seq
                self._hist.append((self.total_bytes, tuple(self.totals.values())))
            elif self.total_bytes > self._peak[0]:
                self._peak = (self.total_bytes, tuple(self.totals.values()))
            if self.capacity_bytes is not None and self.total_bytes > self.capacity_bytes:
                raise MemoryBudgetExceeded(
                    f"live tensors {self.total_bytes} B exceed the device's memory_bytes {self.capacity_bytes} B "
                    f"({', '.join(f'{c} {b}' for c, b in self.totals.items() if b)})")
        elif retag:
            entry = self._live[key]
            if entry[1] != category:
                if entry[1] in _APART or category in _APART:  # device <-> host is a copy, never a re-filing
                    raise ValueError(f"a {entry[1]} storage cannot be re-tagged {category}")
                self.totals[entry[1]] -= entry[0]
                self.totals[category] += entry[0]
                if self._log is not None:
                    self._write("=", key, entry[0], f"{entry[1]}->{category}")
                entry[1] = category

    def reset_peak(self) -> None:
        with self._lock:
            self._hist = []
            self._peak = (self.total_bytes, tuple(self.totals.values()))
        self.host_peak_bytes = self.host_bytes
        self.nvme_peak_bytes = self.nvme_bytes
        if self._log is not None:
            self._write("R", -1, 0, "reset_peak")

    @contextmanager
    def phase(self, category: str):
        """Tensors born inside belong to ``category`` (e.g. "buffers" around a recv)."""
        before, self.category = self.category, category
        try:
            yield
        finally:
            self.category = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):  # dispatch lists the subclasses
            # a DTensor op: let DTensor run it first, so that the local ops it runs come back
            # through this mode and every storage they make is counted. Run from here they would
            # not be (a mode is off inside its own dispatch): the temporaries of a sharding rule
            # went unseen, e.g. loss_parallel's backward, which holds three logits shards at once
            # (zeros, exp, their sum) where only its one-shard result was counted (issue #11)
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self._op = str(func) if self._log is not None else ""
        if not func.is_view:  # a view allocates nothing: its storage is counted where it was made,
            # or, made before tracking (the host-side global batch a rank slices), not at all
            comm = func.namespace in _COMM_NAMESPACES
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.tag(t, self.category, retag=False)
                    if comm and t.device.type == "cpu":  # NCCL: max_memory_allocated is the measure
                        with self._lock:
                            key = self._keys.get(t.untyped_storage())
                            if key is not None and key in self._live:
                                self._comm.setdefault(key, self._seq)
        if self._comm:  # a live collective output used here: alive up to this op's allocations
            with self._lock:  # (see _comm_freed)
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        key = self._keys.get(_local(t).untyped_storage())
                        if key in self._comm:
                            self._comm[key] = self._seq
        return out


class NullTracker:
    """Stand-in when memory is not tracked (timed iterations, GPU runs)."""

    peak_bytes = 0
    host_peak_bytes = 0
    nvme_peak_bytes = 0
    peak_breakdown: dict = {}

    def tag(self, *a, **k) -> None:
        pass

    def release(self, t) -> None:
        pass  # untracked: the reference count frees it (a CUDA tensor's stream uses included)

    @contextmanager
    def phase(self, category: str):
        yield

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def tag_static(tracker, stages) -> None:
    """File every stage's parameters, gradients and optimizer state under their categories."""
    for st in stages:
        for p in st.params:
            tracker.tag(p, "parameters")
            tracker.tag(p.grad, "gradients")
        if hasattr(getattr(st, "zero1", None), "tag"):  # ZeRO-2: the gradient shards (executor.zero2)
            st.zero1.tag(tracker)
        if getattr(st, "window", None) is not None:  # STRONGHOLD window: slot pool, host side
            st.window.tag(tracker)
        if getattr(st, "weight_swap", None) is not None:  # MPress weight swap: its home is host memory
            st.weight_swap.tag(tracker)
        if getattr(st, "opt_swap", None) is not None:  # MPress optimizer swap: its state is host memory
            for v in st.opt_swap.state_tensors():
                tracker.tag(v, HOST)
            continue
        for state in (st.optimizer.state.values() if st.optimizer is not None else ()):
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    tracker.tag(v, "optimizer")
