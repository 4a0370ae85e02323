"""Calibrations: cost-model constants fitted on step times measured on one device.

`hybridserve calibrate` measures the torch executor over a grid of step shapes, fits the
`Efficiency` constants on part of them (hybridserve.sim.calibration_fit; the rest is held out
to report an honest error) and writes a `Calibration` as JSON; `hybridserve simulate
--calibration FILE` loads it and uses its `Gpu` and `Efficiency`.

A device in the GPU catalog keeps its datasheet peaks (`peaks="datasheet"`). Any other device (a
CPU) gets a Gpu of peaks measured by microbenchmarks (`peaks="measured"`: matmul FLOP/s,
copy bytes/s), so the fitted efficiencies stay fractions of a measured peak.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.sim.cost_model import Efficiency, RequestShape, StepShape
from hybridserve.sim.gpus import Gpu

SCHEMA_VERSION = 1
PEAK_SOURCES = ("datasheet", "measured")
# wall: time.perf_counter; cpu: the measuring thread's CPU time (one torch thread on a CPU).
CLOCKS = ("wall", "cpu")
_RERUN = "rerun `hybridserve calibrate` to write a valid calibration file"


def describe(shape: StepShape) -> str:
    """'prefill 512 after 1024' or 'decode 16 x 2048' (other mixes: their request runs)."""
    runs = _runs(shape)
    if len(runs) == 1:
        new, context, count = runs[0]
        if count == 1 and new > 1:
            return f"prefill {new} after {context}" if context else f"prefill {new}"
        if new == 1 and shape.shared_kv_tokens:
            return f"decode {count} x {context} sharing {shape.shared_prefix_tokens}"
        if new == 1:
            return f"decode {count} x {context}"
    return " + ".join(f"{count} x ({new} new after {context})" for new, context, count in runs)


def _runs(shape: StepShape) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for r in shape.requests:
        if runs and runs[-1][:2] == (r.num_new_tokens, r.num_context_tokens):
            runs[-1] = (*runs[-1][:2], runs[-1][2] + 1)
        else:
            runs.append((r.num_new_tokens, r.num_context_tokens, 1))
    return runs


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleRow:
    """One measured step shape: its requests as (new, context, count) runs and both times."""

    label: str
    requests: tuple[tuple[int, int, int], ...]
    measured_s: float
    predicted_s: float  # by the calibration's constants
    held_out: bool  # not used by the fit
    shared_kv_tokens: int = 0  # StepShape.shared_kv_tokens (decodes sharing a prefix)

    def __post_init__(self) -> None:
        for name in ("measured_s", "predicted_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"calibration.samples[{self.label}].{name}", value, _RERUN)
        if not self.requests or any(n < 1 or c < 0 or k < 1 for n, c, k in self.requests):
            raise ConfigError(f"calibration.samples[{self.label}].requests", self.requests, _RERUN)
        if self.shared_kv_tokens < 0:
            raise ConfigError(
                f"calibration.samples[{self.label}].shared_kv_tokens", self.shared_kv_tokens, _RERUN
            )

    @classmethod
    def of(
        cls, shape: StepShape, *, measured_s: float, predicted_s: float, held_out: bool
    ) -> SampleRow:
        return cls(
            label=describe(shape),
            requests=tuple(_runs(shape)),
            measured_s=measured_s,
            predicted_s=predicted_s,
            held_out=held_out,
            shared_kv_tokens=shape.shared_kv_tokens,
        )

    def shape(self) -> StepShape:
        requests = tuple(RequestShape(n, c) for n, c, k in self.requests for _ in range(k))
        return StepShape(requests, shared_kv_tokens=self.shared_kv_tokens)

    @property
    def relative_error(self) -> float:
        return self.predicted_s / self.measured_s - 1


@dataclass(frozen=True, slots=True)
class ErrorSummary:
    """Absolute relative errors |predicted / measured - 1| over some samples."""

    median: float
    max: float
    num_samples: int

    @classmethod
    def of(cls, rows: Sequence[SampleRow]) -> ErrorSummary | None:
        if not rows:
            return None
        errors = sorted(abs(r.relative_error) for r in rows)
        mid = len(errors) // 2
        median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
        return cls(median, errors[-1], len(errors))


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What `hybridserve calibrate` measured and fitted on one device; saved as JSON."""

    device: str  # the --gpu-name: a catalog GPU, or any name for a measured device
    gpu: Gpu  # its peaks: the datasheet (catalog) or the microbenchmarks (measured)
    peaks: str  # "datasheet" or "measured"
    efficiency: Efficiency  # fitted: gemm, attention, hbm, kv_hbm, step_overhead_s, shared_kv
    model: str  # the checkpoint measured (its folder name)
    dtype: str  # weights and activations the model ran in ("fp32" on a CPU)
    kv_dtype: str
    torch_version: str
    torch_device: str  # "cpu" or "cuda"
    num_threads: int  # torch intra-op threads during the measurement
    clock: str  # "wall" or "cpu" (see CLOCKS)
    seed: int  # token ids and the held-out split
    holdout_fraction: float
    samples: tuple[SampleRow, ...]
    in_sample: ErrorSummary
    held_out: ErrorSummary | None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ConfigError(
                "calibration.schema_version",
                self.schema_version,
                f"this hybridserve reads version {SCHEMA_VERSION}; {_RERUN}",
            )
        if self.peaks not in PEAK_SOURCES:
            raise ConfigError("calibration.peaks", self.peaks, f"use one of {PEAK_SOURCES}")
        if self.clock not in CLOCKS:
            raise ConfigError("calibration.clock", self.clock, f"use one of {CLOCKS}")
        for name in ("bf16_flops", "hbm_bytes", "hbm_bytes_per_s"):
            value = getattr(self.gpu, name)
            if not value > 0 or math.isinf(value):
                raise ConfigError(f"calibration.gpu.{name}", value, f"use > 0; {_RERUN}")
        if self.gpu.link_bytes_per_s < 0:
            raise ConfigError("calibration.gpu.link_bytes_per_s", self.gpu.link_bytes_per_s, _RERUN)
        if not self.samples:
            raise ConfigError("calibration.samples", [], f"hold at least one sample; {_RERUN}")
        if not 0 <= self.holdout_fraction < 1:
            raise ConfigError("calibration.holdout_fraction", self.holdout_fraction, _RERUN)

    # ----- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["samples"] = [
            {**asdict(s), "requests": [list(r) for r in s.requests]} for s in self.samples
        ]
        order = ["schema_version", *(f.name for f in fields(self) if f.name != "schema_version")]
        return {key: data[key] for key in order}

    def save(self, path: Path) -> None:
        """Write the calibration as JSON (parent folders created)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read a calibration written by `save`. Raises ConfigError naming the file or the field."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                "calibration", str(path), "no such file; write one with `hybridserve calibrate`"
            ) from None
        except OSError as exc:
            raise ConfigError("calibration", str(path), f"give a readable file ({exc})") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("calibration", str(path), f"fix the JSON: {exc}") from None
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data: object) -> Calibration:
        if not isinstance(data, Mapping):
            raise ConfigError("calibration", type(data).__name__, "give a JSON object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ConfigError(
                "calibration.schema_version",
                version,
                f"this hybridserve reads version {SCHEMA_VERSION}; {_RERUN}",
            )
        read = _Reader(data, "calibration")
        samples = read.items("samples")
        try:
            efficiency = Efficiency(**read.numbers("efficiency", _EFFICIENCY_FIELDS))
        except ConfigError as exc:
            raise ConfigError(f"calibration.{exc.field}", exc.value, exc.fix) from None
        return cls(
            device=read.text("device"),
            gpu=Gpu(name=read.text("device"), **read.numbers("gpu", _GPU_FIELDS)),
            peaks=read.text("peaks"),
            efficiency=efficiency,
            model=read.text("model"),
            dtype=read.text("dtype"),
            kv_dtype=read.text("kv_dtype"),
            torch_version=read.text("torch_version"),
            torch_device=read.text("torch_device"),
            num_threads=int(read.number("num_threads")),
            clock=read.text("clock"),
            seed=int(read.number("seed")),
            holdout_fraction=read.number("holdout_fraction"),
            samples=tuple(_sample(s, f"calibration.samples[{i}]") for i, s in enumerate(samples)),
            in_sample=_summary(read.mapping("in_sample"), "calibration.in_sample"),
            held_out=None
            if data.get("held_out") is None
            else _summary(read.mapping("held_out"), "calibration.held_out"),
        )


_EFFICIENCY_FIELDS = tuple(f.name for f in fields(Efficiency))
# name is the calibration's device; the optional peaks may be null.
_GPU_FIELDS = tuple(f.name for f in fields(Gpu) if f.name != "name")
_OPTIONAL = (
    "fp8_flops",
    "fp4_flops",
    "fp32_flops",
    "reported_bytes",
    "kv_hbm",
    "fp32_stream_bytes_per_s",
    "bf16_stream_bytes_per_s",
)
# Fields newer than some calibration files: a file without them keeps the defaults.
_ADDED_LATER = (
    "reported_bytes",
    "moe_hbm",
    "recurrent_layer_s",
    "kv_hbm",
    "host_link_bytes_per_s",
    "host_link_latency_s",
    "shared_kv",
    "fp32_stream_bytes_per_s",
    "bf16_stream_bytes_per_s",
)


@dataclass(frozen=True, slots=True)
class _Reader:
    """Typed access to one JSON object, with errors that name the missing or wrong field."""

    data: Mapping[str, Any]
    where: str

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise ConfigError(f"{self.where}.{key}", None, f"the field is missing; {_RERUN}")
        return self.data[key]

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise ConfigError(f"{self.where}.{key}", value, "give a string")
        return value

    def number(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.where}.{key}", value, "give a number")
        return float(value)

    def mapping(self, key: str) -> _Reader:
        value = self._get(key)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.where}.{key}", value, "give a JSON object")
        return _Reader(value, f"{self.where}.{key}")

    def items(self, key: str) -> list[Any]:
        value = self._get(key)
        if not isinstance(value, list):
            raise ConfigError(f"{self.where}.{key}", value, "give a JSON list")
        return value

    def numbers(self, key: str, names: Sequence[str]) -> dict[str, Any]:
        inner = self.mapping(key)
        return {
            name: None
            if name in _OPTIONAL and inner.data.get(name, 0) is None
            else inner.number(name)
            for name in names
            if name in inner.data or name not in _ADDED_LATER
        }


def _sample(value: object, where: str) -> SampleRow:
    if not isinstance(value, Mapping):
        raise ConfigError(where, value, "give a JSON object")
    read = _Reader(value, where)
    requests = []
    for run in read.items("requests"):
        if (
            not isinstance(run, list)
            or len(run) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in run)
        ):
            raise ConfigError(f"{where}.requests", run, "give [new, context, count] integers")
        requests.append((run[0], run[1], run[2]))
    held_out = read._get("held_out")
    if not isinstance(held_out, bool):
        raise ConfigError(f"{where}.held_out", held_out, "give true or false")
    # Added later: a file without it measured no shared prefix.
    shared = read.number("shared_kv_tokens") if "shared_kv_tokens" in value else 0
    if shared != int(shared):
        raise ConfigError(f"{where}.shared_kv_tokens", shared, "give a whole number of tokens")
    return SampleRow(
        label=read.text("label"),
        requests=tuple(requests),
        measured_s=read.number("measured_s"),
        predicted_s=read.number("predicted_s"),
        held_out=held_out,
        shared_kv_tokens=int(shared),
    )


def _summary(read: _Reader, where: str) -> ErrorSummary:
    return ErrorSummary(read.number("median"), read.number("max"), int(read.number("num_samples")))
