"""Policy configs: what a user asks a planner for (``conf/policy/*.yaml``), validated once.

``kind`` picks the planner through a pydantic discriminated union, never an import string.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from specs._base import Spec


class _Uniform(Spec):
    pp: int | None = Field(None, ge=1, description="pipeline stages; null: every device is used")
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1, description="context-parallel degree (ring attention over the sequence)")
    recompute: Literal["none", "full", "selective", "op_sac"] | None = Field(
        "none", description="full: every block checkpointed; selective: the attention core only (Korthikanti §5); "
        "op_sac: torchtitan's op-level selective AC (every other matmul's output and the attention kernel's "
        "saved, the rest recomputed; LLaMA blocks); null (conf/policy's default, the command line's; a policy built "
        "in Python keeps none unless it asks): none if the plan fits, else the "
        "fastest of selective, op_sac, full on the first N blocks of each stage and full that fits "
        "(planners.recompute_choice)")
    recompute_num_layers: int | None = Field(
        None, ge=1, description="with recompute=full: only the first N blocks of each stage (each model chunk) are "
        "recomputed, Megatron's --recompute-method block --recompute-num-layers N; null: every block")
    recompute_every: int | None = Field(
        None, ge=1, description="with recompute=full: only every k-th block of the model is recomputed (blocks "
        "k, 2k, ... counted from 1), torchtitan's layer-level selective AC (selective_ac_option = k); null: every "
        "block")
    sequence_parallel: bool = Field(False, description="Korthikanti §4.2.2 over the tp group (needs tp > 1)")
    zero_stage: int = Field(0, ge=0, le=3)
    distributed_optimizer: bool = Field(False, description="Megatron's --use-distributed-optimizer: ZeRO-1 over "
                                                           "data parallelism (zero_stage 1 when zero_stage is 0)")
    overlap_grad_reduce: bool = Field(False, description="bucketed gradient reduction during the backward")
    overlap_param_gather: bool = Field(False, description="distributed optimizer: parameter all-gather during the "
                                                          "next forward")
    p2p_scatter_gather: bool = Field(False, description="Narayanan et al. SC'21 §4.1: each tp rank sends 1/t of a "
                                                        "pipeline boundary tensor, the receivers all-gather it "
                                                        "(Megatron-LM 2021-22's default; not in Megatron-Core)")
    p2p_blocking: bool = Field(False, description="each pipeline send waited before the next pass (Megatron's "
                                                  "p2p: Megatron-Core overlap_p2p_comm=False, its default; "
                                                  "Megatron-LM 2021-22; DeepSpeed's pipeline engine)")


class EvenPolicy(_Uniform):
    """Equal layer counts per stage (DeepSpeed/Megatron default partitioning)."""

    kind: Literal["even"] = "even"


class BalancedPolicy(_Uniform):
    """Contiguous stages balancing forward FLOPs (PipeDream §3.1 / DAPPLE planner)."""

    kind: Literal["balanced"] = "balanced"


class ManualPolicy(_Uniform):
    """Megatron-style: the user fixes pp × dp × tp (= the device count) and, optionally, layers."""

    kind: Literal["manual"] = "manual"
    pp: int = Field(1, ge=1)
    layers_per_stage: list[int] | None = None


class CapturePolicy(Spec):
    """CAPTURE (memory-centric partitioning). ``mode=profile policy=capture`` runs its profiler
    (§III-A); the planner itself (§III-B/C) is issue #6. ``batch_sizes``: profiling global
    batches (null: half and quarter of training.global_batch, §III-A2); ``num_microbatches``:
    microbatches per profiling run (null: the most that leave every microbatch divisible by 4,
    so 2- and 4-way data parallelism split it); ``backend``: what runs the profiling plans."""

    kind: Literal["capture"] = "capture"
    batch_sizes: list[int] | None = None
    num_microbatches: int | None = Field(None, ge=1)
    scenarios: list[Literal["pp", "dp2", "dp4", "tp2", "tp4"]] = ["pp", "dp2", "dp4", "tp2", "tp4"]
    backend: Literal["auto", "simulator", "executor"] = "auto"
    recompute: Literal["none", "full"] = "none"
    # planner knobs (§III-C); they do not change the profile
    pipeline_only: bool = Field(False, description="degree 1 everywhere (Fig. 6g-l) instead of hybrid")
    merge_layers: int | None = Field(None, ge=1, description="layer merger target L_m (§III-A3); null: off")
    search: Literal["exact", "exhaustive"] = Field("exact", description="DP, or Algorithm 4 as published")
    compare_throughput: bool = Field(True, description="also plan policy=throughput and report both")
    smallest_hardware: bool = Field(False, description="also search the fewest nodes that fit (Fig. 9)")

    def profile_fields(self) -> dict:
        """The fields that decide the profile (its cache key)."""
        return self.model_dump(mode="json", include={"batch_sizes", "num_microbatches", "scenarios", "backend",
                                                     "recompute"})


class ThroughputPolicy(Spec):
    """Alpa-like autostage baseline: the fastest plan (analytic iteration time) in CAPTURE's
    space that fits device memory."""

    kind: Literal["throughput"] = "throughput"
    recompute: Literal["none", "full"] = "none"
    pipeline_only: bool = False


class MPressPolicy(Spec):
    """MPress (Zhou et al., HPCA'23): a compute-balanced pipeline, one stage per device, whose
    overflowing stages save activation memory per layer by recomputation, GPU->CPU swap or D2D
    swap to peers with spare memory (§III-C/D). ``techniques`` limits the choice (the paper's
    Recomputation-only, GPU-CPU-swap-only and D2D-only baselines); ``mapping``: search the
    stage->device permutation (Fig. 6) or keep stage i on device i; ``striping``: stripe a D2D
    tensor over the peers by link bandwidth (weighted), equally, or send it to one peer (none)."""

    kind: Literal["mpress"] = "mpress"
    partition: Literal["balanced", "even", "capture"] = Field(
        "balanced", description="the starting pipeline partition: balanced (PipeDream/DAPPLE balance compute), "
                                "even (Megatron), capture (CAPTURE's memory-centric one, pipeline only; profiles first)")
    pp: int | None = Field(None, ge=1, description="pipeline stages; null: one per device")
    techniques: list[Literal["recompute", "cpu_swap", "d2d_swap"]] = Field(
        ["recompute", "cpu_swap", "d2d_swap"], min_length=1)
    mapping: Literal["search", "identity"] = "search"
    striping: Literal["weighted", "equal", "none"] = "weighted"
    # a count, not a clock: the same inputs give the same plan
    max_simulations: int = Field(1000, ge=1, le=10_000,
                                 description="safety cap on emulator runs; the search stops when a round gains < min_round_gain")
    min_round_gain: float = Field(0.005, ge=0, lt=1,
                                  description="stop when a round makes the iteration less than this fraction faster")


class StrongholdPolicy(Spec):
    """STRONGHOLD (Sun et al., SC'22): pipeline stages of one device each (null pp: the fewest that fit), each
    streaming its layers through a sliding window of ``window_layers`` device slots over host
    memory, the CPU stepping each layer as its gradients land; NVMe holds the optimizer state
    when host RAM is short. ``window_layers``: null picks the smallest window that hides the
    transfers (§III-D), a number forces it on every stage."""

    kind: Literal["stronghold"] = "stronghold"
    pp: int | None = Field(None, ge=1, description="pipeline stages, one device each; null: the fewest that fit")
    window_layers: int | None = Field(None, ge=1, description="slots per stage; null: the analytic window")
    dp: int | None = Field(None, ge=1, le=1 << 20, description="data-parallel replicas of each stage, each streaming "
                           "its own window (§III-F, §VI-D2); null: the planner chooses")
    tp: int | None = Field(None, ge=1, le=1 << 20, description="tensor-parallel shards of each stage, a shard the unit "
                           "of offload; null: the planner chooses")
    recompute: Literal["none", "full"] = Field("full", description="layer-wise checkpointing, as STRONGHOLD §V-D")
    nvme: Literal["auto", "on", "off"] = Field("auto", description="optimizer state on NVMe: when host RAM is "
                                                                   "short (auto), always, never")
    resident_first_window: bool = Field(True, description="§III-E1: the first working window's layers stay "
                                                          "resident, stepped on the device")
    streams: int | None = Field(None, ge=1, le=64, description="§IV-A: concurrent workers (CUDA streams) sharing "
                                "each stage's window; null: the planner chooses (the fastest that fits)")


class ZeroOffloadPolicy(Spec):
    """ZeRO-Offload (Ren et al., ATC'21): every weight and gradient on the device, the optimizer
    state and its Adam step on the CPU (§3: the one offload strategy that keeps the device's
    compute and minimises the traffic); gradients go to the host as the backward produces them,
    the updated weights come back after the CPU step. ``nvme``: the host-side optimizer state on
    NVMe (ZeRO-Infinity's offload_optimizer device nvme; Rajbhandari et al., SC'21).
    ``delayed_update``: the one-step delayed parameter update (DPU, §5.2) after
    ``dpu_warmup_iterations`` plain steps. ``pp``/``dp``: a pipeline of ``pp`` stages split as
    policy=balanced, ``dp`` replicas each (ZeRO-Offload runs one GPU, or data-parallel GPUs)."""

    kind: Literal["zero_offload"] = "zero_offload"
    pp: int = Field(1, ge=1, description="pipeline stages (the paper: 1, one GPU per replica)")
    dp: int = Field(1, ge=1, description="data-parallel replicas per stage")
    recompute: Literal["none", "full"] = Field("full", description="layer-wise checkpointing, as the STRONGHOLD "
                                                                   "comparison trains every method")
    nvme: bool = Field(False, description="ZeRO-Infinity-style: the host-side optimizer state on NVMe")
    delayed_update: bool = Field(False, description="ZeRO-Offload's DPU (§5.2); off: every iteration's "
                                                    "numerics equal the reference's")
    dpu_warmup_iterations: int = Field(40, ge=1, le=1 << 20,
                                       description="iterations without DPU before it starts (§5.2's warm-up)")


class MapPolicy(Spec):
    """MAP (Liu et al.): per-operator sharding strategies on a logical mesh of each stage's devices,
    the fastest under ``memory_budget_gib`` per device (eq. 1 ILP + rotor checkpointing, §5.3).
    ``mesh``: the logical mesh (null: detected, §4.2, with every axis found); ``cluster``: a
    cluster.json from mode=calibrate whose measured pairs and per-axis all-reduce fits build the
    mesh and price its axes (null: the hardware YAML's links);
    ``pp``: pipeline stages (each stage's devices form its mesh); ``alpha``/``budgets``: §5.3's
    ILP budgets B(1+alpha)^k, k < budgets; ``budgets_below``: ILP budgets under B too,
    B(1+alpha)^(-j/4), j <= budgets_below (planners.map.rotor.budget_grid); ``refine``: re-solves when the simulated peak exceeds
    the budget. ``constrain=params`` bounds parameter state only, as the solvers MAP compares
    with do, to show what ignoring activations costs (rotor and the refinement are then off)."""

    kind: Literal["map"] = "map"
    memory_budget_gib: float | None = Field(
        None, ge=2 ** -30, le=1 << 20, description="per device, at least one byte (2^-30 GiB); null: device memory")
    mesh: list[Annotated[int, Field(ge=1, le=1 << 16)]] | None = Field(None, min_length=1, max_length=3)
    cluster: str | None = Field(None, min_length=1, max_length=4096,
                                description="path of a cluster.json (mode=calibrate, MAP §4.2); null: the YAML's links")
    pp: int = Field(1, ge=1)
    alpha: float = Field(0.25, gt=0, le=4)
    budgets: int = Field(10, ge=1, le=40)
    budgets_below: int = Field(12, ge=0, le=40, description="ILP budgets under B, B(1+alpha)^(-j/4), j = 1.."
                                                           "budgets_below (the first infeasible one ends them)")
    memory_slots: int = Field(500, ge=10, le=5000)
    ilp_time_limit_s: float = Field(60.0, gt=0, le=3600)
    refine: int = Field(4, ge=0, le=20)
    devices: int | None = Field(None, ge=1, description="use the first N devices (MAP §7's weak scaling); null: all")
    constrain: Literal["all", "params"] = Field(
        "all", description="what eq. 1's budget row counts: parameter state and saved activations (MAP), or "
                           "parameter state only (what autoparallel / ColossalAI's auto_parallel bound)")


SINGLE_POLICIES = ("balanced", "throughput", "capture", "mpress", "stronghold", "map")


class AutoPolicy(Spec):
    """One search over every technique (issue 23): the fastest plan that fits the devices (or
    ``memory_budget_gib``). An outer search over layouts (pipeline depth, contiguous split, per-stage
    dp × tp, schedule, microbatch size) priced by the analytic stage table with a lower bound on what
    memory actions can save; an inner per-stage compaction (MPress's per-layer recompute / CPU swap /
    D2D swap, a STRONGHOLD window where a stage's state does not fit); the simulator verifies every
    candidate. Each single policy in ``singles`` is planned on the same inputs and is a candidate
    too, so the answer is never worse than theirs. ``find``: the fastest plan (default), the fewest
    nodes of this hardware that train the model, or the largest model of this family that trains."""

    kind: Literal["auto"] = "auto"
    memory_budget_gib: float | None = Field(
        None, ge=2 ** -30, le=1 << 20, description="per device, at least one byte (2^-30 GiB); null: device memory")
    find: Literal["fastest", "fewest_nodes", "largest_model"] = "fastest"
    singles: list[Literal["balanced", "throughput", "capture", "mpress", "stronghold", "map"]] = Field(
        list(SINGLE_POLICIES), description="single-technique policies planned beside the joint search")
    microbatch_sizes: list[Annotated[int, Field(ge=1, le=1 << 16)]] | None = Field(
        None, max_length=8, description="samples per microbatch tried; null: the training's, half and double")
    schedules: list[Literal["1f1b", "gpipe", "pipedream_async", "zb_h1", "zbv"]] | None = Field(
        None, description="pipeline schedules tried in the layout table; null: 1f1b and gpipe (and the training's "
                          "own); zb_h1 and zbv (v = 2) are also tried on the fastest plans (planners/auto/knobs.py)")
    allow_async: bool | None = Field(None, description="also PipeDream-async (it changes the optimisation); "
                                                       "null: only when schedule=pipedream_async")
    zero_stages: list[Annotated[int, Field(ge=0, le=3)]] = Field(
        [0, 1], min_length=1, description="ZeRO stages tried; 1 is Megatron's distributed optimizer, with "
                                          "overlap_grad_reduce where dp > 1 (Megatron-Core's default)")
    max_layouts: int = Field(12, ge=1, le=1000, description="layouts compacted and simulated, best bound first")
    max_simulations: int = Field(120, ge=1, le=10_000, description="emulator runs per layout's compaction")
    improve_layouts: int = Field(6, ge=0, le=1000, description="layouts whose compaction gets MPress's improve "
                                                               "rounds (the fastest after the screening pass)")
    max_nodes: int = Field(1024, ge=1, le=1 << 16, description="find=fewest_nodes: the most nodes tried")
    scale: Literal["layers", "hidden"] = Field("layers", description="find=largest_model: what grows")


PolicyConfig = Annotated[Union[EvenPolicy, BalancedPolicy, ManualPolicy, CapturePolicy, ThroughputPolicy,
                               MPressPolicy, StrongholdPolicy, MapPolicy, AutoPolicy, ZeroOffloadPolicy],
                         Field(discriminator="kind")]
_adapter: TypeAdapter = TypeAdapter(PolicyConfig)


def parse_policy(data: dict) -> PolicyConfig:
    return _adapter.validate_python(data)
