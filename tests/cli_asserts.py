"""Assertions on a ``python -m run`` subprocess shared by the shell's integration tests."""
from __future__ import annotations

import subprocess


def one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str, prefix: str = "memwall: ") -> str:
    """``proc`` ended in exit status 2 with exactly one stderr line, starting with ``prefix`` and
    containing every needle, and no traceback or internal error; returns that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
