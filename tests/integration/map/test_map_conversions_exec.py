"""Executed = priced (issue 26 item 4) on 4 gloo ranks (a 2x2 CPU mesh): the executor's layout
conversion (executor.map_layout.planned_redistribute, what ShardedLayer runs before a group reads
a value) performs costs.map_layout.convert's step sequence, forward and, for the gradient,
convert(dst, src)'s — recorded step by step and counted as collectives — with the values and the
gradients of DTensor's direct ``redistribute``, bit for bit (steps only move data; float64). A
gradient that arrives with a pending partial sum (the reader's backward reduction) is reduced
into the target layout first, then runs the priced path."""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import pytest

from costs.map_layout import convert
from specs.sharding import Mesh, MeshAxis

pytestmark = pytest.mark.slow  # 4 spawned ranks: ~40-80 s on 2 loaded cores

WORLD, MESH_SHAPE = 4, (2, 2)
# axis 1 slower than axis 0, so the pricing, not the axis order, picks among equal-step paths
PRICE = Mesh((MeshAxis(2, 1e-5, 1e11), MeshAxis(2, 2e-5, 2.5e10)))
CASES = [((8, 12), "S01R", "RS01"), ((8, 12), "S0S1", "S1S0"), ((8, 12), "S0R", "RS0"),
         ((8, 12), "RR", "S01R"), ((8, 12), "S01R", "RR"), ((4, 8, 12), "S0S1R", "RS1S0"),
         ((4, 8, 12), "S01RR", "RRS01"), ((4, 8, 12), "RS01R", "S1RS0")]


def _rank(rank: int, port: int, results) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.debug import CommDebugMode

        from executor.map_layout import planned_redistribute
        from executor.sharding import to_dtensor_placements

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", MESH_SHAPE)
        out = []
        for shape, src, dst in CASES:
            n = torch.Size(shape).numel()
            full = torch.arange(float(n), dtype=torch.float64).reshape(shape)
            weight = torch.linspace(-1.0, 2.0, n, dtype=torch.float64).reshape(shape)  # the loss's upstream gradient
            src_pl, dst_pl = to_dtensor_placements(src, 2), to_dtensor_placements(dst, 2)
            w = distribute_tensor(weight, mesh, dst_pl)
            runs = {}
            for how in ("planned", "direct"):
                x = distribute_tensor(full, mesh, src_pl).requires_grad_(True)
                log, events = {}, []
                with CommDebugMode() as comm:
                    y = planned_redistribute(x, tuple(dst_pl), mesh, PRICE, log, (0, "g in0"), events) \
                        if how == "planned" else x.redistribute(mesh, dst_pl)
                calls = comm.get_total_counts()
                (y * w).sum().backward()
                runs[how] = (y.to_local().clone(), x.grad.to_local().clone(), calls, log, events,
                             tuple(y.placements) == tuple(dst_pl))
            (py, pg, pcalls, log, events, pl_ok), (dy, dg, dcalls, _, _, _) = runs["planned"], runs["direct"]
            out.append({"case": (shape, src, dst), "log": log, "calls": pcalls, "direct_calls": dcalls,
                        "kinds": [e[0] for e in events], "placements_ok": pl_ok,
                        "values_equal": torch.equal(py, dy), "grads_equal": torch.equal(pg, dg),
                        "grad_is_weight": torch.equal(pg, distribute_tensor(weight, mesh, src_pl).to_local())})
        # a reader whose backward leaves a partial sum: y (S0R) @ w split by columns on axis 1 gives
        # y's gradient whole on axis 0 and Partial on axis 1 ([R, P]); it is brought into S0R (a
        # slice, a reduction), then the priced path runs
        full = torch.arange(96.0, dtype=torch.float64).reshape(8, 12)
        w_full = torch.arange(-20.0, 28.0, dtype=torch.float64).reshape(12, 4)  # integers: every sum exact
        w = distribute_tensor(w_full, mesh, [Replicate(), Shard(1)])
        grads, log = {}, {}
        for how in ("planned", "direct"):
            x = distribute_tensor(full, mesh, to_dtensor_placements("S01R", 2)).requires_grad_(True)
            want = to_dtensor_placements("S0R", 2)
            y = planned_redistribute(x, tuple(want), mesh, PRICE, log, (1, "mm in0"), []) \
                if how == "planned" else x.redistribute(mesh, want)
            (y @ w).sum().backward()
            grads[how] = x.grad.to_local().clone()
        partial = {"log": log, "grads_equal": torch.equal(grads["planned"], grads["direct"]),
                   "grad_is_right": torch.equal(grads["planned"], distribute_tensor(
                       w_full.sum(1).expand(8, 12).contiguous(), mesh, to_dtensor_placements("S01R", 2)).to_local())}
        dist.destroy_process_group()
        results.put((rank, "ok", (out, partial)))
    except BaseException:  # report, never hang the parent
        results.put((rank, "error", traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(timeout_s: float = 180.0) -> dict[int, tuple]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    reports: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < WORLD and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reports]
                if dead:
                    raise AssertionError(f"ranks {dead} exited without a report")
                continue
            reports[rank] = (status, payload)
            if status == "error":
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return reports


def _text(conv) -> str:
    return f"{conv.path[0]}->{conv.path[-1]}: " + (", ".join(map(str, conv.steps)) or "none")


def test_executed_conversion_steps_are_the_priced_ones_with_redistributes_numerics():
    reports = run_ranks()
    errors = {r: p for r, (st, p) in reports.items() if st == "error"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert sorted(reports) == list(range(WORLD)), f"only ranks {sorted(reports)} reported"
    for rank, (_, (rows, partial)) in reports.items():
        back = convert("S0R", "S01R", (8, 12), 8, PRICE)
        want = f"S0R->S01R: slice(axis 0, dim 0), reduce_partial(axis 1), {', '.join(map(str, back.steps))}"
        assert partial["log"][(1, "mm in0 grad")] == want, (rank, partial["log"])
        assert partial["grads_equal"] and partial["grad_is_right"], (rank, partial)
        assert len(rows) == len(CASES)
        for row in rows:
            shape, src, dst = row["case"]
            fwd, back = convert(src, dst, shape, 8, PRICE), convert(dst, src, shape, 8, PRICE)
            where = f"rank {rank} {src}->{dst} {shape}"
            assert row["log"] == {(0, "g in0"): _text(fwd), (0, "g in0 grad"): _text(back)}, where
            # one collective per non-shard step (gloo runs an all-to-all as one all-gather + chunk)
            assert row["calls"] == sum(s.op != "shard" for s in fwd.steps), (where, row["calls"], fwd.steps)
            assert row["kinds"] == ["convert", "convert_grad"], where
            assert row["placements_ok"] and row["values_equal"] and row["grads_equal"] and row["grad_is_weight"], \
                (where, row)
    # multi-step paths are exercised (the point: each step is its own priced collective)
    assert max(len(convert(a, b, s, 8, PRICE).steps) for s, a, b in CASES) >= 3


if __name__ == "__main__":  # python tests/integration/map/test_map_conversions_exec.py: print what ran
    for r, (status, payload) in sorted(run_ranks().items()):
        if status == "error":
            print(r, payload)
        elif r == 0:
            print(payload[1]["log"])
            for row in payload[0]:
                print(row["case"], "planned", row["calls"], "collectives, direct", row["direct_calls"], "|",
                      row["log"][(0, "g in0")])
