"""MAP (Zhang et al.): per-operator sharding on a device mesh under a memory budget.

cluster (§4.2 detector's grouping), problem/ilp/blocks (eq. 1), rotor and rotor_table
(checkpointing DP, §5.2), stage (one stage at one budget, §5.3) and plan (§5.3 budget search and the
refinement against the simulator). The strategy table, layout conversions and rotor's sequence
semantics are cost models: costs.map_strategies, costs.map_layout, costs.rotor.
"""
