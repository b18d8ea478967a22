"""Pure cost models, one module per mechanism, shared by the simulator and the planners.

specs (types) <- costs <- simulator <- planners; the executor reads costs for buffer sizes.
Modules: params, activations, static, buffers (memory); layer_time, collectives, gemm (time);
window (STRONGHOLD's window arithmetic); map_strategies, map_layout, rotor (MAP's strategy and
layout-conversion costs, rotor's sequence semantics); families (+ family_*, op_counts: layer
costs per model family). Nothing here does I/O or imports torch at module level.
"""
