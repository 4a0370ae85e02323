"""The valid values the commands list in their help: one source, so every command shows the
same models, GPUs and speculative methods, taken from the catalogs themselves."""

from __future__ import annotations

from hybridserve.core.config import SPECULATION_NAMES
from hybridserve.engine.settings import DEFAULT_PRESET, PRESETS
from hybridserve.layouts import LAYOUTS
from hybridserve.sim.gpus import GPUS
from hybridserve.sim.model_profiles import MODELS
from hybridserve.sim.routers import LOAD_WEIGHT

SIM_MODELS = tuple(sorted(MODELS))
GPU_NAMES = tuple(GPUS)
SPECULATION_METHODS = SPECULATION_NAMES
CACHE_LAYOUTS = tuple(sorted(LAYOUTS))
# The prefix routers' load weight, one default for every fleet command.
ROUTER_LOAD_WEIGHT = LOAD_WEIGHT


def listed(values: tuple[str, ...]) -> str:
    return ", ".join(values)


# What `--model` names, said in the same words by every command (`hybridserve --help` lists
# which commands take which).
MODEL_HELP = f"Model profile (simulated): {listed(SIM_MODELS)}."
CHECKPOINT_HELP = (
    "Checkpoint: a folder (config.json + safetensors), a .gguf file, or a built-in alias: "
    "smollm2, gemma3-270m (fetch them with `make models`)."
)
SERVED_MODEL_HELP = "Served model name at --url [default: the first one /v1/models lists]."
GPU_HELP = f"GPU: {listed(GPU_NAMES)}."
SPECULATION_HELP = (
    f"Speculative method: {listed(SPECULATION_METHODS)} "
    "(eagle, eagle3 and mtp use vLLM 0.33's lookahead block hashes; their -legacy forms drop "
    "the last matched block of a prefix hit instead)."
)
PRESET_HELP = f"{listed(PRESETS)} [default: the --config file's preset, else {DEFAULT_PRESET}]."
# The torch device of every command that runs a real model (`serve`, `generate`): one default.
DEFAULT_DEVICE = "auto"
DEVICE_HELP = "Torch: auto (CUDA when available, else cpu), cpu, cuda, cuda:N."
