"""Issue 12's local_cpu check, end to end through the CLI: policy=mpress on gpt_tiny with device
memory at 80 % of the no-swap run's largest measured peak. The plan must swap for real: the
measured peaks of the stages that compact fall below the no-swap run's, any D2D targets' rise
above theirs, and every rank's measured peak is within 10 % of the simulated one (issue 12 goal;
the fidelity goal elsewhere is 3 %).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def run_cli(tmp_path: Path, out: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt_tiny", *args,
                           "execute.iterations=1", f"hydra.run.dir={out}", f"profile_cache={tmp_path / 'cache'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_mpress_swaps_for_real_on_local_cpu(tmp_path):
    plain = run_cli(tmp_path, tmp_path / "plain", "policy=balanced", "mode=execute")
    before = {d["device"]: d["peak_bytes"] for d in plain["measured"]["devices"]}
    budget = int(0.8 * max(before.values()))
    got = run_cli(tmp_path, tmp_path / "mpress", "policy=mpress", "mode=compare",
                  f"hardware.device.memory_bytes={budget}")
    plan, compare = got["plan"], got["compare"]
    after = {d["device"]: d["peak_bytes"] for d in got["measured"]["devices"]}
    sources = {st["devices"][0] for st in plan["stages"] if st["memory"] or st["offload"]["optimizer_swap"]}
    targets = {t["device"] for st in plan["stages"] for m in st["memory"] for t in m["targets"]}
    # whether peers can hold a D2D share turns on the measured budget: since issue 23's swap model
    # (a swap moves the saved bytes less the received input, a CPU rank's copy is a memcpy) the
    # peers' spare memory at 80 % can be too small for D2D alone (measured: "does not fit" with
    # policy.techniques=[d2d_swap]) and MPress CPU-swaps instead; D2D on gloo runs for real in
    # tests/integration/executor/test_executor_swap.py
    assert sources, "the planner compacted nothing"
    for d in sources:
        assert after[d] < before[d], f"source device {d}: {after[d]} >= {before[d]} without swaps"
    for d in targets - sources:
        assert after[d] > before[d], f"target device {d}: {after[d]} <= {before[d]} without swaps"
    for r in compare["ranks"]:
        assert abs(r["error_pct"]) <= 10.0, r
    assert max(after.values()) <= budget


def test_mpress_starts_from_captures_partition(tmp_path):
    """policy.partition=capture: CAPTURE profiles (simulator backend for a DGX-1 not here), its
    pipeline-only plan is MPress's start; the result fits and says where it started."""
    out = tmp_path / "cap"
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=dgx1", "+model=gpt_10b3", "policy=mpress",
                           "policy.partition=capture", f"hydra.run.dir={out}", f"profile_cache={tmp_path / 'cache'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "mpress.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    balanced = {0: 5, 7: 5}  # the compute-balanced split's first and last stage sizes (layers 0-4, 29-33)
    sizes = {i: st["layer_stop"] - st["layer_start"] for i, st in enumerate(plan["stages"])}
    assert report["fits"] and plan["planner"] == "mpress"
    assert any(sizes[i] != n for i, n in balanced.items())  # CAPTURE balances memory, not FLOPs
