"""MPress (Zhou et al., HPCA'23): recompute, GPU->CPU swap and D2D swap over NVLink, chosen by
an emulator loop (§III-B): planner (the loop), base (base pipeline), facts (per-layer costs),
mapping (stage->device mapping and striping), assign + choice (per-layer assignment), emulate
(one simulation), repair and improve (the emulator's feedback), outcome (result and reports)."""
