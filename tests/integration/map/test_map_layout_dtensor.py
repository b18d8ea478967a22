"""MAP layout conversions (costs.map_layout) executed by DTensor on 4 gloo ranks (a 2x2 CPU mesh).

For each (src, dst): distribute a known tensor as src, apply the planned path one step at a time
with ``redistribute`` to each intermediate spec's placements, and compare every rank's shard with
what ``distribute_tensor`` gives for that spec directly — bit for bit (steps only move data) — and
the gathered tensor with the original. This pins the axis-order semantics the planner assumes
(``Shard(i)`` on two axes splits in ascending axis order) and that DTensor runs every planned step
as one collective (a shard step as none). Also checks ``peak_bytes`` against the largest shard held.
"""
from __future__ import annotations

import itertools
import os
import queue as queue_mod
import socket
import time
import traceback

import pytest

from costs.map_layout import convert, valid_specs
from executor.sharding import to_dtensor_placements
from specs.sharding import Mesh, MeshAxis, ShardingSpec

pytestmark = pytest.mark.slow

WORLD, MESH_SHAPE = 4, (2, 2)
MESH = Mesh((MeshAxis(2, 1e-5, 1e11), MeshAxis(2, 2e-5, 2.5e10)))


def _cases() -> list[tuple[tuple[int, ...], str, str]]:
    """Every pair for a 2-D tensor (81), and 3-D pairs that move a two-axis dim or both axes."""
    two_d = [((8, 12), str(a), str(b)) for a, b in itertools.product(valid_specs((8, 12), MESH_SHAPE), repeat=2)]
    three_d = [((4, 8, 12), a, b) for a, b in [
        ("S01RR", "RRS01"), ("S0S1R", "RS1S0"), ("RS01R", "S1RS0"), ("S1RS0", "RS01R"),
        ("RRS01", "S0RS1"), ("S0RS1", "RRR"), ("RRR", "RS01R"), ("S1S0R", "S01RR"),
    ]]
    return two_d + three_d


def _rank(rank: int, port: int, cases, results) -> None:
    """One rank: run every case, report the failures (strings) or the exception."""
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.debug import CommDebugMode

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", MESH_SHAPE)
        failures, steps_run = [], 0
        for shape, src, dst in cases:
            full = torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape)
            conv = convert(src, dst, shape, full.element_size(), MESH)
            dt = distribute_tensor(full, mesh, to_dtensor_placements(conv.path[0], 2))
            held = [dt.to_local().nbytes]
            for spec, step in zip(conv.path[1:], conv.steps):
                with CommDebugMode() as comm:
                    dt = dt.redistribute(mesh, to_dtensor_placements(spec, 2))
                steps_run += 1
                # a shard is a local slice; an all-gather or all-to-all one collective (gloo has no
                # all-to-all: DTensor runs it as all-gather + chunk on CPU, still one collective)
                want_calls = 0 if step.op == "shard" else 1
                if comm.get_total_counts() != want_calls:
                    failures.append(f"{src}->{dst}: {step} to {spec} ran {comm.get_total_counts()} collectives, "
                                    f"not {want_calls}")
                want = distribute_tensor(full, mesh, to_dtensor_placements(spec, 2)).to_local()
                got = dt.to_local()
                if got.shape != want.shape or not torch.equal(got, want):
                    failures.append(f"{src}->{dst}: after {step} to {spec} rank {rank} holds {tuple(got.shape)}, "
                                    f"distribute_tensor gives {tuple(want.shape)} (or other values)")
                held.append(got.nbytes)
            if not torch.equal(dt.full_tensor(), full):
                failures.append(f"{src}->{dst}: full_tensor() differs from the original")
            if max(held) != conv.peak_bytes:
                failures.append(f"{src}->{dst}: largest shard {max(held)} B, planned peak {conv.peak_bytes} B")
        dist.destroy_process_group()
        results.put((rank, "ok", (failures, steps_run)))
    except BaseException:  # report, never hang the parent
        results.put((rank, "error", traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cases, timeout_s: float = 180.0) -> dict[int, tuple]:
    """Spawn the ranks (fresh interpreters, as executor.launch does) and collect their reports."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, cases, results), daemon=True) for r in range(WORLD)]
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


def test_planned_paths_redistribute_to_distribute_tensors_layout():
    cases = _cases()
    # the planner's side first (no ranks needed): the 3-D cases include multi-step paths
    assert max(len(convert(a, b, s, 8, MESH).steps) for s, a, b in cases) >= 2
    assert all(ShardingSpec.parse(a).valid_for(s, MESH_SHAPE) for s, a, _ in cases)
    reports = run_ranks(cases)
    errors = {r: p for r, (st, p) in reports.items() if st == "error"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert sorted(reports) == list(range(WORLD)), f"only ranks {sorted(reports)} reported"
    for rank, (_, (failures, steps_run)) in reports.items():
        assert not failures, "\n".join(failures[:10])
        assert steps_run > len(cases)  # most pairs take at least one step


if __name__ == "__main__":  # run the ranks without pytest: python tests/integration/map/test_map_layout_dtensor.py
    out = run_ranks(_cases())
    for r, (status, payload) in sorted(out.items()):
        print(r, status, payload if status == "error" else (payload[0][:5], payload[1]))
