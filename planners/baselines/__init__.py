"""Baseline planners: partition (even, balanced, manual layer splits) and throughput
(Megatron-style dp x tp x pp search over the stage table)."""
