"""executor.memtrack ``release``: a temporary whose last use is done is forgotten and freed at the
call, not when the last reference goes (gloo's worker thread can hold a collective's tensors a
moment past their wait, which made a measured peak differ from run to run)."""
from __future__ import annotations

import torch

from executor.memtrack import LiveTensorTracker, NullTracker


def test_release_frees_at_the_call_even_with_another_reference_alive():
    tracker = LiveTensorTracker()
    with tracker:
        with tracker.phase("buffers"):
            flat = torch.zeros(1024)
        held_elsewhere = flat  # what gloo's worker thread would still hold
        assert tracker.total_bytes == 4096 and tracker.totals["buffers"] == 4096
        tracker.release(flat)
        assert tracker.total_bytes == 0 and tracker.totals["buffers"] == 0
        assert held_elsewhere.untyped_storage().nbytes() == 0
        with tracker.phase("buffers"):
            other = torch.ones(1024)
        assert tracker.peak_bytes == 4096  # the two were never counted together
        del held_elsewhere, flat  # the storage's finalizer runs now: nothing counted twice
        assert tracker.total_bytes == 4096
        del other
    assert tracker.total_bytes == 0


def test_null_tracker_leaves_the_tensor_alone():
    t = torch.ones(8)
    NullTracker().release(t)
    assert t.untyped_storage().nbytes() == 32 and float(t.sum()) == 8.0
