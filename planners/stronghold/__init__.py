"""STRONGHOLD: CPU (and NVMe) offload with a sliding GPU window of layers and the CPU optimizer
overlapped with the GPU (planner: the window choice, §III)."""
