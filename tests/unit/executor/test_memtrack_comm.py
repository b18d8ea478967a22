"""executor.memtrack: a functional collective's output freed by another thread (gloo's worker,
which lets a finished work go after the caller's ``wait`` returned) is counted as freed at its last
use on the rank's own thread; a free on that thread stays where it happens. One gloo rank, the real
``_c10d_functional`` operator; a second Python thread stands in for gloo's worker holding the last
reference, so the race the tracker corrects is made certain instead of waited for."""
from __future__ import annotations

import threading

import pytest
import torch

from executor.memtrack import LiveTensorTracker

N = 1024  # elements; 4 KiB in float32


@pytest.fixture(scope="module")
def group_name():
    import torch.distributed as dist

    from calibration.link_bench import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _gathered(group_name: str) -> torch.Tensor:
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_gather_into_tensor(torch.ones(N), 1, group_name))


def _run(group_name: str, free_on_other_thread: bool) -> LiveTensorTracker:
    tracker = LiveTensorTracker()
    held = []  # what the communication thread still holds
    with tracker:
        x = torch.ones(N)  # 4 KiB
        g = _gathered(group_name)  # its input (4 KiB) is a temporary, gone at once
        held.append(g)
        y = g * 2  # the gathered buffer's last use: 4 KiB
        del g  # the program lets it go; `held` keeps it alive
        z = torch.ones(3 * N)  # 12 KiB, allocated while the gathered buffer is still alive
        if free_on_other_thread:
            t = threading.Thread(target=held.clear)
            t.start()
            t.join()
        else:
            held.clear()
        assert tracker.total_bytes == 4 * N * (1 + 1 + 3)
        del x, y, z
    return tracker


def test_a_collective_output_freed_by_another_thread_counts_as_freed_at_its_last_use(group_name):
    tracker = _run(group_name, free_on_other_thread=True)
    # x + y + z: the gathered 4 KiB not counted beside z
    assert tracker.peak_bytes == 4 * N * (1 + 1 + 3)
    assert tracker.peak_breakdown["activations"] == 4 * N * 5
    assert tracker.comm_lag_bytes == 4 * N


def test_a_collective_output_freed_by_the_program_counts_until_then(group_name):
    tracker = _run(group_name, free_on_other_thread=False)
    assert tracker.peak_bytes == 4 * N * (1 + 1 + 1 + 3)  # the program held it beside z
    assert tracker.peak_breakdown["activations"] == 4 * N * 6
    assert tracker.comm_lag_bytes == 0


def test_a_collective_output_in_use_is_never_moved(group_name):
    """Freed by another thread but used on this one after z was made: it was the program's until
    that use, so z's allocation keeps counting it."""
    tracker = LiveTensorTracker()
    held = []
    with tracker:
        g = _gathered(group_name)
        held.append(g)
        z = torch.ones(3 * N)
        y = g + 1  # last use after z
        del g
        t = threading.Thread(target=held.clear)
        t.start()
        t.join()
        del y, z
    assert tracker.peak_bytes == 4 * N * (1 + 3 + 1)


def test_a_collective_output_used_through_its_views_is_never_moved(group_name):
    """DTensor's all-gather along a non-leading dimension chunks the raw buffer and cats the chunks:
    a use through a view is a use of the buffer. Freed by another thread after the cat, which ran
    after z was made, it counted beside z and the cat's output (the tracker matches inputs by
    their tensor objects, a view registered when it is made; a revert to matching the buffer
    itself only would move the free back to the chunk, before z, and fail here)."""
    tracker = LiveTensorTracker()
    held = []
    with tracker:
        g = _gathered(group_name)
        held.append(g)
        a, b = g.chunk(2)
        z = torch.ones(3 * N)
        y = torch.cat([b, a])  # last use, through the views, after z
        del g, a, b
        t = threading.Thread(target=held.clear)
        t.start()
        t.join()
        del y, z
    assert tracker.peak_bytes == 4 * N * (1 + 3 + 1)
    assert tracker.comm_lag_bytes == 0
