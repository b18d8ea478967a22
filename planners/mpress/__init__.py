"""MPress (Zhou et al., HPCA'23): recompute, GPU->CPU swap and D2D swap over NVLink, chosen by
an emulator loop (§III-B): planner (base pipeline, emulate, improve), assign (per-layer actions),
mapping (stage->device mapping and striping)."""
