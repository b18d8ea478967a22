"""MPress Table III reproduced (issue 24): for tensors sampled from Bert and GPT, the size, the live
interval and the cost of recomputation, GPU-CPU swap and D2D swap (over 4 NVLinks), from memwall's
own cost model beside the paper's; printed and written by benchmarks/mpress_eval.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks import mpress_paper as paper
from benchmarks.mpress_eval import Case, compose_case, policy_for

# ---- Table III: the cost of each technique per tensor, reproduced ----------------------------------
# From memwall's own cost model (planners/mpress/facts.py, the numbers the planner decides with) and
# live intervals read off the simulated base pipeline. Where the model lists its blocks' saved
# tensors (LayerSpec.saved_tensors) a row is one tensor (MPress §III-D decides per tensor): its
# bytes, its own live interval (facts.TensorFacts: the block's plus the in-layer parts), its swaps;
# its recompute is the block's one more forward (the planner recomputes whole layers: a plan cannot
# recompute one tensor). Without that list a row is a whole transformer block's saved activations,
# one microbatch (the fallback).

#: the presets Table III's tensors are sampled from: the paper does not name its models; these are
#: Table IV's, with the setups of §IV-A (Bert: PipeDream, microbatch 12, fp32, DGX-1; GPT: DAPPLE,
#: microbatch 2, fp16)
TABLE_III_CASES = {"bert": "mpress_bert_1b67_pipedream", "gpt": "mpress_gpt_10b3_dgx1"}
MB = 1e6  # the paper's MB, as its GB (Table II) are 10^9 bytes


@dataclass
class TensorCosts:
    """One Table III row, ours beside the paper's."""

    series: str
    tensor: str            # the paper's name (t1..t6)
    model: str
    stage: int
    layer: int
    size_mb: float         # the layer's saved activations, one microbatch
    live_ms: float         # its shortest forward-end -> backward-start in the simulated base pipeline
    recompute_ms: float    # one more forward of the layer
    cpu_ms: float          # out and back over the PCIe share the planner prices
    d2d_ms: float          # out and back over ``nvlinks`` NVLinks
    pick: str              # the least extra time, ties as §IV-D (mpress_paper.table_iii_pick)
    extra_ms: dict
    paper: tuple           # (MB, live, recompute, GPU-CPU, D2D) ms as printed
    paper_pick: str        # table_iii_pick on the paper's numbers
    agree: dict = field(default_factory=dict)   # column -> Agreement text
    why: list = field(default_factory=list)     # computed, one per column that differs
    tensor_name: str = ""  # the block's saved tensor (SavedTensorSpec.name) a per-tensor row is; "": the block


def base_facts(case: Case) -> dict:
    """The planner's LayerFacts per (stage, layer) of ``case``'s base pipeline (MPress §III-B
    steps 1-2): one traced simulation, the identity mapping (Table III's D2D has its own links)."""
    from planners.mpress.base import base_plan, boundary_bytes, map_base
    from planners.mpress.emulate import Emulator, over_and_spare
    from planners.mpress.facts import CPU, RC, layer_facts

    cfg, model = case.cfg, case.model
    policy = policy_for(case, "mpress")
    em = Emulator(model, cfg.hardware, policy.max_simulations)
    base = base_plan(policy, model, cfg.hardware, cfg.training, cfg.schedule)
    first = em.run(base, trace=True)
    devices = [st.devices[0] for st in base.stages]
    demand, spare = over_and_spare(first, devices, cfg.hardware.device.memory_bytes)
    mapping = map_base(policy, cfg.hardware, model, base, devices, demand, spare, boundary_bytes(base, model),
                       [RC, CPU])
    return layer_facts(base, model, cfg.hardware, first.trace, mapping)


def nvlink_bundle(hardware, n: int):
    """``n`` of the hardware's NVLinks side by side (its first NVLink pair's per-link rate and latency)."""
    from specs.hardware import LinkSpec

    one = next(link for link in hardware.intra_node.links if link.kind.value == "nvlink")
    return LinkSpec(kind=one.kind, count=n, bw_gbps=one.bw_gbps, latency_s=one.latency_s)


def _units(case: Case, facts: dict, per_tensor: bool) -> list[tuple]:
    """The candidate rows: (stage, layer, tensor index or -1, bytes, live s, one-way CPU s) per
    transformer block, or per saved tensor of one."""
    from specs.model import LayerKind

    blocks = sorted(k for k in facts if case.model.layers[k[1]].kind is LayerKind.transformer_block)
    if not per_tensor:
        return [(*k, -1, facts[k].saved_bytes, facts[k].live_s, facts[k].cpu_s) for k in blocks]
    return [(*k, t.index, t.nbytes, t.live_s, t.cpu_s) for k in blocks for t in facts[k].tensors]


def table_iii_rows(case: Case, nvlinks: int = 4, facts: dict | None = None,
                   per_tensor: bool | None = None) -> list[TensorCosts]:
    """Table III's rows of ``case.series`` reproduced, in the paper's order: for each paper tensor,
    shortest-lived first, the unit not yet taken whose simulated live interval is nearest the
    paper's (then size nearest; ties to the lower stage, layer, tensor), with the planner's costs for
    it. A unit is a block's saved tensor where the model lists them (``per_tensor`` None: whenever
    some block does), else a transformer block."""
    from costs.collectives import transfer_s

    facts = base_facts(case) if facts is None else facts
    if per_tensor is None:
        per_tensor = any(f.tensors for f in facts.values())
    link = nvlink_bundle(case.cfg.hardware, nvlinks)
    units = _units(case, facts, per_tensor)
    mine = [r for r in paper.TABLE_III if r[0] == case.series]
    chosen: dict = {}
    for r in sorted(mine, key=lambda r: (r[3], r[1])):  # shortest-lived first keeps the order of intervals
        chosen[r[1]] = min((u for u in units if u not in chosen.values()),
                           key=lambda u: (abs(u[4] * 1e3 - r[3]), abs(u[3] / MB - r[2]), u[:3]))
    lives_ms = [u[4] * 1e3 for u in units]
    out = []
    for _, name, mb, live, rc, cpu, d2d in mine:
        s, l, i, nbytes, live_s, cpu_s = chosen[name]
        f = facts[(s, l)]
        row = TensorCosts(case.series, name, case.model_name, s, l, nbytes / MB, live_s * 1e3,
                          f.fwd_s * 1e3, 2 * cpu_s * 1e3, 2 * transfer_s(nbytes, link) * 1e3, "", {},
                          (mb, live, rc, cpu, d2d), paper.table_iii_pick(live, rc, cpu, d2d)[0],
                          tensor_name=f.tensors[i].name if i >= 0 else "")
        row.pick, row.extra_ms = paper.table_iii_pick(row.live_ms, row.recompute_ms, row.cpu_ms, row.d2d_ms)
        ours = (row.size_mb, row.live_ms, row.recompute_ms, row.cpu_ms, row.d2d_ms)
        agreements = {col: paper.agrees(o, str(p)) for col, o, p in zip(paper.TABLE_III_COLUMNS, ours, row.paper)}
        row.agree = {col: str(a) for col, a in agreements.items()}
        row.agree["pick"] = ("agrees" if row.pick == row.paper_pick
                             else f"differs (ours {row.pick}, paper {row.paper_pick})")
        row.why = _table_iii_why(row, case, link, {col for col, a in agreements.items() if not a.agrees},
                                 (min(lives_ms), max(lives_ms)))
        out.append(row)
    return out


def _table_iii_why(row: TensorCosts, case: Case, link, differ: set, lives_ms: tuple) -> list[str]:
    """Why each column in ``differ`` differs, from the two rows' own numbers: the rates they imply."""
    mb, live, rc, cpu, d2d = row.paper
    host = case.cfg.hardware.host
    share = cpu_share(case)
    out = []
    unit = f"block {row.layer}'s tensor {row.tensor_name}" if row.tensor_name else f"block {row.layer}'s saved activations"
    units = "saved tensors" if row.tensor_name else "blocks"
    if "size MB" in differ:
        out.append(f"size: ours is {unit}, {row.size_mb:.0f} MB = {row.size_mb / mb:.1f}x the paper's one tensor")
    if "live ms" in differ:
        out.append(f"live: the {units[:-1]} nearest the paper's {live} ms lives {row.live_ms:.1f} ms; "
                   f"{case.model_name}'s {units} live {lives_ms[0]:.1f}-{lives_ms[1]:.1f} ms in the simulated base pipeline")
    if "recompute ms" in differ:
        if row.tensor_name:
            out.append(f"recompute: ours {row.recompute_ms:.1f} ms, its block's one more forward (a plan "
                       f"recomputes whole layers); the paper's {rc} ms")
        else:
            out.append(f"recompute: ours {row.recompute_ms / row.size_mb * 100:.2f} ms per 100 MB saved, the paper's "
                       f"{rc / mb * 100:.2f}")
    if "GPU-CPU swap ms" in differ:
        out.append(f"GPU-CPU: ours moves {2 * row.size_mb / row.cpu_ms:.1f} GB/s (PCIe {host.pcie_gbps:g} GB/s shared "
                   f"by {share} GPUs), the paper's numbers imply {2 * mb / cpu:.1f} GB/s")
    if "D2D swap ms" in differ:
        out.append(f"D2D: ours moves {2 * row.size_mb / row.d2d_ms:.1f} GB/s ({link.count} x {link.bw_gbps:g} GB/s), "
                   f"the paper's numbers imply {2 * mb / d2d:.1f} GB/s")
    if row.pick != row.paper_pick:
        theirs = paper.table_iii_pick(live, rc, cpu, d2d)[1]
        out.append("pick: extra ms ours " + ", ".join(f"{a} {x:.1f}" for a, x in row.extra_ms.items())
                   + "; paper " + ", ".join(f"{a} {x:.1f}" for a, x in theirs.items()))
    return out


def cpu_share(case: Case) -> int:
    """GPUs sharing one PCIe uplink as the planner prices a CPU swap (planners/mpress/facts.py)."""
    return min(case.cfg.hardware.host.gpus_per_pcie_switch, case.cfg.hardware.num_devices)


def table_iii(progress=print) -> list[TensorCosts]:
    """Table III reproduced for Bert and GPT (:data:`TABLE_III_CASES`)."""
    out = []
    for series, name in TABLE_III_CASES.items():
        out += table_iii_rows(compose_case(name))
        progress(f"[table III] {name}: {sum(r.series == series for r in out)} tensors")
    return out


# ---- output ----------------------------------------------------------------------------------------

def print_table_iii(rows: list[TensorCosts]) -> None:
    """Table III, ours beside the paper's, per tensor, with the agreement of every column at the
    paper's precision (whole MB and ms) and a computed why under each that differs."""
    if not rows:
        return
    print("\n== Table III: cost per technique (ms; swaps out and back, D2D over 4 NVLinks), ours / paper ==")
    print(f"  {'tensor':6} {'ours: model, stage/layer[:tensor]':36} {'size MB':>13} {'live ms':>13} {'recomp.':>11} "
          f"{'GPU-CPU':>11} {'D2D':>10}  pick ours / paper")
    for r in rows:
        mb, live, rc, cpu, d2d = r.paper
        where = r.model + f" s{r.stage} L{r.layer}" + (f":{r.tensor_name}" if r.tensor_name else "")
        print(f"  {r.tensor:6} {where:36} {r.size_mb:7.0f}/{mb:<5} "
              f"{r.live_ms:7.1f}/{live:<5} "
              f"{r.recompute_ms:5.1f}/{rc:<5} {r.cpu_ms:5.1f}/{cpu:<5} {r.d2d_ms:5.1f}/{d2d:<4}  "
              f"{r.pick} / {r.paper_pick} ({r.agree['pick']})")
        agreeing = [c for c, a in r.agree.items() if a.startswith("agrees")]
        print(f"  {'':6} agrees at the paper's precision: {', '.join(agreeing) or 'none'}")
        for why in r.why:
            print(f"  {'':6} why {why}")
