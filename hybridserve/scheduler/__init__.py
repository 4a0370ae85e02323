"""The token-budget scheduler: vLLM v1 semantics, plus opt-in prefill/decode controls."""

from hybridserve.scheduler.output import SchedulerOutput
from hybridserve.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerOutput"]
