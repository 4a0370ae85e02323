"""The PyTorch executor: real models over paged K/V and recurrent state, CPU or CUDA.

`load_model(path)` reads a local Hugging Face checkpoint folder (config.json + safetensors) or a
GGUF file; `TorchExecutor(model, num_blocks=...)` implements the Executor protocol. The model
interface is documented in `hybridserve.executor.torch.models.base`.
"""

from hybridserve.executor.torch.executor import TorchExecutor
from hybridserve.executor.torch.loader import load_model

__all__ = ["TorchExecutor", "load_model"]
