"""The engine loop: schedule -> execute -> update -> outputs."""

from hybridserve.engine.engine import Engine, EngineStep

__all__ = ["Engine", "EngineStep"]
