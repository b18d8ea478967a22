"""A stage's boundary communication: the sends and receives of activations and gradients
between pipeline stages, resharded between the stages' meshes (executor.topology.routes), and
the helper thread that frees each sent buffer once its send completed (SendReaper).

StageComm is a mixin of executor.stage.StageRuntime: it reads the runtime's routes, rows, rank
table, tracker and output table set up there."""
from __future__ import annotations

import math
import queue
import threading

import torch
import torch.distributed as dist

from executor import user_model
from executor.boundary import release
from executor.topology import message_tag


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


class StageComm:
    """Boundary sends/receives of executor.stage.StageRuntime (a mixin: the state is the runtime's)."""

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
                    k_ways = self.scatter_out if kind == "act" else self.scatter_in
                    if k_ways > 1 and piece.numel() % k_ways == 0:  # Narayanan §4.1: this tp rank's 1/t
                        n = piece.numel() // k_ways
                        piece = piece.view(-1)[self.tp_rank * n:(self.tp_rank + 1) * n]
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
        if self.stage.cp > 1:  # context parallelism: this cp rank's s/cp tokens (executor.context_parallel)
            tail = (tail[0] // self.stage.cp, *tail[1:])
        if getattr(self, "split_in" if kind == "act" else "split_out", False):  # s/t of the sequence (dim 0 of tail)
            tail = (tail[0] // self.stage.tp, *tail[1:])
        posted = []
        with self.tracker.phase("buffers"):
            for r in table:
                if r.dst_device == self.device and self.bounds is not None:  # a pytree: a buffer per leaf
                    posted = user_model.Posted(posted, kind=kind, boundary=self.bounds["act_in" if kind == "act" else "act_out"])
                    bufs = user_model.recv_buffers(posted.boundary, kind, r.stop - r.start, self.torch_device, self.dtype)
                    posted.append(([dist.irecv(b, src=self.rank_of[r.src_device], tag=tag + j * self.leaf_tag_stride)
                                    for j, b in enumerate(bufs)], bufs))
                elif r.dst_device == self.device:
                    shape = whole = (r.stop - r.start, *tail)
                    k_ways = self.scatter_in if kind == "act" else self.scatter_out
                    if k_ways > 1 and math.prod(whole) % k_ways == 0:  # 1/t; the tp group gathers it (wait_recv)
                        shape = (math.prod(whole) // k_ways,)
                    buf = torch.empty(shape, device=self.torch_device, dtype=self.dtype)
                    posted.append((dist.irecv(buf, src=self.rank_of[r.src_device], tag=tag), buf, whole))
        return posted

    def wait_recv(self, posted: list) -> torch.Tensor:
        """The boundary tensor of :meth:`post_recv`'s handles, once every piece has arrived."""
        if isinstance(posted, user_model.Posted):
            for works, _ in posted:
                for work in works:
                    work.wait()
            with self.tracker.phase("buffers"):
                return user_model.assemble(posted.boundary, posted.kind, [bufs for _, bufs in posted])
        for work, *_ in posted:
            work.wait()
        with self.tracker.phase("buffers"):
            bufs = [self._gathered(buf, whole) for _, buf, whole in posted]
            if len(bufs) == 1:
                return bufs[0]
            whole = torch.cat(bufs)
        for buf in bufs:  # an all-gather's output: gloo's worker thread may still hold it (memtrack.release)
            self.tracker.release(buf)
        return whole

    def _gathered(self, buf: torch.Tensor, whole: tuple[int, ...]) -> torch.Tensor:
        """A received boundary piece; a scattered one (1/t of it, Narayanan et al. SC'21 §4.1)
        all-gathered over this replica's tp group, in tp-rank order, back into its whole shape."""
        if buf.shape == whole:
            return buf
        out = torch.empty(whole, device=buf.device, dtype=buf.dtype)
        dist.all_gather_single(out.view(-1), buf, group=self.tp_group)
        self.tracker.release(buf)  # gloo's worker thread may still hold it (memtrack.release)
        return out

    def recv(self, kind: str, k: int, peer: int, tail: tuple[int, ...]) -> torch.Tensor:
        return self.wait_recv(self.post_recv(kind, k, peer, tail))

    def wait_sends(self) -> None:
        self.sends.drain()
        if self.swapper is not None and self.swapper.d2d is not None:
            self.swapper.d2d.reaper.drain()
