"""GPU tests: enforced deterministic kernels, so that two runs of one plan can be compared bit for bit.

Why (issue 24, tests/gpu/test_executor_swap_gpu.py's flaky gradient check): under
``torch.use_deterministic_algorithms(True, warn_only=True)`` the fused attention kernels only warn
and keep their non-deterministic backward. SDPA on float32 CUDA tensors runs the memory-efficient
kernel, whose backward splits the keys (``num_splits_key > 1``) and accumulates dQ across the
splits in whatever order the blocks finish; only ``warn_only=False`` forces one split (PyTorch's
attention_backward.cu, and its SDPA determinism notes). Every gradient upstream of an attention's
dQ then differs between two runs of the same plan by a few float32 ulps, and the optimizer step
between the iterations (Adam's first step is lr·g/(|g| + eps), about ±lr whatever |g| is) turns
the elements whose gradient is within that noise of zero into whole ±lr moves of the weights, so
the compared iteration's gradients differ by steps far above rounding, in some runs and not others.
Measured on CPU with test_executor_swap_gpu.py's model and plan (h = 1024, deterministic kernels):
adding one float32 eps of each tensor's max |g|, at random signs, to iteration 1's gradients
flips 3 of their 25 M signs and moves iteration 2's ``block_00.attn.proj.weight`` gradient by
0.134 on max |g| 68.7 (the H200's failure: 0.133 on |g| ≈ 68). With ``warn_only=False`` an op
without a deterministic implementation raises instead of passing silently, and two runs of one
plan can be compared bit for bit.

cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` (":4096:8" or ":16:8") under enforced determinism, read
once, at the process's first GEMM (PyTorch's ``Context::alertCuBLASConfigNotDeterministic`` caches
it): it is set here, at collection, before any test runs a kernel. ":4096:8" is the 32 MiB
workspace PyTorch already gives cuBLAS on sm90 (H100/H200); on older GPUs it raises the default
8 MiB + 128 KiB to 32 MiB per handle and stream, which ``test_executor_gpu.py`` subtracts with the
rest of what stays allocated after a run.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

#: the two settings cuBLAS documents as reproducible (one workspace per handle and stream)
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])


@contextlib.contextmanager
def deterministic_kernels(enforce: bool = True):
    """Deterministic algorithms on (``enforce``: ``warn_only=False``, the fix; ``False``: the old
    ``warn_only=True``, which leaves the fused attention backward non-deterministic), cuDNN
    deterministic and not benchmarking; the previous settings come back on exit."""
    if enforce and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        raise RuntimeError(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}: enforced "
                           f"determinism needs one of {DETERMINISTIC_CUBLAS}, set before the process's first GEMM")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=not enforce)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


@pytest.fixture
def cuda_deterministic():
    """Enforced deterministic kernels for one test (:func:`deterministic_kernels`)."""
    with deterministic_kernels(enforce=True):
        yield
