"""MAP (Zhang et al.): per-operator sharding on a device mesh under a memory budget.

cluster (§4.2 detector's grouping), cluster_file (policy.cluster: a measured cluster.json as the mesh),
conv_table (layout-conversion costs, one Dijkstra per source), problem/ilp/blocks/fastest (eq. 1;
fastest: the budget-free optimum by min-sum elimination, tried first), rotor and rotor_table
(checkpointing DP, §5.2), stage (one stage at one budget, §5.3) and plan (§5.3 budget search and the
refinement against the simulator). The strategy table, layout conversions and rotor's sequence
semantics are cost models: costs.map_strategies, costs.map_layout, costs.rotor.
"""
