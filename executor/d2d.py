"""D2D swap between ranks (MPress §III-C): a layer's saved tensors are striped over peer devices by
weight, held there in the peers' memory, and fetched back before the layer's backward.

Protocol (one ordered pair of ranks at a time, source -> target):

* **Groups.** Every (source device, target device) pair of the plan gets its own process group
  (:func:`swap_pairs`, made in one fixed order on every rank: ``new_group`` is collective). Swap
  traffic therefore never reorders the pipeline's own boundary sends on the default group, and
  each group is used by exactly one thread per rank: the source's main thread (its autograd
  thread on CUDA) and the target's serving thread for that source. (gloo isend/irecv from two
  threads on one group is not something to rely on; on NCCL, ops of one communicator run in
  issue order on one stream, which a second thread would interleave.)
* **Swap-out.** At the end of the layer's forward the source sends, per target: a header
  ``[code, n]`` (which swap, how many storages), the ``n`` storage byte sizes, then for each
  storage its stripe: bytes ``[lo, hi)`` of the storage by :func:`stripe_bounds` (weights as the
  simulator's ``_stripes``: round(n·w/Σw), the last target takes the remainder). Stripes are
  zero-copy views of the saved storages; the source keeps them referenced until their sends
  complete (:class:`Reaper`), then its device copy is freed.
* **Swap-in.** The source sends a request ``[code]`` and posts receives for its stripes; the
  target answers with the stripes and drops them once those sends complete. Request/reply rather
  than "send back right after receipt": NCCL matches point-to-point ops in issue order per
  communicator, and the backward asks for layers in the reverse of the order they arrived; and on
  gloo (whose isend holds until the receive is posted, checked on torch 2.13: a 10 MB isend
  waited 2 s for a late irecv) the reply would park a pending send per stripe. A target with no
  bytes of a swap (every storage rounded to 0 for it) gets no request.
* **Order.** The target never needs a message it cannot predict: :func:`target_events` replays
  the source's action list (``specs.schedule.build_schedule``, the list both walk) and yields the
  swap-outs and swap-ins that concern this target, in the source's order. The source fetches a
  microbatch's swapped layers in reverse layer order, the first at the first ``swap_in`` entry of
  that backward (one pass ahead, MPress §IV / the simulator's prefetch), the rest during the
  backward, one ahead (executor.swap). Since the source only ever blocks on a reply to a request
  it has already sent, and the target serves in the order the source sent, no cycle can form.
  Each message carries the swap's code, checked on arrival: a protocol out of step raises rather
  than corrupting activations.
* **Target memory.** Each target rank runs one daemon thread per source (MPress §III-E: swapping
  runs on threads of its own). Stripes are held in the target's device memory and counted by its
  tracker as ``swapped`` (MemoryBreakdown.swapped_in_bytes: "held for peers"); the dispatch-mode
  tracker is thread-local, so the thread tags them explicitly.

**Stashed weight versions** (``offload.stash_targets``, MPress §III-C; executor.pipedream): a
PipeDream stage's stale versions of its ``stash_swap_layers`` go to peers the same way, over a
second group per (source, target) pair (its own serving thread on the target, so neither stream
of requests waits behind the other). A version is sent when an update makes it stale (header, sizes,
one stripe per parameter storage) and fetched back, one request per backward that needs it, one
pass ahead; the target lets it go after its last fetch. :func:`stash_events` replays the source's
version rule (executor.pipedream: the stage's pass order, an update after every backward) to
know what comes when, as :func:`target_events` replays the action list for activations.

Limits: a target must be a device that runs a stage (one rank per used device; see
executor.measure.unsupported). The NCCL path follows the same calls with private CUDA streams
for waiting; it is untested (no multi-GPU machine was available).
"""
from __future__ import annotations

import queue
import threading
import traceback
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from specs.plan import MemoryAction, Plan, stage_for_microbatch
from specs.schedule import SWAPS, ActionKind, build_schedule

TAG_HEADER, TAG_SIZES, TAG_DATA, TAG_REQUEST, TAG_REPLY = 1, 2, 3, 4, 5


# ---- pure bookkeeping ---------------------------------------------------------------------------

def swap_pairs(plan: Plan) -> list[tuple[int, int]]:
    """Every (source device, target device) of the plan's d2d swaps, sorted: one group each."""
    pairs = set()
    for st in plan.stages:
        for item in st.memory:
            if item.action is MemoryAction.d2d_swap:
                pairs |= {(d, t.device) for d in st.devices for t in item.targets}
    return sorted(pairs)


def stash_pairs(plan: Plan) -> list[tuple[int, int]]:
    """Every (source device, target device) of the plan's stashed-version D2D swaps, sorted."""
    return sorted({(d, t.device) for st in plan.stages for d in st.devices for t in st.offload.stash_targets})


class PairGroups(NamedTuple):
    """A (source, target) pair's process groups: activation stripes (``act``), stashed versions
    (``stash``); None where the pair carries none of that kind."""

    act: object = None
    stash: object = None


def stripe_bounds(nbytes: int, weights: list[float]) -> list[tuple[int, int]]:
    """Byte ranges ``[lo, hi)`` of an ``nbytes`` buffer, one per target, proportional to weight
    (MPress §III-C; rounding as simulator.transfers._stripes: the last target takes the remainder)."""
    total = sum(weights)
    out, lo = [], 0
    for j, w in enumerate(weights):
        part = nbytes - lo if j == len(weights) - 1 else round(nbytes * w / total)
        part = max(0, min(part, nbytes - lo))
        out.append((lo, lo + part))
        lo += part
    return out


def stash_code(plan: Plan, stage: int, version: int) -> int:
    """An id of stage ``stage``'s stashed version ``version`` (its update count within the
    iteration when it went stale), carried by its header and every request for it (a check)."""
    return stage * 1_000_003 + version


def stash_events(plan: Plan, stage: int) -> list[tuple]:
    """One iteration of what a peer of ``stage``'s ``offload.stash_targets`` receives, in the
    source's order: ``("out", version)`` (a version that went stale at an update, sent) and
    ``("in", version, microbatch)`` (a request for it before that microbatch's backward).

    The replay of executor.pipedream.PipeDreamStash: forward k uses the live version; at each
    pass start, a backward next whose version is stale and not on the device is fetched (one pass
    ahead); one whose version is still live is *awaiting*. A backward fetches its own version if
    it is not there yet (the pass before it held it: consecutive backwards on one version), and
    at its end drops the device copy if another in-flight microbatch still needs the version
    (else the version goes). The update after every backward (PipeDream §3.3) makes the live
    version stale if an in-flight microbatch holds it; it is sent unless only the awaiting
    backward needs it (that one keeps it on the device, as simulator/stash.py does)."""
    from specs.schedule import position_schedule

    order = [("F" if a.kind is ActionKind.forward else "B", a.microbatch)
             for a in position_schedule(plan, plan.device_group_of(stage))
             if a.stage == stage and a.kind in (ActionKind.forward, ActionKind.backward)]
    live, used, events = 0, {}, []
    sent: set[int] = set()          # versions held by the peers
    on_device: dict[int, bool] = {}  # sent version -> whether a device copy exists now

    def fetch(v: int, k: int) -> None:
        if v in sent and not on_device[v]:
            events.append(("in", v, k))
            on_device[v] = True

    for i, (kind, k) in enumerate(order):
        if kind == "F":
            used[k] = live
        awaiting = None
        if i + 1 < len(order) and order[i + 1][0] == "B" and order[i + 1][1] in used:
            k2 = order[i + 1][1]
            if used[k2] == live:
                awaiting = k2
            else:
                fetch(used[k2], k2)
        if kind == "F":
            continue
        v = used.pop(k)
        if v != live:
            fetch(v, k)
            if v in sent:
                if v in used.values():
                    on_device[v] = False
                else:
                    sent.discard(v)
                    del on_device[v]
        if live in used.values():  # the update replaces the live weights out of place
            if any(vv == live and j != awaiting for j, vv in used.items()):
                events.append(("out", live))
                sent.add(live)
                on_device[live] = awaiting is not None and used.get(awaiting) == live
        live += 1
    return events


def swap_code(plan: Plan, stage: int, microbatch: int, layer: int) -> int:
    """An id of one swap within an iteration, carried by every header and request (a check)."""
    return (stage * plan.training.microbatches + microbatch) * 1_000_003 + layer


def swapped_layers(plan: Plan, stage: int, k: int) -> list[int]:
    """A stage's layers swapped for microbatch ``k`` (``microbatch_period``), in the order its
    backward fetches them (last layer first)."""
    st = stage_for_microbatch(plan.stages[stage], k)
    return [l for l in reversed(st.layers) if st.action_of(l).action in SWAPS]


def _targets_me(plan: Plan, stage: int, k: int, layer: int, device: int) -> bool:
    item = stage_for_microbatch(plan.stages[stage], k).action_of(layer)
    return item.action is MemoryAction.d2d_swap and any(t.device == device for t in item.targets)


def target_events(plan: Plan, src_device: int, dst_device: int) -> list[tuple[str, int, int, int]]:
    """One iteration of what ``dst_device`` receives from ``src_device``, in order:
    ``("out", stage, microbatch, layer)`` (a swap-out) and ``("in", ...)`` (a fetch request).
    Replays the source's action list: a forward swaps its d2d layers out in layer order; the
    first ``swap_in`` entry of a backward fetches its first swapped layer (any swap kind: the
    source's one-ahead prefetch walks all of them), the backward the rest, last layer first."""
    stages = plan.stages_on(src_device)
    if not stages:
        return []
    events, started = [], set()
    for a in build_schedule(plan)[plan.device_group_of(stages[0])]:
        s, k = a.stage, a.microbatch
        if a.kind is ActionKind.forward:
            events += [("out", s, k, l) for l in plan.stages[s].layers if _targets_me(plan, s, k, l, dst_device)]
        elif a.kind in (ActionKind.swap_in, ActionKind.backward):
            order = swapped_layers(plan, s, k)
            if (s, k) not in started:
                started.add((s, k))
                first = order[:1]
            else:
                first = []
            rest = order[1:] if a.kind is ActionKind.backward else []
            events += [("in", s, k, l) for l in first + rest if _targets_me(plan, s, k, l, dst_device)]
    return events


# ---- process groups and waiting ------------------------------------------------------------------

def make_groups(plan: Plan, rank_of: dict[int, int], rank: int, timeout_s: float) -> dict[tuple[int, int], PairGroups]:
    """Create one process group per :func:`swap_pairs` entry and one per :func:`stash_pairs`
    entry (collective: every rank calls this in the same order); returns those of the pairs this
    rank belongs to, keyed (source device, target device)."""
    me = plan.used_devices()[rank]
    act, stash = set(swap_pairs(plan)), set(stash_pairs(plan))
    groups = {}
    for src, dst in sorted(act | stash):
        ranks = sorted({rank_of[src], rank_of[dst]})
        made = [dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) if (src, dst) in kind else None
                for kind in (act, stash)]
        if me in (src, dst):
            groups[(src, dst)] = PairGroups(*made)
    return groups


def wait(work, cuda_stream=None) -> None:
    """Block this thread until ``work`` is done. On CUDA ``wait`` only orders the current stream
    after NCCL's, so it is done under a private stream that is then synchronised: the compute
    stream never waits on swap traffic it does not consume."""
    if cuda_stream is None:
        work.wait()
        return
    with torch.cuda.stream(cuda_stream):
        work.wait()
    cuda_stream.synchronize()


class Reaper:
    """Holds each stripe send's buffer until the send completes, then drops it (a thread; gloo's
    ``is_completed`` stays False until someone waits). ``drain`` waits for all and re-raises."""

    def __init__(self, device: torch.device):
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        threading.Thread(target=self._loop, daemon=True, name="d2d-reaper").start()

    def _loop(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)  # the current device is per thread
        while True:
            item = self._q.get()
            try:
                wait(item[0], self._stream)
            except BaseException as exc:  # noqa: BLE001 - surfaced by drain()
                self._error = exc
            del item
            self._q.task_done()

    def add(self, work, buffer) -> None:
        self._q.put((work, buffer))

    def drain(self) -> None:
        self._q.join()
        if self._error is not None:
            raise self._error


# ---- source side -----------------------------------------------------------------------------------

class D2DClient:
    """The source rank's end: send a swap's stripes, ask for them back (executor.swap calls it)."""

    def __init__(self, plan: Plan, device: int, rank_of: dict[int, int], groups: dict, torch_device: torch.device):
        self.plan, self.device, self.rank_of, self.groups = plan, device, rank_of, groups
        self.torch_device = torch_device
        self.reaper = Reaper(torch_device)

    def _int64(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.torch_device)

    def _group(self, dev: int, stash: bool):
        pair = self.groups[(self.device, dev)]
        return pair.stash if stash else pair.act

    def send(self, code: int, targets: list[tuple[int, float]], chunks: list[torch.Tensor],
             stash: bool = False) -> None:
        """Swap-out: header, sizes and each uint8 ``chunk``'s stripe to every target (isend);
        ``stash``: a stashed weight version (its own groups)."""
        weights = [w for _, w in targets]
        bounds = [stripe_bounds(c.numel(), weights) for c in chunks]
        header, sizes = self._int64([code, len(chunks)]), self._int64([c.numel() for c in chunks])
        for j, (dev, _) in enumerate(targets):
            g, dst = self._group(dev, stash), self.rank_of[dev]
            self.reaper.add(dist.isend(header, dst=dst, group=g, tag=TAG_HEADER), header)
            if chunks:
                self.reaper.add(dist.isend(sizes, dst=dst, group=g, tag=TAG_SIZES), sizes)
            for c, b in zip(chunks, bounds):
                lo, hi = b[j]
                if hi > lo:
                    piece = c[lo:hi]
                    self.reaper.add(dist.isend(piece, dst=dst, group=g, tag=TAG_DATA), piece)

    def request(self, code: int, targets: list[tuple[int, float]], buffers: list[torch.Tensor],
                stash: bool = False) -> list:
        """Swap-in: ask every target that holds bytes of this swap for them, receiving each
        stripe into its place in ``buffers`` (uint8, the sizes sent). Returns the works to wait."""
        weights = [w for _, w in targets]
        bounds = [stripe_bounds(b.numel(), weights) for b in buffers]
        works = []
        for j, (dev, _) in enumerate(targets):
            mine = [(buf, b[j]) for buf, b in zip(buffers, bounds) if b[j][1] > b[j][0]]
            if not mine:
                continue  # the target holds nothing of this swap: it expects no request
            g, src = self._group(dev, stash), self.rank_of[dev]
            req = self._int64([code])
            self.reaper.add(dist.isend(req, dst=src, group=g, tag=TAG_REQUEST), req)
            works += [dist.irecv(buf[lo:hi], src=src, group=g, tag=TAG_REPLY) for buf, (lo, hi) in mine]
        return works


# ---- target side -----------------------------------------------------------------------------------

class StripeServer:
    """The target rank's end: one daemon thread per source device, each replaying
    :func:`target_events` for ``iterations`` iterations. ``tracker_for(iteration)`` gives the
    tracker to file held stripes with (the tracked iteration's, else a null one). A thread's error
    (a peer gone, the device budget passed) goes to ``fatal(message)`` when given (the rank ends
    at once: its sources would wait on it forever), and is re-raised by :meth:`check`."""

    def __init__(self, plan: Plan, device: int, rank_of: dict[int, int], groups: dict, torch_device: torch.device,
                 iterations: int, tracker_for, fatal=None):
        self.plan, self.device, self.rank_of, self.groups = plan, device, rank_of, groups
        self.torch_device, self.iterations, self.tracker_for = torch_device, iterations, tracker_for
        self.fatal = fatal
        self.error: BaseException | None = None
        # per iteration (all sources together): live stripe bytes, their peak, bytes received
        self.held_bytes = [0] * iterations
        self.held_peak_bytes = [0] * iterations
        self.received_bytes = [0] * iterations
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._serve, args=(src, self._replay), daemon=True,
                                         name=f"d2d-from-{src}")
                        for (src, dst), pair in sorted(groups.items()) if dst == device and pair.act is not None]
        self.threads += [threading.Thread(target=self._serve, args=(src, self._replay_stash), daemon=True,
                                          name=f"d2d-stash-from-{src}")
                         for (src, dst), pair in sorted(groups.items()) if dst == device and pair.stash is not None]
        for t in self.threads:
            t.start()

    def check(self) -> None:
        """Re-raise a serving thread's error in the caller (the rank's main thread)."""
        if self.error is not None:
            raise RuntimeError(f"d2d target device {self.device}: {self.error}") from self.error

    def _serve(self, src: int, replay) -> None:
        try:
            if self.torch_device.type != "cuda":
                replay(src, None)
                return
            torch.cuda.set_device(self.torch_device)  # the current device is per thread
            stream = torch.cuda.Stream(self.torch_device)
            with torch.cuda.stream(stream):  # every op of this thread on its own stream, off the compute one
                replay(src, stream)
        except BaseException as exc:  # noqa: BLE001 - surfaced by fatal() or check()
            if self.fatal is not None:  # ends the rank; not also via check(): one report, not two racing
                self.fatal(f"d2d target device {self.device}, serving device {src}: {type(exc).__name__}: {exc}\n"
                           f"{traceback.format_exc()}")
            self.error = exc

    def _count(self, it: int, delta: int) -> None:
        with self._lock:
            self.held_bytes[it] += delta
            self.held_peak_bytes[it] = max(self.held_peak_bytes[it], self.held_bytes[it])
            self.received_bytes[it] += max(delta, 0)

    def _replay(self, src: int, stream) -> None:
        plan = self.plan
        group, peer = self.groups[(src, self.device)].act, self.rank_of[src]
        events = target_events(plan, src, self.device)

        def recv(buf, tag):
            wait(dist.irecv(buf, src=peer, group=group, tag=tag), stream)
            return buf

        for it in range(self.iterations):
            tracker = self.tracker_for(it)
            held: dict[tuple[int, int, int], list[torch.Tensor]] = {}
            for kind, s, k, l in events:
                code = swap_code(plan, s, k, l)
                targets = stage_for_microbatch(plan.stages[s], k).action_of(l).targets
                weights = [t.weight for t in targets]
                j = [t.device for t in targets].index(self.device)
                if kind == "out":
                    held[(s, k, l)] = self._receive(recv, peer, group, stream, code, (s, k, l), weights, j,
                                                    tracker, it)
                else:
                    self._reply(recv, peer, group, stream, code, (s, k, l), held.pop((s, k, l)), it)
            if held:
                raise RuntimeError(f"d2d: swaps from device {src} never fetched back: {sorted(held)}")

    def _replay_stash(self, src: int, stream) -> None:
        """Serve ``src``'s stashed versions (:func:`stash_events`) for every iteration: hold each
        version's stripes from its arrival to the reply to its last request."""
        plan = self.plan
        group, peer = self.groups[(src, self.device)].stash, self.rank_of[src]
        (s,) = plan.stages_on(src)  # PipeDream: one stage per position
        targets = plan.stages[s].offload.stash_targets
        weights, j = [t.weight for t in targets], [t.device for t in targets].index(self.device)
        events = stash_events(plan, s)
        last_in = {e[1]: i for i, e in enumerate(events) if e[0] == "in"}

        def recv(buf, tag):
            wait(dist.irecv(buf, src=peer, group=group, tag=tag), stream)
            return buf

        for it in range(self.iterations):
            tracker = self.tracker_for(it)
            held: dict[int, list[torch.Tensor]] = {}
            for i, (kind, v, *_) in enumerate(events):
                code = stash_code(plan, s, v)
                if kind == "out":
                    held[v] = self._receive(recv, peer, group, stream, code, ("stash", s, v), weights, j, tracker, it)
                elif last_in[v] == i:
                    self._reply(recv, peer, group, stream, code, ("stash", s, v), held.pop(v), it)
                else:  # more backwards need this version: keep the stripes
                    self._reply(recv, peer, group, stream, code, ("stash", s, v), list(held[v]), it, keep=True)
            if held:
                raise RuntimeError(f"d2d: stashed versions of device {src} never fetched back: {sorted(held)}")

    def _receive(self, recv, peer, group, stream, code, key, weights, j, tracker, it) -> list[torch.Tensor]:
        """A swap-out: header, sizes, then this target's stripe of every storage (held)."""
        dev = self.torch_device
        code_in, n = recv(torch.empty(2, dtype=torch.int64, device=dev), TAG_HEADER).tolist()
        if code_in != code:
            raise RuntimeError(f"d2d protocol out of step with rank {peer}: expected the swap-out of "
                               f"(stage, microbatch, layer) {key} (code {code}), got code {code_in}")
        sizes = recv(torch.empty(n, dtype=torch.int64, device=dev), TAG_SIZES).tolist() if n else []
        bufs, works = [], []
        for size in sizes:
            lo, hi = stripe_bounds(size, weights)[j]
            if hi > lo:
                self._count(it, hi - lo)  # counted before the tracker sees it, freed after: never below it
                buf = torch.empty(hi - lo, dtype=torch.uint8, device=dev)
                tracker.tag(buf, "swapped")  # the dispatch-mode tracker is thread-local: tag by hand
                works.append(dist.irecv(buf, src=peer, group=group, tag=TAG_DATA))
                bufs.append(buf)
        for work in works:
            wait(work, stream)
        return bufs

    def _reply(self, recv, peer, group, stream, code, key, bufs: list[torch.Tensor], it: int,
               keep: bool = False) -> None:
        """A fetch: wait for the source's request, send the stripes back, let them go (the
        caller holds no other reference, so they leave this device's memory on return);
        ``keep``: the caller holds them for a later fetch (stashed versions)."""
        if not bufs:
            return  # nothing of this swap here: the source sends no request
        (code_in,) = recv(torch.empty(1, dtype=torch.int64, device=self.torch_device), TAG_REQUEST).tolist()
        if code_in != code:
            raise RuntimeError(f"d2d protocol out of step with rank {peer}: expected a request for "
                               f"(stage, microbatch, layer) {key} (code {code}), got code {code_in}")
        works = [dist.isend(b, dst=peer, group=group, tag=TAG_REPLY) for b in bufs]
        for i in range(len(works)):
            wait(works[i], stream)
        nbytes = sum(b.numel() for b in bufs)
        works.clear()  # a gloo work references its tensor
        bufs.clear()   # the only other reference (the caller popped it from ``held``): freed here
        if not keep:
            self._count(it, -nbytes)
