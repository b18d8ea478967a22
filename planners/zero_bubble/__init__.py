"""Zero Bubble Pipeline Parallelism's automatic schedule (Qi et al. 2024, ICLR 2024, §3).

``heuristic``: the §3.1 search over pure numbers (T_F, T_B, T_W, T_comm per stage, memory deltas and
a limit) -> one F/B/W order per stage. ``order``: a plan's inputs to it from memwall's cost model and
the order written into ``schedule.order`` (schedule=zb_auto; conf/schedule/zb_1p.yaml, zb_2p.yaml).
"""
