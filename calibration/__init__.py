"""Calibration: runs the executor, fits rates, compares with the simulator (above both).

calibrate (mode=calibrate's microbenchmarks and the YAML it writes), gemm and dtensor (their
kernels), contention (rates refitted from a real executor run), cluster (MAP §4.2's detector run
on the ranks), prediction_error (CAPTURE §IV-B's plan sampling and error statistics).
"""
