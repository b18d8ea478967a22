"""Byte-identity of memwall's outputs between two checkouts (issue 21: "nothing changes for users").

Runs every deterministic command the README quotes (simulate/profile modes and one sweep) and every
``experiment=`` preset inside a checkout, keeps each job's JSON outputs (plan.json, results.json
and the planners' reports), and diffs two such snapshots byte for byte:

    python benchmarks/output_identity.py snapshot --repo OLD_CHECKOUT --out /tmp/snap_old
    python benchmarks/output_identity.py snapshot --repo .            --out /tmp/snap_new
    python benchmarks/output_identity.py diff /tmp/snap_old /tmp/snap_new
    python benchmarks/output_identity.py snapshot --out /tmp/part --only main experiment_mpress_gpt_5b3_dgx1
    python benchmarks/output_identity.py diff /tmp/snap_old /tmp/part --subset

Measured modes (execute, compare, calibrate) are left out: they time this machine, so two runs of
the same commit already differ. Each side gets its own profile cache, so neither reads what the
other traced. A path under the snapshot folder is written as ``<out>`` before hashing, so the two
sides' folders do not count as a difference. Stands alone (no memwall import): it also runs on a
checkout that predates it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

#: the README's deterministic commands (their arguments after ``python -m run``)
README_RUNS = {
    "main": "+hardware=dgx1 +model=gpt",
    "gpipe": "+hardware=dgx1 +model=gpt schedule=gpipe",
    "bert_even_full": "+hardware=dgx1 +model=bert_1b67 policy=even policy.recompute=full",
    "selene_175b_manual": "+hardware=selene hardware.nodes=128 +model=gpt3_175b policy=manual policy.pp=16 "
                          "policy.tp=8 policy.dp=8 training.global_batch=512 training.microbatch_size=8",
    "mpress_gpt_10b3": "+hardware=dgx1 +model=gpt_10b3 policy=mpress",
    "map_2b6_20gib": "+hardware=map_8xa100 +model=gpt3_2b6 policy=map policy.memory_budget_gib=20",
    "capture_pipeline_only": "experiment=capture_gpt3_6b7 schedule=gpipe policy.pipeline_only=true",
    "analytic": "+hardware=dgx1 +model=gpt estimator=analytic",
    "throughput": "+hardware=dgx1 +model=gpt policy=throughput",
    "stronghold_default": "+hardware=v100_single +model=gpt policy=stronghold",
    "profile_175b": "mode=profile +hardware=dgx1 +model=gpt3_175b",
}
#: the README's sweep (one multirun folder)
README_SWEEPS = {"sweep_hw_model": "-m +hardware=dgx1,dgx2 +model=gpt,bert"}
KEEP_SUFFIXES = (".json", ".csv")
#: wall-clock seconds a planner or profiler measures of itself (map.json's solve_s, profile.json's
#: profile_time_s): two runs of one commit differ there, so they are blanked before hashing and the
#: file's other bytes are compared; plan.json and results.json hold none and are hashed as written
WALL_CLOCK_KEYS = frozenset({"solve_s", "profile_time_s"})


def _blank_wall_clock(node):
    if isinstance(node, dict):
        return {k: (None if k in WALL_CLOCK_KEYS else _blank_wall_clock(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_blank_wall_clock(v) for v in node]
    return node


def _digest(path: Path, out: Path) -> str:
    data = path.read_bytes().replace(str(out).encode(), b"<out>")
    if path.name not in ("plan.json", "results.json") and path.suffix == ".json":
        text = json.loads(data)
        blanked = _blank_wall_clock(text)
        if blanked != text:
            data = json.dumps(blanked, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def _commands(repo: Path) -> dict[str, tuple[str, bool]]:
    cmds = {k: (v, False) for k, v in README_RUNS.items()}
    cmds.update({k: (v, True) for k, v in README_SWEEPS.items()})
    for y in sorted((repo / "conf" / "experiment").glob("*.yaml")):
        cmds[f"experiment_{y.stem}"] = (f"experiment={y.stem}", False)
    return cmds


def snapshot(repo: Path, out: Path, only: list[str] | None = None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    cmds = _commands(repo)
    failed = 0
    for name, (args, sweep) in cmds.items():
        if only and name not in only:
            continue
        job = out / "jobs" / name
        where = f"hydra.sweep.dir={job}" if sweep else f"hydra.run.dir={job}"
        argv = [sys.executable, "-m", "run", *args.split(), where, f"profile_cache={out / 'cache'}"]
        t0 = time.perf_counter()
        p = subprocess.run(argv, cwd=repo, capture_output=True, text=True)
        (out / "logs").mkdir(exist_ok=True)
        (out / "logs" / f"{name}.txt").write_text(f"$ {' '.join(argv)}\nexit {p.returncode}\n{p.stdout}\n{p.stderr}")
        print(f"{name:40s} exit {p.returncode}  {time.perf_counter() - t0:6.1f} s", flush=True)
        failed += p.returncode not in (0, 3)  # 3: the plan does not fit (modes.NOT_FIT_STATUS); its files are compared
    digests = rehash(out)
    print(f"{len(digests)} files hashed from {len(cmds)} commands; {failed} exited non-zero (see logs/)")
    return 0


def rehash(out: Path) -> dict[str, str]:
    """Hash an existing snapshot's files again (after a change to what is hashed)."""
    digests = {str(f.relative_to(out / "jobs")): _digest(f, out) for f in sorted((out / "jobs").rglob("*"))
               if f.is_file() and f.suffix in KEEP_SUFFIXES and ".hydra" not in f.parts}
    (out / "digests.json").write_text(json.dumps(digests, indent=1, sort_keys=True))
    return digests


def diff(a: Path, b: Path, subset: bool = False) -> int:
    """Compare two snapshots; ``subset``: only the jobs that ``b`` ran (a partial ``--only`` run)."""
    da = json.loads((a / "digests.json").read_text())
    db = json.loads((b / "digests.json").read_text())
    if subset:
        ran = {k.split("/")[0] for k in db}
        da = {k: v for k, v in da.items() if k.split("/")[0] in ran}
    only_a, only_b = sorted(set(da) - set(db)), sorted(set(db) - set(da))
    changed = sorted(k for k in set(da) & set(db) if da[k] != db[k])
    for k in only_a:
        print(f"only in {a}: {k}")
    for k in only_b:
        print(f"only in {b}: {k}")
    for k in changed:
        print(f"differs: {k}")
    same = len(set(da) & set(db)) - len(changed)
    jobs = {k.split("/")[0] for k in da}
    print(f"{same} of {len(set(da) | set(db))} files byte-identical over {len(jobs)} jobs")
    return 1 if (only_a or only_b or changed) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--repo", type=Path, default=Path("."))
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--only", nargs="*")
    r = sub.add_parser("rehash")
    r.add_argument("out", type=Path)
    d = sub.add_parser("diff")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    d.add_argument("--subset", action="store_true", help="only the jobs that B ran (a snapshot made with --only)")
    ns = ap.parse_args()
    if ns.cmd == "snapshot":
        return snapshot(ns.repo.resolve(), ns.out.resolve(), ns.only)
    if ns.cmd == "rehash":
        rehash(ns.out.resolve())
        return 0
    return diff(ns.a, ns.b, ns.subset)


if __name__ == "__main__":
    sys.exit(main())
