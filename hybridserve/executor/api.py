"""The Executor protocol: a StepPlan in, a StepResult out."""

from __future__ import annotations

from typing import Protocol

from hybridserve.core.plan import StepPlan, StepResult


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: compute every chunk, sample one token per chunk that samples (plus
        accepted drafts), and report the step's duration."""
        ...
