"""A built-in GGUF model (`smollm2`, `gemma3-270m`) as a Hugging Face checkpoint folder, so that
`serve --executor torch` and vLLM load the same float32 weights from the same files.

The weights are the ones hybridserve's own GGUF loader produces (dequantised, llama q/k
permutation undone, Gemma norms as `w` under `x * (1 + w)`), written as `model.safetensors` under
transformers' tensor names; `config.json` and the tokenizer files come from transformers' GGUF
reader (its complete config for the architecture), with the quantisation entry removed and
`torch_dtype` float32. The folder is written once, next to the GGUF (`models/ALIAS-hf/`), and
reused while the GGUF it came from is unchanged (`source.json` records its size and mtime).

    python benchmarks/hf_checkpoint.py smollm2 [--out DIR]     # prints the folder
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from hybridserve.executor.torch.checkpoints import BUILTINS, builtin_path, models_dir

SOURCE_FILE = "source.json"


def default_folder(alias: str) -> Path:
    return models_dir() / f"{alias}-hf"


def _source_stamp(gguf: Path) -> dict[str, Any]:
    stat = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _is_current(folder: Path, stamp: dict[str, Any]) -> bool:
    source = folder / SOURCE_FILE
    if not source.is_file() or not (folder / "model.safetensors").is_file():
        return False
    return bool(json.loads(source.read_text()) == stamp)


def hf_checkpoint(alias: str, folder: Path | None = None) -> Path:
    """The checkpoint folder of built-in `alias`, written if missing or stale; returns it.
    Raises SystemExit naming the fix when the GGUF is not fetched or the alias is unknown."""
    if alias not in BUILTINS:
        raise SystemExit(f"--model {alias!r}: use one of {sorted(BUILTINS)}")
    gguf = builtin_path(alias)
    if not gguf.is_file():
        raise SystemExit(f"--model {alias}: {gguf} is missing; fetch it with `make models`")
    folder = folder or default_folder(alias)
    stamp = _source_stamp(gguf)
    if _is_current(folder, stamp):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    architectures = _write_weights(gguf, folder)
    _write_config_and_tokenizer(gguf, folder, architectures)
    (folder / SOURCE_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    return folder


def _write_weights(gguf: Path, folder: Path) -> list[str]:
    """hybridserve's dequantised float32 tensors, under transformers' names; returns the
    model's `architectures` (transformers' GGUF config leaves them out)."""
    from safetensors.torch import save_file

    from hybridserve.executor.torch.gguf_loader import load_gguf_model

    model = load_gguf_model(gguf)
    tied = bool(model.config.get("tie_word_embeddings"))
    tensors = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return list(model.config["architectures"])


def _write_config_and_tokenizer(gguf: Path, folder: Path, architectures: list[str]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    data = json.loads((folder / "config.json").read_text())
    data.pop("quantization_config", None)
    data.update(architectures=architectures, dtype="float32")
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(BUILTINS))
    parser.add_argument("--out", type=Path, default=None, help="folder [default: models/ALIAS-hf]")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(hf_checkpoint(args.model, args.out))


if __name__ == "__main__":
    main()
