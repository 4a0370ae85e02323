"""The valid values the commands list in their help: one source, so every command shows the
same models, GPUs and speculative methods, taken from the catalogs themselves."""

from __future__ import annotations

from hybridserve.core.config import SpecMethod
from hybridserve.profiles import PROFILES
from hybridserve.sim.gpus import GPUS
from hybridserve.sim.models import MODELS

SIM_MODELS = tuple(sorted(MODELS))
GPU_NAMES = tuple(GPUS)
SPEC_METHODS = tuple(m.value for m in SpecMethod)
CACHE_LAYOUTS = tuple(sorted(PROFILES))


def listed(values: tuple[str, ...]) -> str:
    return ", ".join(values)


MODEL_HELP = f"Model profile: {listed(SIM_MODELS)}."
GPU_HELP = f"GPU: {listed(GPU_NAMES)}."
SPEC_HELP = (
    f"Speculative method: {listed(SPEC_METHODS)} "
    "(eagle, eagle3 and mtp drop the target tail from prefix hits)."
)
