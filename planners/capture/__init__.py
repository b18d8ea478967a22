"""CAPTURE: memory-centric partitioning for hybrid pipeline + per-stage dp/tp: profile (profiling
runs and statistical fits, §III-A/B), planner (recommender and merger, §III-C)."""
