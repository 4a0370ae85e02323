"""The engine loop: schedule -> execute -> update -> outputs."""

from hybridserve.engine.engine import Engine, EngineStep, RequestFailure, StepFailed

__all__ = ["Engine", "EngineStep", "RequestFailure", "StepFailed"]
