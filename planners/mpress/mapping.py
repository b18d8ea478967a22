"""MPress stage->device mapping for D2D swap (MPress §III-C, "Device mapping" and Fig. 6).

Heavy pipeline stages (early stages hold more in-flight activations under 1F1B) swap tensors out to
the spare memory of peer GPUs over NVLink. Which GPU each stage runs on decides who is whose
neighbour and over how many links, so MPress enumerates every stage->device mapping, scores each by
"the reciprocal of the maximal time cost of D2D swap for a fixed assignment" and keeps the best.

The model scored here, for one mapping (all of it vectorised over a batch of mappings):

* Neighbours. Source stages (demand > 0) reach target stages (spare > 0, not themselves) over peer
  links only (``HardwareSpec.is_peer``: NVLink, NVSwitch, shm; PCIe / IB / Ethernet pairs are not
  D2D neighbours). Striping (MPress §III-C "Data stripping") picks a source's stripe weights:
  "weighted" = link bandwidth (count x bw, GB/s; the DGX-1 refinement), "equal" = 1 per peer (the
  DGX-2 rule), "none" = one target only: the fastest, ties to the one with most unclaimed spare
  (sources claim in stage order), then the lower stage.
* Sharing a target's spare (Fig. 6 enumerates "all possible ways to distribute" it; we solve it in
  closed form instead): progressive filling. Each round every target offers its remaining spare to
  its still-unsatisfied source neighbours in proportion to link bandwidth; a source whose offers
  cover its remaining demand takes just that much, split over its offers in its stripe proportions
  (water-filling: min(offer, lambda * weight)), and the rest goes back to the targets for the next
  round; a source whose offers fall short takes them all. At most (#sources + 1) rounds. The result
  is Pareto-efficient (no spare stays idle next to a source with unmet demand); it is not always a
  maximum flow (a bandwidth-proportional offer can go to a source that had other options).
* Time. A source's sub-blocks move in parallel over disjoint point-to-point links, so its swap time
  is max_j bytes_j / bw_j: placed / sum(bw) under weighted striping when no spare binds, placed /
  (n * slowest bw) under equal striping. Over a switched fabric (NVSwitch) the bandwidth is the
  source's port, shared by all its peers (specs.hardware.SWITCHED_KINDS): bytes over the switch /
  port bw. Contention between different sources at one target is not modelled (stages swap at
  different points of the pipeline schedule).
* Host uplink (``host_bytes`` given; the planner always gives it, memwall's extension of the
  score, issue 24). What a stage cannot place in peer memory leaves its device over PCIe, or is
  recomputed; so does what it swaps to the host anyway (``host_bytes``: CPU-swapped layers, its
  optimizer state). The GPUs behind one PCIe switch share its uplink to the host
  (``host.gpus_per_pcie_switch``; DGX-1: two), so which stages sit behind one switch is also the
  mapping's choice: a stage's host time is the bytes of every stage behind its switch over the
  uplink's bandwidth, and its swap time the slower of its D2D stripes and that. Measured on
  GPT-15.4B / DGX-1 (docs/mpress.md, "Where we differ" 5): over random permutations the planned
  iteration spans 17.4-20.5 s, and with the uplink unshared (one GPU per switch at half the
  bandwidth) 25.20-25.29 s: the mapping acts through the shared uplink, not through NVLink, since
  every D2D round trip hides in the simulated live intervals. MPress's Fig. 6 scores D2D time
  only; the paper's DGX-1 runs with the same two GPUs per switch.
* Rank: most placed bytes (in whole MiB, so float noise cannot decide), then smallest max swap
  time (ns), then smallest pipeline
  boundary-send time sum_i boundary_i / bw(dev_i, dev_i+1) over any link (PCIe fallback
  included; ns), then the lexicographically smallest device tuple. With ``host_bytes`` the
  smallest max swap time over D2D stripes and host uplinks comes first (MPress's score, the
  reciprocal of the maximal swap time; unplaced bytes are in it), then placed bytes.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simulator.links import pcie_switch
from specs.hardware import SWITCHED_KINDS, HardwareSpec

#: largest p scored exhaustively: 8! = 40,320 mappings (MPress's DGX-1 and DGX-2 have 8 GPUs)
EXACT_MAX_P = 8
#: deterministic restarts of the 2-swap hill climbing for p > EXACT_MAX_P (seeded, no global RNG)
RESTARTS = 12
SEED = 0
MIB = float(1 << 20)
STRIPING = ("weighted", "equal", "none")
MODES = ("search", "identity")


@dataclass(frozen=True)
class Mapping:
    """A stage->device mapping and its D2D swap plan; all tuples are indexed by stage."""

    device_of_stage: tuple[int, ...]  # stage i runs on device_of_stage[i]
    # per source stage: ((target stage, stripe weight), ...), targets that receive bytes, in stage
    # order; weight = peer-link GB/s (count x bw) for "weighted", 1.0 for "equal" and "none"
    targets: tuple[tuple[tuple[int, float], ...], ...]
    # per source stage: bytes sent to each of its targets, aligned with ``targets`` (the sub-block
    # sizes MPress's metadata table records, §III-C); smaller than weight-proportional where a
    # target's share of spare binds
    stripe_bytes: tuple[tuple[float, ...], ...]
    placed_bytes: tuple[float, ...]  # per stage: demand bytes placed in its targets' spare
    swap_time_s: tuple[float, ...]  # per stage: time to move placed_bytes one way over its stripes
    boundary_time_s: float  # sum_i boundary_bytes[i] / bw(stage i -> stage i+1) per microbatch
    candidates: int  # mappings scored
    exact: bool  # True: provably optimal (every permutation scored, or all permutations score alike)
    # per stage: the bytes behind its PCIe switch (unplaced demand and host_bytes of every stage
    # there) over the uplink's bandwidth, one way; () when the search was given no host_bytes
    host_time_s: tuple[float, ...] = ()


def _matrices(hardware: HardwareSpec, devs: Sequence[int]):
    """Over positions in ``devs``: peer bandwidth (GB/s, 0 where not a D2D neighbour), a switched
    mask (bandwidth is a per-device port) and the bandwidth of any link (for pipeline sends)."""
    n = len(devs)
    peer, full = np.zeros((n, n)), np.zeros((n, n))
    switched = np.zeros((n, n), dtype=bool)
    for a, b in itertools.permutations(range(n), 2):
        link = hardware.link(devs[a], devs[b])
        full[a, b] = link.total_bw_gbps
        if hardware.is_peer(devs[a], devs[b]):
            peer[a, b] = link.total_bw_gbps
            switched[a, b] = link.kind in SWITCHED_KINDS
    return peer, switched, full


def _symmetric(peer: np.ndarray, switched: np.ndarray, full: np.ndarray) -> bool:
    """Every pair of devices is linked alike: all mappings score the same (MPress skips the search)."""
    off = ~np.eye(len(peer), dtype=bool)
    return all(len(np.unique(m[off])) <= 1 for m in (peer, switched, full))


def _waterfill(offer: np.ndarray, w: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Per row (last axis = targets): take ``need`` bytes as min(offer_j, lam * w_j) summing to need
    (stripe proportions, capped by what each target offers); rows whose offers fall short take all."""
    take = offer.copy()
    fill = offer.sum(axis=-1) > need  # only these rows have a choice to make
    if not fill.any():
        return take
    o, wt, nd = offer[fill], w[fill], need[fill][:, None]  # (rows, targets)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(wt > 0, o / wt, np.inf)  # lam at which target j's offer caps
        order = np.argsort(t, axis=-1, kind="stable")
        ts, os_, ws = (np.take_along_axis(a, order, axis=-1) for a in (t, o, wt))
        c_off, c_w = np.cumsum(os_, axis=-1), np.cumsum(ws, axis=-1)
        w_tot = c_w[:, -1:]
        f = np.where(np.isfinite(ts), c_off + ts * (w_tot - c_w), np.inf)  # bytes taken at lam = ts_k
        k = np.argmax(f >= nd, axis=-1)[:, None]  # first breakpoint past need (the last finite one is)
        prev = np.maximum(k - 1, 0)
        prev_off = np.where(k > 0, np.take_along_axis(c_off, prev, axis=-1), 0.0)
        prev_w = np.where(k > 0, np.take_along_axis(c_w, prev, axis=-1), 0.0)
        lam = (nd - prev_off) / (w_tot - prev_w)
    take[fill] = np.minimum(o, lam * wt)
    return take


def _none_weights(bw: np.ndarray, demand: np.ndarray, spare: np.ndarray) -> np.ndarray:
    """No striping: each source (in stage order) picks one target: fastest link, then most spare not
    yet claimed by earlier sources, then the lowest stage. Returns 0/1 weights (M, ks, kt)."""
    m, ks, kt = bw.shape
    w = np.zeros_like(bw)
    if kt == 0:  # no stage has spare memory: nothing to pick
        return w
    left = np.broadcast_to(spare, (m, spare.size)).copy()
    rows = np.arange(m)
    for s in range(ks):
        row = bw[:, s, :]
        fastest = (row > 0) & (row == row.max(axis=1, keepdims=True))
        j = np.argmax(np.where(fastest, left, -1.0), axis=1)  # first max: the lowest stage
        ok = fastest[rows, j]
        w[rows[ok], s, j[ok]] = 1.0
        left[rows[ok], j[ok]] -= np.minimum(demand[s], left[rows[ok], j[ok]])
    return w


def _score(pos: np.ndarray, peer, switched, full, src, tgt, demand, spare, boundary, striping, host=None):
    """Score a batch of mappings ``pos`` (M, p): stage i on device position pos[:, i]. ``host``:
    None, or (host_bytes (p,), switch index per device position (p,), uplink bytes/s). Returns
    (x (M, ks, kt) bytes from source to target, w stripe weights, time_s (M, ks), boundary_s (M,),
    host_s (M, p) one-way host time per stage, None without ``host``)."""
    m = pos.shape[0]
    si, ti = pos[:, src][:, :, None], pos[:, tgt][:, None, :]
    bw = peer[si, ti] * (src[:, None] != tgt[None, :])  # a stage is never its own target
    sw = switched[si, ti]
    d, s = demand[src], spare[tgt]
    if striping == "weighted":
        w = bw.copy()
    elif striping == "equal":
        w = (bw > 0).astype(float)
    else:
        w = _none_weights(bw, d, s)
    share_bw = bw * (w > 0)  # spare is offered in proportion to link bandwidth
    x = np.zeros_like(bw)
    need = np.broadcast_to(d, (m, d.size)).copy()
    left = np.broadcast_to(s, (m, s.size)).copy()
    active = need > 0
    live = np.arange(m)
    for _ in range(len(src) + 1):  # each round satisfies a source or exhausts its targets
        e = share_bw[live] * active[live][:, :, None]
        col = e.sum(axis=1)
        offer = np.where(col > 0, left[live] / np.where(col > 0, col, 1.0), 0.0)[:, None, :] * e
        got = offer.sum(axis=2)
        moving = got.any(axis=1)  # a mapping offered nothing now never will be: drop it
        live, offer, got = live[moving], offer[moving], got[moving]
        if not live.size:
            break
        take = _waterfill(offer, w[live], need[live])
        x[live] += take
        left[live] = np.maximum(left[live] - take.sum(axis=1), 0.0)
        met = got >= need[live]
        need[live] = np.where(met, 0.0, np.maximum(need[live] - take.sum(axis=2), 0.0))
        active[live] &= ~met
    with np.errstate(divide="ignore", invalid="ignore"):
        p2p = np.where((bw > 0) & ~sw, x / bw, 0.0).max(axis=2, initial=0.0)
        port = np.where(sw & (x > 0), bw, 0.0).max(axis=2, initial=0.0)
        via_switch = np.where(port > 0, np.where(sw, x, 0.0).sum(axis=2) / port, 0.0)
    time_s = np.maximum(p2p, via_switch) / 1e9
    if boundary.size:
        boundary_s = (boundary / (full[pos[:, :-1], pos[:, 1:]] * 1e9)).sum(axis=1)
    else:
        boundary_s = np.zeros(m)
    return x, w, time_s, boundary_s, _host_s(pos, x, src, demand, host)


def _host_s(pos: np.ndarray, x: np.ndarray, src: np.ndarray, demand: np.ndarray, host) -> np.ndarray:
    """(M, p): per stage, one way over its PCIe switch's uplink, the bytes every stage behind that
    switch sends the host: its ``host_bytes`` plus its demand not placed in peer memory."""
    m, p = pos.shape
    if host is None:
        return None
    host_bytes, switch_of, uplink_bps = host
    load = np.broadcast_to(host_bytes, (m, p)).copy()
    if src.size:
        load[:, src] += np.maximum(demand[src] - x.sum(axis=2), 0.0)
    sw = switch_of[pos]  # (M, p): the switch of each stage's device
    n_sw = int(switch_of.max()) + 1
    per_switch = np.zeros((m, n_sw))
    np.add.at(per_switch, (np.arange(m)[:, None], sw), load)
    return np.take_along_axis(per_switch, sw, axis=1) / uplink_bps


def _keys(x, _w, time_s, boundary_s, host_s):
    """Rank keys, smaller is better: (-placed MiB, max D2D swap ns, boundary ns); with the host
    term (``host_s`` not None): (max swap ns over D2D stripes and host uplinks, -placed MiB,
    boundary ns)."""
    placed = -np.rint(x.sum(axis=(1, 2)) / MIB)
    if host_s is None:
        return (placed, np.rint(time_s.max(axis=1, initial=0.0) * 1e9), np.rint(boundary_s * 1e9))
    # the unplaced bytes are in the host time: MPress's score, 1 / max swap time, decides first
    slowest = np.maximum(time_s.max(axis=1, initial=0.0), host_s.max(axis=1, initial=0.0))
    return (np.rint(slowest * 1e9), placed, np.rint(boundary_s * 1e9))


def _best(keys, pos) -> int:
    """Index of the best mapping: by keys, then by the lexicographically smallest position tuple
    (positions index sorted devices, so this is the smallest device tuple)."""
    return int(np.lexsort(tuple(pos[:, ::-1].T) + keys[::-1])[0])


def _local_search(score, p: int, identity: np.ndarray):
    """2-swap steepest-descent hill climbing from identity and RESTARTS seeded permutations.
    Returns (best positions, mappings scored)."""
    rng = np.random.default_rng(SEED)
    starts = [identity, identity[::-1].copy()] + [rng.permutation(p) for _ in range(RESTARTS)]
    pairs = np.array(list(itertools.combinations(range(p), 2)))
    best, best_key, scored = None, None, 0
    for cur in starts:
        cur_key = tuple(k[0] for k in _keys(*score(cur[None, :])))
        scored += 1
        for _ in range(p * p * 4):  # a safety cap; climbs stop long before
            nbrs = np.repeat(cur[None, :], len(pairs), axis=0)
            r = np.arange(len(pairs))
            nbrs[r, pairs[:, 0]], nbrs[r, pairs[:, 1]] = cur[pairs[:, 1]], cur[pairs[:, 0]]
            keys = _keys(*score(nbrs))
            scored += len(pairs)
            i = _best(keys, nbrs)
            key = tuple(k[i] for k in keys)
            if key >= cur_key:
                break
            cur, cur_key = nbrs[i], key
        full_key = cur_key + tuple(cur)
        if best_key is None or full_key < best_key:
            best, best_key = cur, full_key
    return best, scored


def _check(hardware, devices, demand, spare, boundary, striping, mode, pairs=None) -> None:
    p = len(devices)
    if p == 0:
        raise ValueError("devices: give at least one device")
    if len(set(devices)) != p or not all(hardware.has_device(d) for d in devices):
        raise ValueError(f"devices: must be distinct devices of hardware {hardware.name!r} "
                         f"(0..{hardware.num_devices - 1}); got {list(devices)}")
    for name, vals, n in (("demand_bytes", demand, p), ("spare_bytes", spare, p),
                          ("boundary_bytes", boundary, p - 1 if len(boundary) else 0)):
        if len(vals) != n:
            raise ValueError(f"{name}: expected {n} values (one per stage{' boundary' if name[0] == 'b' else ''}), "
                             f"got {len(vals)}")
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError(f"{name}: every value must be a finite number >= 0; got {list(vals)}")
    if striping not in STRIPING:
        raise ValueError(f"striping: one of {', '.join(STRIPING)}; got {striping!r}")
    if mode not in MODES:
        raise ValueError(f"mode: one of {', '.join(MODES)}; got {mode!r}")
    if pairs is not None:
        if mode != "identity":
            raise ValueError("pairs: a rule over stage pairs holds for a fixed layout only: use mode='identity' "
                             "(a search moves the stages)")
        if len(pairs) != p or any(len(row) != p for row in pairs):
            raise ValueError(f"pairs: expected {p} x {p} booleans (one per source and target stage)")


def search_mapping(hardware: HardwareSpec, devices: Sequence[int], demand_bytes: Sequence[float],
                   spare_bytes: Sequence[float], boundary_bytes: Sequence[float] = (),
                   striping: str = "weighted", mode: str = "search",
                   pairs: Sequence[Sequence[bool]] | None = None,
                   host_bytes: Sequence[float] | None = None) -> Mapping:
    """Map p pipeline stages onto ``devices`` (p distinct devices of ``hardware``) for D2D swap.

    ``demand_bytes[i]``: bytes stage i wants to swap out (0 for light stages); ``spare_bytes[i]``:
    bytes stage i's device can hold for peers (0 for heavy stages); ``boundary_bytes[i]``: bytes
    stage i sends stage i+1 per microbatch (p - 1 values, or none). ``striping``: "weighted",
    "equal" or "none"; ``mode``: "identity" (stage i on devices[i], the DAPPLE-order baseline of
    MPress Fig. 9) or "search" (exhaustive for p <= 8, seeded 2-swap hill climbing beyond).
    Identity is returned without a search when p == 1, nothing can be swapped (no demand or no
    spare), or every device pair is linked alike (MPress skips the search on symmetric NVSwitch).
    ``pairs`` (identity only): ``pairs[i][j]`` False keeps stage i's stripes off stage j even where
    their devices are peers (a fixed layout's rules, planners/mpress/compact.py); None: any peer.
    ``host_bytes[i]`` (optional): bytes stage i sends the host whatever the mapping; given, a
    stage's unplaced demand goes to the host too and the host uplinks its PCIe switch shares count
    in the swap time (module docstring), and the search runs even where no stage has spare memory
    (the uplinks still differ) unless the NVLink/NVSwitch topology is symmetric (MPress §III-C
    skips the search there). Returns the best :class:`Mapping` by the module's ranking, with its stripes (bytes), placed bytes
    and one-way swap times (s) per stage; ValueError names the argument when an input is malformed.
    """
    _check(hardware, devices, demand_bytes, spare_bytes, boundary_bytes, striping, mode, pairs)
    if host_bytes is not None and (len(host_bytes) != len(devices)
                                   or not all(math.isfinite(v) and v >= 0 for v in host_bytes)):
        raise ValueError(f"host_bytes: expected {len(devices)} finite values >= 0 (one per stage); got {list(host_bytes)}")
    p = len(devices)
    devs = sorted(devices)
    peer, switched, full = _matrices(hardware, devs)
    if pairs is not None:  # the matrices are over positions in devs: stage i sits at at[i]
        at = [devs.index(d) for d in devices]
        allowed = np.zeros((p, p), dtype=bool)
        allowed[np.ix_(at, at)] = np.asarray(pairs, dtype=bool)
        peer = peer * allowed
    demand = np.asarray(demand_bytes, dtype=float)
    spare = np.asarray(spare_bytes, dtype=float)
    boundary = np.asarray(boundary_bytes, dtype=float)
    src, tgt = np.flatnonzero(demand > 0), np.flatnonzero(spare > 0)
    host = None
    if host_bytes is not None:
        switch_of = np.array([pcie_switch(hardware, d) for d in devs])
        host = (np.asarray(host_bytes, dtype=float), switch_of, hardware.host.pcie_gbps * 1e9)
    # the uplinks differ between mappings only where a switch has two of the devices and some
    # stage sends the host anything
    shared = host is not None and len(set(switch_of.tolist())) < p and (src.size or host[0].any())

    def score(pos):
        return _score(pos, peer, switched, full, src, tgt, demand, spare, boundary, striping, host)

    identity = np.array([devs.index(d) for d in devices])
    if mode == "identity":
        pos, candidates, exact = identity, 1, False
    elif p == 1 or (not (src.size and tgt.size) and not shared) or _symmetric(peer, switched, full):
        pos, candidates, exact = identity, 1, True
    elif p <= EXACT_MAX_P:
        perms = np.array(list(itertools.permutations(range(p))), dtype=np.intp)  # lexicographic
        pos, candidates, exact = perms[_best(_keys(*score(perms)), perms)], len(perms), True
    else:
        pos, candidates = _local_search(score, p, identity)
        exact = False
    return _mapping(pos, score, devs, src, tgt, p, striping, candidates, exact, host)


def _mapping(pos, score, devs, src, tgt, p, striping, candidates, exact, host=None) -> Mapping:
    x, w, time_s, boundary_s, host_s = (a if a is None else a[0] for a in score(pos[None, :]))
    targets, stripes = [()] * p, [()] * p
    placed, times = [0.0] * p, [0.0] * p
    for a, s in enumerate(src):
        used = [b for b in range(len(tgt)) if x[a, b] > 0]
        weight = (lambda b: float(w[a, b])) if striping == "weighted" else (lambda b: 1.0)
        targets[s] = tuple((int(tgt[b]), weight(b)) for b in used)
        stripes[s] = tuple(float(x[a, b]) for b in used)
        placed[s], times[s] = float(x[a].sum()), float(time_s[a])
    return Mapping(device_of_stage=tuple(devs[i] for i in pos), targets=tuple(targets),
                   stripe_bytes=tuple(stripes), placed_bytes=tuple(placed), swap_time_s=tuple(times),
                   boundary_time_s=float(boundary_s), candidates=int(candidates), exact=exact,
                   host_time_s=tuple(float(t) for t in host_s) if host_s is not None else ())
