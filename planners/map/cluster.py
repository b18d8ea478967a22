"""MAP's cluster detector, the pure half (MAP §4.2): an all-pairs bandwidth table -> a logical mesh.

MAP §4.2: "devices on the same axis [must] have the same communication performance as each other,
otherwise, the device with the lowest bandwidth will slow down communication". On MAP's testbed
(§7, conf/hardware/map_8xa100.yaml) only the pairs 0-1, 2-3, 4-5, 6-7 have NVLink (>200 GB/s),
other pairs in one NUMA half use PCIe (20 GB/s) and pairs across the halves ~10 GB/s, so a flat
8-device axis runs at 10 GB/s while a 2 x 2 x 2 mesh keeps an NVLink axis.

Algorithm (:func:`detect_mesh`), bottom-up, one mesh axis per round:

1. *Tiers.* Every pair's bandwidth is symmetrised (a pair is as fast as its slower direction, and
   its alpha the larger one). The distinct pair bandwidths, sorted descending, are cut into tiers
   wherever two consecutive values differ by more than ``tier_gap`` (default 1.5x). Why 1.5: link
   classes differ by >= 2x (MAP §7: >200, 20, 10 GB/s); measurements within +-10 % of a class value
   span at most 1.1/0.9 = 1.22x, so no gap inside a class exceeds 1.5, while two classes 2x apart
   keep a gap of at least 2 x 0.9/1.1 = 1.64x. A tier's *threshold* is its slowest member.
2. *Groups.* Start with one group per device. Between two groups the bandwidth is the slowest
   device pair across them (the quotient graph's edge).
3. *One axis.* For each tier threshold, fastest first: join groups whose quotient bandwidth is
   >= the threshold, take connected components, and accept the tier if every component has the
   same number k >= 2 of groups and is a clique (every pair of its groups is >= the threshold).
   The accepted components become the next round's groups; k is the size of a new mesh axis,
   outside the axes found before. The slowest tier always qualifies (all groups, one clique), so
   every round makes progress and the loop ends with one group.
4. *Mesh.* Axes come out fastest first; the mesh lists them slowest first (outer to inner), and the
   device order is row-major over that shape, as ``torch.distributed.device_mesh.init_device_mesh``
   lays ranks out: the last (fastest) axis holds consecutive devices of the order. Per axis,
   ``MeshAxis.beta_bytes_per_s`` is the slowest device pair that differs only in that axis's
   coordinate and ``alpha_s`` the largest alpha among those pairs (the slowest member sets a ring
   collective's pace).

Tie-breaks (deterministic: no dict, set or hash order): a group's devices keep the order of the
groups merged into it; groups inside a component are ordered by their first device index, and
components likewise (indices are positions in the input matrix). Sub-groups are aligned by position
(the j-th device of one group faces the j-th of another); the per-axis minimum then prices any
misalignment rather than hiding it.

Known limit: a topology with no equal-clique tier falls back to one axis at the slowest tier. DGX-1's
hybrid cube mesh (conf/hardware/dgx1.yaml: 50 and 25 GB/s NVLink rings inside 10 GB/s PCIe) gives a
flat axis of 8 at 10 GB/s: its 50 GB/s pairs form 4-cycles, not cliques, and splitting them into
matchings is a search this greedy grouping does not do.

Pure: no torch, no I/O. Bandwidths are bytes/s, alphas seconds.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from specs.hardware import HardwareSpec
from specs.sharding import Mesh, MeshAxis

#: consecutive pair bandwidths more than this factor apart start a new tier (see the module docstring)
TIER_GAP = 1.5
#: check_links reports a pair whose YAML bandwidth and measured bandwidth differ by more than this factor
LINK_FACTOR = 2.0

Matrix = Sequence[Sequence[float]]


class DetectedMesh(NamedTuple):
    """``shape``: mesh axis sizes, slowest (outer) first; ``devices``: device labels in row-major
    order over ``shape`` (the last axis varies fastest); ``mesh``: per-axis alpha-beta."""

    shape: tuple[int, ...]
    devices: tuple[int, ...]
    mesh: Mesh


def _check(beta: Matrix, alpha: Matrix | None) -> int:
    n = len(beta)
    if n < 2:
        raise ValueError(f"cluster detector: need at least 2 devices, got {n}")
    for name, m in (("beta", beta), ("alpha", alpha)):
        if m is None:
            continue
        if len(m) != n or any(len(row) != n for row in m):
            raise ValueError(f"cluster detector: {name} must be {n} x {n}")
        for i, j in itertools.permutations(range(n), 2):
            v = m[i][j]
            ok = math.isfinite(v) and (v > 0 if name == "beta" else v >= 0)
            if not ok:
                raise ValueError(f"cluster detector: {name}[{i}][{j}] = {v!r}; expected a finite "
                                 f"{'positive bandwidth in bytes/s' if name == 'beta' else 'latency >= 0 s'}")
    return n


def _sym(m: Matrix, n: int, worst) -> list[list[float]]:
    """Symmetrised off-diagonal matrix (``worst`` of both directions); the diagonal is unused."""
    return [[worst(m[i][j], m[j][i]) if i != j else 0.0 for j in range(n)] for i in range(n)]


def tiers(beta: Matrix, tier_gap: float = TIER_GAP) -> list[float]:
    """Thresholds (the slowest bandwidth of each tier), fastest tier first. In: a symmetric
    bandwidth matrix in bytes/s (diagonal ignored)."""
    n = len(beta)
    values = sorted({beta[i][j] for i, j in itertools.combinations(range(n), 2)}, reverse=True)
    out = []
    for hi, lo in itertools.pairwise(values):
        if hi > lo * tier_gap:
            out.append(hi)
    out.append(values[-1])
    return out


def _components(groups: list[tuple[int, ...]], bw: list[list[float]], threshold: float):
    """Components of the quotient graph at ``threshold`` and whether each is a clique."""
    def link(g: tuple[int, ...], h: tuple[int, ...]) -> float:
        return min(bw[a][b] for a in g for b in h)

    m = len(groups)
    adj = [[i != j and link(groups[i], groups[j]) >= threshold for j in range(m)] for i in range(m)]
    seen, comps = [False] * m, []
    for start in range(m):  # groups are sorted by first device, so components come out sorted too
        if seen[start]:
            continue
        comp, stack = [], [start]
        seen[start] = True
        while stack:
            i = stack.pop()
            comp.append(i)
            for j in range(m):
                if adj[i][j] and not seen[j]:
                    seen[j] = True
                    stack.append(j)
        comp.sort()
        comps.append((comp, all(adj[i][j] for i, j in itertools.combinations(comp, 2))))
    return comps


def _axis(shape: tuple[int, ...], k: int, bw: list[list[float]], lat: list[list[float]]) -> MeshAxis:
    """Slowest pair (and largest alpha) among positions that differ only in coordinate ``k``."""
    coords = list(itertools.product(*(range(s) for s in shape)))  # row-major, as the device order
    index = {c: i for i, c in enumerate(coords)}
    worst_bw, worst_alpha = math.inf, 0.0
    for c in coords:
        for v in range(c[k] + 1, shape[k]):
            other = index[c[:k] + (v,) + c[k + 1:]]
            here = index[c]
            worst_bw = min(worst_bw, bw[here][other])
            worst_alpha = max(worst_alpha, lat[here][other])
    return MeshAxis(shape[k], worst_alpha, worst_bw)


def detect_mesh(beta: Matrix, alpha: Matrix | None = None, devices: Sequence[int] | None = None,
                tier_gap: float = TIER_GAP) -> DetectedMesh:
    """Group devices into a logical mesh whose axes each join devices of equal bandwidth.

    In: ``beta[i][j]`` bandwidth from device i to j in bytes/s (n x n, n >= 2, diagonal ignored);
    ``alpha[i][j]`` latency in seconds (None: 0); ``devices`` the labels of the rows (default
    0..n-1). Out: :class:`DetectedMesh` (shape slowest axis first, device order row-major, Mesh
    with per-axis alpha/beta of the slowest pair on the axis). Raises ValueError on a malformed
    matrix (not square, a non-finite or non-positive bandwidth, a negative alpha)."""
    n = _check(beta, alpha)
    labels = tuple(range(n)) if devices is None else tuple(devices)
    if len(labels) != n or len(set(labels)) != n:
        raise ValueError(f"cluster detector: devices must be {n} distinct labels, got {list(labels)}")
    bw = _sym(beta, n, min)
    lat = _sym(alpha, n, max) if alpha is not None else [[0.0] * n for _ in range(n)]
    thresholds = tiers(bw, tier_gap)
    groups: list[tuple[int, ...]] = [(i,) for i in range(n)]
    sizes: list[int] = []  # fastest axis first
    while len(groups) > 1:
        for threshold in thresholds:
            comps = _components(groups, bw, threshold)
            k = len(comps[0][0])
            if k >= 2 and all(len(c) == k and clique for c, clique in comps):
                break
        else:  # unreachable: the slowest tier joins every group into one clique
            raise AssertionError("cluster detector: no tier joins the groups")
        groups = [tuple(d for i in comp for d in groups[i]) for comp, _ in comps]
        sizes.append(k)
    order = groups[0]
    shape = tuple(reversed(sizes))
    # reorder the matrices by the device order so that position = row-major mesh coordinate
    bw_o = [[bw[a][b] for b in order] for a in order]
    lat_o = [[lat[a][b] for b in order] for a in order]
    mesh = Mesh(tuple(_axis(shape, k, bw_o, lat_o) for k in range(len(shape))))
    return DetectedMesh(shape, tuple(labels[i] for i in order), mesh)


def hardware_matrices(hardware: HardwareSpec, devices: Sequence[int]) -> tuple[list[list[float]], list[list[float]]]:
    """(beta bytes/s, alpha s) between ``devices`` from the YAML: ``link(a, b).total_bw_gbps`` and
    ``latency_s`` (point-to-point figures; ``collective_efficiency`` is not applied). Diagonal 0."""
    n = len(devices)
    beta = [[0.0] * n for _ in range(n)]
    alpha = [[0.0] * n for _ in range(n)]
    for i, j in itertools.permutations(range(n), 2):
        link = hardware.link(devices[i], devices[j])
        beta[i][j], alpha[i][j] = link.total_bw_gbps * 1e9, link.latency_s
    return beta, alpha


def mesh_from_hardware(hardware: HardwareSpec, devices: Sequence[int] | None = None,
                       tier_gap: float = TIER_GAP) -> DetectedMesh:
    """:func:`detect_mesh` on the hardware YAML's links instead of measurements, so a planner can
    build a mesh without measuring. ``devices``: which devices (default all of ``hardware``)."""
    devs = tuple(range(hardware.num_devices)) if devices is None else tuple(devices)
    beta, alpha = hardware_matrices(hardware, devs)
    return detect_mesh(beta, alpha, devs, tier_gap)


def check_links(hardware: HardwareSpec, beta: Matrix, devices: Sequence[int] | None = None,
                factor: float = LINK_FACTOR) -> list[str]:
    """Pairs whose hardware-YAML bandwidth (``link(a, b).total_bw_gbps``) and measured bandwidth
    (``beta`` in bytes/s, rows = ``devices``, default 0..n-1; each pair's slower direction)
    differ by more than ``factor`` either way: one line per pair, [] if all agree. Reports, never
    raises, for a pair the YAML lacks. Latency is not compared: local_cpu's ``latency_s`` is a
    pipeline hop under load on purpose, not a ping-pong's alpha."""
    n = len(beta)
    devs = tuple(range(n)) if devices is None else tuple(devices)
    out = []
    for i, j in itertools.combinations(range(n), 2):
        a, b = devs[i], devs[j]
        measured = min(beta[i][j], beta[j][i])
        if not (hardware.has_device(a) and hardware.has_device(b)):
            out.append(f"devices {a}-{b}: measured {measured / 1e9:.3g} GB/s, but hardware {hardware.name!r} "
                       f"has devices 0..{hardware.num_devices - 1} only")
            continue
        link = hardware.link(a, b)
        said = link.total_bw_gbps * 1e9
        ratio = said / measured
        if ratio > factor or ratio < 1 / factor:
            way = f"{ratio:.3g}x the measured" if ratio > 1 else f"{1 / ratio:.3g}x below the measured"
            out.append(f"devices {a}-{b}: hardware {hardware.name!r} says {said / 1e9:.4g} GB/s "
                       f"({link.kind.value}), measured {measured / 1e9:.4g} GB/s: the YAML is {way} "
                       f"(more than {factor:g}x apart)")
    return out


def mesh_dict(found: DetectedMesh) -> dict:
    """JSON-ready form of a :class:`DetectedMesh`."""
    return {"shape": list(found.shape), "devices": list(found.devices),
            "axes": [{"size": ax.size, "alpha_s": ax.alpha_s, "beta_bytes_per_s": ax.beta_bytes_per_s}
                     for ax in found.mesh.axes],
            "order": "row-major over shape, axis 0 slowest (outer); the last axis holds consecutive devices"}


def cluster_report(beta: Matrix, alpha: Matrix, devices: Sequence[int], hardware: HardwareSpec | None = None,
                   factor: float = LINK_FACTOR) -> dict:
    """What mode=calibrate writes as cluster.json: the matrices, the mesh they imply, and (with
    ``hardware``) the mesh the YAML implies and the pairs where the YAML disagrees."""
    found = detect_mesh(beta, alpha, devices)
    out = {"devices": list(devices), "beta_bytes_per_s": [list(r) for r in beta], "alpha_s": [list(r) for r in alpha],
           "tiers_bytes_per_s": tiers(_sym(beta, len(beta), min)), "mesh": mesh_dict(found)}
    if hardware is not None:
        known = all(hardware.has_device(d) for d in devices)
        out["hardware"] = hardware.name
        out["hardware_mesh"] = mesh_dict(mesh_from_hardware(hardware, devices)) if known else None
        out["link_factor"] = factor
        out["link_disagreements"] = check_links(hardware, beta, devices, factor)
    return out
