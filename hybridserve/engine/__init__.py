"""The engine loop: schedule -> execute -> update -> outputs."""

from hybridserve.engine.engine import Admission, Engine, EngineStep, RequestFailure, StepFailed

__all__ = ["Admission", "Engine", "EngineStep", "RequestFailure", "StepFailed"]
