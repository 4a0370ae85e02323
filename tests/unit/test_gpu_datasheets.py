"""The GPU catalog agrees with data/gpu-datasheets.json."""

from __future__ import annotations

import json
import re

import pytest

from hybridserve.core.paths import data_path
from hybridserve.sim.gpus import GPUS
from tests.conftest import require_data

DATASHEETS = data_path("gpu-datasheets.json")
CATALOG_NAME = {"A100": "A100-80G", "H100": "H100-SXM", "H200": "H200", "B200": "B200"}
CATALOG_NAME["MI300X"] = "MI300X"
CATALOG_NAME["GH200"] = "GH200"


def _entries() -> list[dict[str, object]]:
    return list(json.loads(require_data("gpu-datasheets.json").read_text()))


def _link_per_direction_gb_s(text: str) -> float:
    """The per-GPU link figure of the datasheet text, halved (it is a bidirectional total)."""
    match = re.search(r"([\d.]+) (TB|GB)/s", text)
    assert match is not None, text
    value = float(match.group(1)) * (1000 if match.group(2) == "TB" else 1)
    if "x 128 GB/s" in text:  # Infinity Fabric: 7 links x 128 GB/s aggregate
        value = 896.0
    return value / 2


def test_catalog_matches_every_datasheet_entry() -> None:
    entries = _entries()
    assert len(entries) == len(GPUS)
    for entry in entries:
        name = CATALOG_NAME[str(entry["gpu"]).split("-")[0].split(" ")[0]]
        gpu = GPUS[name]
        assert gpu.bf16_flops == pytest.approx(float(entry["bf16_dense"]) * 1e12), name  # type: ignore[arg-type]
        for key, value in (("fp8_dense", gpu.fp8_flops), ("fp4_dense", gpu.fp4_flops)):
            sheet = entry[key]
            assert (value is None) == (sheet is None), (name, key)
            if value is not None:
                assert value == pytest.approx(float(sheet) * 1e12), (name, key)  # type: ignore[arg-type]
        assert gpu.hbm_bytes == pytest.approx(float(entry["hbm_gb"]) * 1e9), name  # type: ignore[arg-type]
        assert gpu.hbm_bytes_per_s == pytest.approx(float(entry["hbm_tb_s"]) * 1e12), name  # type: ignore[arg-type]
        link = _link_per_direction_gb_s(str(entry["link"]))
        assert gpu.link_bytes_per_s == pytest.approx(link * 1e9), name


def test_the_host_link_of_a_datasheet_entry_is_the_catalogs() -> None:
    for entry in _entries():
        text = entry.get("host_link")
        if text is None:
            continue
        name = CATALOG_NAME[str(entry["gpu"]).split("-")[0].split(" ")[0]]
        match = re.search(r"([\d.]+) GB/s per direction", str(text))
        assert match is not None, text
        assert GPUS[name].host_link_bytes_per_s == pytest.approx(float(match.group(1)) * 1e9)
