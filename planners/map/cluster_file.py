"""``policy.cluster=PATH``: the measured cluster (mode=calibrate's cluster.json, MAP §4.2) as the
planner's mesh.

cluster.json (calibration.cluster.cluster_json) holds the all-pairs alpha-beta matrices the detector
groups (``devices``, ``beta_bytes_per_s``, ``alpha_s``) and, per axis of the mesh they imply, the
all-reduce bus bandwidth measured over that axis's device lines (``axis_allreduce``: MAP §4.2's
detector "measures the all-reduce bus bandwidth" per candidate axis). :func:`cluster_mesh` gives a
stage's mesh shape, its device order and per-axis alpha/beta: the measured all-reduce fit when the
file has one for that axis (same shape and device order), else the slowest measured pair along the
axis (planners.map.cluster's rule). The hardware YAML's links are used only when no cluster is
given (planners.map.plan.choose_mesh).

A malformed file is refused with the field named (ValueError); :func:`load_cluster` is the one read
the planner does (the file named by the config, like the config itself).
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

from planners.map.cluster import DetectedMesh, _axis, _sym, detect_mesh
from specs.sharding import Mesh, MeshAxis

#: what a cluster file must hold (calibration.cluster.cluster_json writes more: pairs, tiers, mesh)
REQUIRED = ("devices", "beta_bytes_per_s", "alpha_s")


def _fail(path: str, field: str, why: str) -> ValueError:
    return ValueError(f"policy.cluster: {path}: field {field!r}: {why}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_cluster(data, path: str = "cluster.json") -> dict:
    """``data`` (a parsed cluster.json) checked field by field; returns it. Raises ValueError naming
    the first bad field: a missing one, devices not distinct integers, a matrix not n x n, an
    off-diagonal bandwidth not a finite positive bytes/s, a latency not finite >= 0 s, a malformed
    ``axis_allreduce`` entry."""
    if not isinstance(data, dict):
        raise _fail(path, "<top>", f"expected a JSON object, got {type(data).__name__}")
    for f in REQUIRED:
        if f not in data:
            raise _fail(path, f, "missing (mode=calibrate writes it; see calibration/cluster.py)")
    devs = data["devices"]
    if not isinstance(devs, list) or len(devs) < 2 or not all(isinstance(d, int) and not isinstance(d, bool) for d in devs) \
            or len(set(devs)) != len(devs):
        raise _fail(path, "devices", f"expected >= 2 distinct integer device ids, got {devs!r}")
    n = len(devs)
    for f, positive in (("beta_bytes_per_s", True), ("alpha_s", False)):
        m = data[f]
        if not isinstance(m, list) or len(m) != n or any(not isinstance(r, list) or len(r) != n for r in m):
            raise _fail(path, f, f"expected a {n} x {n} matrix (one row and column per device)")
        for i, j in itertools.permutations(range(n), 2):
            v = m[i][j]
            if not _number(v) or (v <= 0 if positive else v < 0):
                want = "a finite bandwidth > 0 in bytes/s" if positive else "a finite latency >= 0 in s"
                raise _fail(path, f"{f}[{i}][{j}]", f"{v!r}; expected {want}")
    for k, entry in enumerate(data.get("axis_allreduce") or []):
        where = f"axis_allreduce[{k}]"
        if not isinstance(entry, dict):
            raise _fail(path, where, "expected an object")
        for f in ("shape", "devices", "axis", "busbw_bytes_per_s", "alpha_s"):
            if f not in entry:
                raise _fail(path, f"{where}.{f}", "missing")
        if not isinstance(entry["shape"], list) or not all(isinstance(s, int) and s >= 1 for s in entry["shape"]):
            raise _fail(path, f"{where}.shape", f"expected a list of axis sizes, got {entry['shape']!r}")
        if sorted(entry["devices"]) != sorted(devs) or math.prod(entry["shape"]) != n:
            raise _fail(path, f"{where}.devices", "expected the file's devices in mesh order over shape")
        if not (isinstance(entry["axis"], int) and 0 <= entry["axis"] < len(entry["shape"])):
            raise _fail(path, f"{where}.axis", f"{entry['axis']!r} is not an axis of {entry['shape']}")
        if not _number(entry["busbw_bytes_per_s"]) or entry["busbw_bytes_per_s"] <= 0:
            raise _fail(path, f"{where}.busbw_bytes_per_s", f"{entry['busbw_bytes_per_s']!r}; expected > 0 bytes/s")
        if not _number(entry["alpha_s"]) or entry["alpha_s"] < 0:
            raise _fail(path, f"{where}.alpha_s", f"{entry['alpha_s']!r}; expected >= 0 s")
    return data


def load_cluster(path: str | Path) -> dict:
    """Read and check a cluster.json (ValueError naming the field or the file's problem)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"policy.cluster: {p}: no such file (write one with mode=calibrate)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"policy.cluster: {p}: not JSON ({exc})") from None
    return check_cluster(data, str(p))


def cluster_mesh(data: dict, devices: Sequence[int], shape: Sequence[int] | None = None) -> DetectedMesh:
    """The mesh of ``devices`` (a subset of the file's) from a checked cluster file: detected from
    the measured pairs (MAP §4.2), or of ``shape`` (policy.mesh) over ``devices`` in their order.
    Per axis: the measured all-reduce fit when ``axis_allreduce`` has that axis for this shape and
    device order (alpha per ring step, bus bandwidth), else the slowest pair along the axis."""
    labels = list(data["devices"])
    missing = [d for d in devices if d not in labels]
    if missing:
        raise ValueError(f"policy.cluster: devices {missing} are not in the cluster file's devices {labels}")
    rows = [labels.index(d) for d in devices]
    beta = [[data["beta_bytes_per_s"][i][j] for j in rows] for i in rows]
    alpha = [[data["alpha_s"][i][j] for j in rows] for i in rows]
    if shape is None:
        found = detect_mesh(beta, alpha, tuple(devices))
    else:
        n = len(devices)
        bw, lat = _sym(beta, n, min), _sym(alpha, n, max)
        found = DetectedMesh(tuple(shape), tuple(devices),
                             Mesh(tuple(_axis(tuple(shape), k, bw, lat) if s > 1 else MeshAxis(1, 0.0, math.inf)
                                        for k, s in enumerate(shape))))
    measured = {e["axis"]: e for e in data.get("axis_allreduce") or []
                if tuple(e["shape"]) == found.shape and tuple(e["devices"]) == found.devices}
    axes = tuple(MeshAxis(ax.size, measured[k]["alpha_s"], measured[k]["busbw_bytes_per_s"]) if k in measured else ax
                 for k, ax in enumerate(found.mesh.axes))
    return DetectedMesh(found.shape, found.devices, Mesh(axes))


__all__ = ["REQUIRED", "check_cluster", "cluster_mesh", "load_cluster"]
