"""Executor: run a plan for real with torch.distributed and measure it (issue #4).

    result = execute(plan, model_cfg, hardware, iterations=5, warmup=1, timeout_s=300)

Ranks are local processes (``torch.multiprocessing`` spawn; gloo on CPU, NCCL on CUDA); each
walks ``specs.schedule.build_schedule(plan)``, the action list the simulator walks. The result uses
the shared schema with ``source="measured"``; a failed run returns a Result whose ``failure``
names the rank and the error. Imports of torch.distributed stay inside this package.
"""
from executor.measure import UnsupportedPlan, execute, execute_run, measured_timeline, run_plan, unsupported

__all__ = ["UnsupportedPlan", "execute", "execute_run", "measured_timeline", "run_plan", "unsupported"]
