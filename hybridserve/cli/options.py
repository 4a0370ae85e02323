"""The options more than one command takes, each declared once (a test refuses a second
declaration of an alias, or of its help text, in another command module).

What `--model` names depends on what a command runs, and its help says which, in the same
words everywhere (`hybridserve --help` has the table): a model profile of the simulator's
catalog, a checkpoint of the torch executor, or the served model's name at a `--url`.

`scheduler_flags` gives `serve` and `generate` one flag per `SchedulerConfig` field, generated
from the dataclass: a new field needs one line of help in `SCHEDULER_FLAG_HELP` here.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridserve.cli.app import FINITE_FLOAT
from hybridserve.cli.choices import (
    DEVICE_HELP,
    GPU_HELP,
    MODEL_HELP,
    PRESET_HELP,
    SPECULATION_HELP,
)
from hybridserve.core.config import SchedulerConfig

# ----- every command that builds an engine or reports a run ------------------------------------

PresetOption = Annotated[str | None, typer.Option(help=PRESET_HELP)]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="TOML settings file: preset, [scheduler] fields and [cache] retention, over the "
        "preset and under the flags.",
    ),
]
RetentionOption = Annotated[
    str | None,
    typer.Option(
        help="State retention: dense, boundary, boundary+predecessor, boundary-only or "
        "interval:N [default: the preset's]."
    ),
]
SeedOption = Annotated[int, typer.Option(help="Seed: same seed, same report.")]
WarmupOption = Annotated[
    float, typer.Option(parser=FINITE_FLOAT, help="Seconds excluded from the metrics.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")]
OutOption = Annotated[
    Path | None, typer.Option(help="Also write report.json and plots to this folder.")
]
DeviceOption = Annotated[str, typer.Option(help=DEVICE_HELP)]
BlockSizeOption = Annotated[
    int,
    typer.Option(
        help="Torch: tokens per KV block, the unit of the pool and of prefix hits (vLLM's CPU "
        "attention takes multiples of 32)."
    ),
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(help="Torch: intra-op threads [default: every core this process may use]."),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        help="Sent to the server as `Authorization: Bearer KEY`.", envvar="OPENAI_API_KEY"
    ),
]
VocabOption = Annotated[
    int,
    typer.Option(
        help="Prompt token ids are sent in [0, N): at most the served model's vocabulary."
    ),
]

# ----- the simulator's commands (simulate, bench, sweep, fleet-sweep, suite, serve --executor sim)

SimModelOption = Annotated[str, typer.Option(help=MODEL_HELP)]
ModelConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--model-config",
        help="A Hugging Face config.json (or its folder): simulate that model instead of --model.",
    ),
]
GpuOption = Annotated[str, typer.Option(help=GPU_HELP)]
SimGpuOption = Annotated[
    str | None,
    typer.Option(help=f"{GPU_HELP[:-1]} [default: H200, or the calibration's]."),
]
DtypeOption = Annotated[str, typer.Option(help="Weight dtype: bf16, fp8, fp4.")]
SimDtypeOption = Annotated[
    str | None,
    typer.Option(help="Weight dtype: bf16, fp8, fp4, fp32 [default: fp8, or the calibration's]."),
]
KvDtypeOption = Annotated[
    str | None,
    typer.Option(
        help="KV cache / recurrent state dtype: bf16, fp16, fp8, fp32 [default: bf16, or the "
        "calibration's]."
    ),
]
TpOption = Annotated[int, typer.Option(help="Tensor-parallel width.")]
SimTpOption = Annotated[
    int | None, typer.Option(help="Tensor-parallel width [default: the --dcp width, or 1].")
]
SpeculationOption = Annotated[
    str,
    typer.Option(
        "--spec", help=f"{SPECULATION_HELP} auto: mtp when the model has MTP layers, else none."
    ),
]
WorkloadOption = Annotated[
    str,
    typer.Option(
        help="agents, mooncake:PATH, azure:PATH, poisson:rate=R,requests=N, "
        "fixed:input=I,output=O,concurrency=C[,requests=N] (closed loop) or "
        "fixed:input=I,output=O,rate=R[,requests=N] (Poisson)"
    ),
]
AgentsOption = Annotated[int, typer.Option(help="Agents running jobs back to back.")]
DurationOption = Annotated[
    float, typer.Option(parser=FINITE_FLOAT, help="Simulated seconds (per run).")
]
TimeScaleOption = Annotated[
    float, typer.Option(parser=FINITE_FLOAT, help="Multiply trace arrival times.")
]
LimitOption = Annotated[int | None, typer.Option(help="Keep the first N trace requests.")]
RouterViewOption = Annotated[
    str,
    typer.Option(
        help="What the router sees of a replica's cache: precise (the cache itself) or "
        "approximate (its own routing history, in an LRU)."
    ),
]
LoadWeightOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Prefix routers: score = prefix tokens served - weight x outstanding tokens.",
    ),
]
PdLinkOption = Annotated[
    str, typer.Option(help="The prefill-to-decode link: nvlink (the GPU's) or ib-ndr.")
]
WorkersOption = Annotated[int, typer.Option(help="Local worker processes.")]
NameOption = Annotated[
    str | None,
    typer.Option(help="Run name: files go under runs/NAME/ [default: a new runs/e1-DATE-TIME/]."),
]
FirstSeedOption = Annotated[int, typer.Option("--seed", help="The first seed.")]

# ----- the scheduler's settings as flags (serve, generate) --------------------------------------

# The help of each SchedulerConfig field's flag (`--max-num-seqs` for `max_num_seqs`). Every
# field has a line: a test fails on a field without one, or on a line without a field.
SCHEDULER_FLAG_HELP: dict[str, str] = {
    "max_num_seqs": "Running requests at most.",
    "max_num_batched_tokens": "Tokens per step (the token budget).",
    "max_model_len": "Context limit: prompt plus output, in tokens.",
    "enable_chunked_prefill": "Split long prefills across steps.",
    "long_prefill_token_threshold": "Cap a long prefill's chunk (0 = off).",
    "policy": "Waiting-queue order",
    "reserve_full_isl": "Admit a request only while its whole sequence fits the pool (vLLM's).",
    "max_num_prefill_tokens_per_step": "Control: prefill tokens per mixed step (0 = off).",
    "max_num_partial_prefills": "Control: concurrent partial prefills (0 = off).",
    "decode_prefill_min_decode_steps": "Control: decode-only steps between prefills (0 = off).",
    "decode_prefill_max_wait_ms": "Control: oldest-waiter deadline in ms (0 = off).",
    "target_mixed_step_ms": "Control: adaptive mixed-step time target (0 = off).",
    "adaptive_budget_itl_ms": "Adaptive prefill budget: the step time in ms that steps "
    "carrying decodes aim for (0 = off).",
    "adaptive_budget_queue_ms": "Adaptive prefill budget: the oldest waiter's wait in ms past "
    "which the budget grows to its ceiling (0 = never).",
    "adaptive_budget_pressure_itl_ms": "Adaptive prefill budget: the step-time limit in ms "
    "while that queue valve is open (0 = none).",
    "adaptive_budget_calm_itl_ms": "Adaptive prefill budget: the step time in ms aimed for "
    "while no prefill waits, rising to the aim as the oldest wait nears the valve (0 = off).",
    "adaptive_budget_context_weight": "Adaptive prefill budget: a chunk takes its tokens plus "
    "its attention pairs over S0 of it, S0 fitted from the step times (a chunk after a long "
    "context gets fewer tokens).",
    "waiting_deadline_ms": "First-token deadline: a request that has waited this many ms goes "
    "behind every waiting request that has not (0 = off; fcfs only).",
    "kv_pin_fraction": "Tool-call pinning: the fraction of the pool finished turns' prefixes "
    "may hold until their sessions return (0 = off).",
    "kv_pin_max_ttl_s": "Tool-call pinning: the longest a pin is held, in seconds.",
    "kv_pin_ttl_quantile": "Tool-call pinning: the quantile of the tool-call gaps a pin lasts.",
    "kv_pin_exact_tail": "Exact tails: a pin also holds the turn's partial last block and its "
    "state (needs --kv-pin-fraction > 0).",
    "program_priority": "Program-level order of waiting turns",
    "program_priority_max_wait_s": "Program priority: the wait in seconds after which a turn "
    "goes first.",
    "kv_aware_admission": "Admit a waiting request only if the running ones can still grow "
    "by their remaining output without a preemption.",
    "kv_admission_horizon_tokens": "KV-aware admission: the output tokens looked ahead.",
}


# What a flag not given leaves, when it is not the preset's (or the settings file's) value.
_NOT_THE_PRESETS = {"max_model_len": "the command's context limit for its model"}


def scheduler_options() -> dict[str, Any]:
    """The annotation of each SchedulerConfig field's flag, by field name: the field's type
    (an enum's values as text), None when not given, help from SCHEDULER_FLAG_HELP."""
    options: dict[str, Any] = {}
    for field in fields(SchedulerConfig):
        default = field.default
        text = SCHEDULER_FLAG_HELP[field.name].rstrip(".")
        unset = _NOT_THE_PRESETS.get(field.name, "the preset's")
        if isinstance(default, enum.Enum):
            values = ", ".join(str(member.value) for member in type(default))
            option = typer.Option(help=f"{text}: {values} [default: {unset}].")
            options[field.name] = Annotated[str | None, option]
            continue
        option_type = type(default)
        parser = FINITE_FLOAT if option_type is float else None
        option = typer.Option(help=f"{text} [default: {unset}].", parser=parser)
        options[field.name] = Annotated[option_type | None, option]
    return options


def scheduler_flags(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with one flag per SchedulerConfig field (`--max-num-seqs`, ...), None when not
    given. The command declares `**scheduler` and gets them there, by field name."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in own} & set(SCHEDULER_FLAG_HELP)
    if taken:
        raise TypeError(f"{command.__name__} declares scheduler flags itself: {sorted(taken)}")
    generated = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option)
        for name, option in scheduler_options().items()
    ]

    @functools.wraps(command)
    def with_flags(**given: Any) -> None:
        command(**given)

    with_flags.__signature__ = signature.replace(parameters=[*own, *generated])  # type: ignore[attr-defined]
    return with_flags
