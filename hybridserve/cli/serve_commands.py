"""`hybridserve serve`: the OpenAI-compatible server on the simulated or the torch executor.

Scheduler settings resolve in three layers: the preset (as in `hybridserve simulate`), then
`--config FILE.toml`, then the flags given on the command line. The TOML file takes top-level
`preset` and `retention` and a `[scheduler]` table of SchedulerConfig fields:

    preset = "baseline"
    retention = "boundary+predecessor"
    [scheduler]
    max_num_seqs = 128
    target_mixed_step_ms = 40.0
"""

from __future__ import annotations

import importlib
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hybridserve.cli.app import app, fail
from hybridserve.cli.sim_commands import DtypeOption, GpuOption, SeedOption, TpOption
from hybridserve.core.config import SchedulerConfig, SchedulingPolicy
from hybridserve.core.errors import ConfigError, HybridServeError

if TYPE_CHECKING:
    from hybridserve.server.app import ServerSettings
    from hybridserve.server.backend import ServingBackend

TORCH_MODEL_ALIASES = ("smollm2", "gemma3-270m")
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}


def scheduler_settings(
    *,
    groups_quantum: int,
    max_model_len: int,
    preset_name: str,
    config_file: Path | None,
    overrides: dict[str, Any],
) -> tuple[SchedulerConfig, str]:
    """(SchedulerConfig, retention policy text): preset, then the TOML file, then flags."""
    from hybridserve.sim.run import preset

    table: dict[str, Any] = {}
    retention: str | None = None
    if config_file is not None:
        try:
            document = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError("config", str(config_file), f"cannot read it: {exc}") from None
        unknown = set(document) - {"preset", "retention", "scheduler"}
        if unknown:
            raise ConfigError("config", sorted(unknown), "use preset, retention, [scheduler]")
        preset_name = document.get("preset", preset_name)
        retention = document.get("retention")
        table = dict(document.get("scheduler", {}))
        bad = set(table) - _SCHEDULER_FIELDS
        if bad:
            raise ConfigError("config.scheduler", sorted(bad), f"use {sorted(_SCHEDULER_FIELDS)}")
    chosen = preset(preset_name, quantum=groups_quantum, max_model_len=max_model_len)
    merged = {**table, **{k: v for k, v in overrides.items() if v is not None}}
    if "policy" in merged:
        try:
            merged["policy"] = SchedulingPolicy(merged["policy"])
        except ValueError:
            choices = [p.value for p in SchedulingPolicy]
            raise ConfigError("scheduler.policy", merged["policy"], f"use {choices}") from None
    scheduler = replace(chosen.scheduler, **merged)
    return scheduler, retention or chosen.retention.kind.value


def _torch_backend(
    model: str, *, device: str, max_model_len: int | None, dcp: int = 1, dcp_interleave: int = 1
) -> ServingBackend:
    if model not in TORCH_MODEL_ALIASES and not Path(model).exists():
        raise fail(f"--model {model!r}: use {' or '.join(TORCH_MODEL_ALIASES)} or a local path")
    try:
        importlib.import_module("hybridserve.executor.torch")
        module = importlib.import_module("hybridserve.cli.torch_serving")
    except ImportError as exc:
        raise fail(
            f"--executor torch needs the hybridserve.executor.torch package, which cannot be "
            f"imported here ({exc}). Install a build that includes it with its `torch` extra, "
            "or serve synthetic tokens with --executor sim --model-profile NAME."
        ) from None
    factory = getattr(module, "serving_backend", None)
    if factory is None:
        raise fail("hybridserve.cli.torch_serving has no serving_backend(); it cannot be served")
    try:
        backend: ServingBackend = factory(
            model,
            device=device,
            max_model_len=max_model_len,
            dcp=dcp,
            dcp_interleave=dcp_interleave,
        )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    return backend


@app.command("serve")
def serve_cmd(
    executor: Annotated[str, typer.Option(help="sim (synthetic tokens) or torch.")] = "sim",
    model_profile: Annotated[
        str, typer.Option(help="Sim: the model profile (see `simulate --model`).")
    ] = "qwen3-next-80b-a3b",
    model: Annotated[
        str, typer.Option(help="Torch: smollm2, gemma3-270m or a local checkpoint path.")
    ] = "smollm2",
    device: Annotated[
        str, typer.Option(help="Torch: auto (CUDA when available), cpu, cuda, cuda:N.")
    ] = "auto",
    gpu: GpuOption = "H200",
    tp: TpOption = 1,
    dtype: DtypeOption = "fp8",
    spec: Annotated[str, typer.Option(help="Sim: speculative method (none, mtp, ...).")] = "none",
    seed: SeedOption = 0,
    sim_speed: Annotated[
        float, typer.Option(help="Sim: wall time of a step = modelled time / this (1 = real).")
    ] = 1.0,
    preset: Annotated[
        str, typer.Option(help="baseline, hybridserve, controls-only or retention-only.")
    ] = "hybridserve",
    config: Annotated[
        Path | None, typer.Option(help="TOML file: preset, retention and a scheduler table.")
    ] = None,
    retention: Annotated[
        str | None, typer.Option(help="Mamba retention: boundary, boundary+predecessor, ...")
    ] = None,
    num_blocks: Annotated[int | None, typer.Option(help="Cap the KV pool (blocks).")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context limit (tokens).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Running requests limit.")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Tokens per step.")] = None,
    policy: Annotated[str | None, typer.Option(help="Waiting-queue order: fcfs, priority.")] = None,
    enable_chunked_prefill: Annotated[
        bool | None, typer.Option(help="Split long prefills across steps.")
    ] = None,
    long_prefill_token_threshold: Annotated[
        int | None, typer.Option(help="Cap a long prefill's chunk (0 = off).")
    ] = None,
    max_num_prefill_tokens_per_step: Annotated[
        int | None, typer.Option(help="Control: prefill tokens per mixed step (0 = off).")
    ] = None,
    max_num_partial_prefills: Annotated[
        int | None, typer.Option(help="Control: concurrent partial prefills (0 = off).")
    ] = None,
    decode_prefill_min_decode_steps: Annotated[
        int | None, typer.Option(help="Control: decode-only steps between prefills (0 = off).")
    ] = None,
    decode_prefill_max_wait_ms: Annotated[
        float | None, typer.Option(help="Control: oldest-waiter deadline in ms (0 = off).")
    ] = None,
    target_mixed_step_ms: Annotated[
        float | None, typer.Option(help="Control: adaptive mixed-step time target (0 = off).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    api_key: Annotated[
        str | None, typer.Option(help="Require 'Authorization: Bearer KEY' (not on /health).")
    ] = None,
    max_request_bytes: Annotated[int, typer.Option(help="Largest request body.")] = 1 << 20,
    max_waiting: Annotated[
        int, typer.Option(help="Queued requests before answering 503 + Retry-After.")
    ] = 1024,
    shutdown_timeout: Annotated[
        float, typer.Option(help="Seconds in-flight requests get to finish on shutdown.")
    ] = 30.0,
    dcp: Annotated[
        int,
        typer.Option(
            help="Torch: decode context parallel ranks (local processes; this one is rank 0 "
            "and schedules). Full-attention KV is sharded by token across them."
        ),
    ] = 1,
    dcp_interleave: Annotated[
        int, typer.Option(help="Torch: consecutive tokens per rank in the DCP round-robin.")
    ] = 1,
    threads: Annotated[
        int | None,
        typer.Option(help="Torch: intra-op threads (default: every core this process may use)."),
    ] = None,
) -> None:
    """Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /metrics."""
    import uvicorn

    from hybridserve.server.app import ServerSettings

    if executor not in ("sim", "torch"):
        raise fail(f"--executor {executor!r}: use sim or torch")
    if dcp != 1 and executor != "torch":
        raise fail(f"--dcp={dcp}: decode context parallel runs with --executor torch")
    if threads is not None and executor != "torch":
        raise fail(f"--threads={threads}: sets the torch executor's threads; use --executor torch")
    overrides = {
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "policy": policy,
        "enable_chunked_prefill": enable_chunked_prefill,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "max_num_prefill_tokens_per_step": max_num_prefill_tokens_per_step,
        "max_num_partial_prefills": max_num_partial_prefills,
        "decode_prefill_min_decode_steps": decode_prefill_min_decode_steps,
        "decode_prefill_max_wait_ms": decode_prefill_max_wait_ms,
        "target_mixed_step_ms": target_mixed_step_ms,
    }
    settings = ServerSettings(
        api_key=api_key, max_request_bytes=max_request_bytes, max_waiting=max_waiting
    )
    try:
        if executor == "torch":
            from hybridserve.cli.torch_runtime import set_threads

            set_threads(threads)
            backend = _torch_backend(
                model,
                device=device,
                max_model_len=max_model_len,
                dcp=dcp,
                dcp_interleave=dcp_interleave,
            )
        else:
            from hybridserve.cli.sim_backend import DEFAULT_MAX_MODEL_LEN, SimServingBackend

            backend = SimServingBackend(
                model_profile=model_profile,
                gpu=gpu,
                tp=tp,
                dtype=dtype,
                spec=spec,
                seed=seed,
                sim_speed=sim_speed,
                max_model_len=max_model_len or DEFAULT_MAX_MODEL_LEN,
            )
        server_app = build_app(
            backend,
            settings,
            preset_name=preset,
            config_file=config,
            retention=retention,
            num_blocks=num_blocks,
            overrides=overrides,
        )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    uvicorn.run(
        server_app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=int(shutdown_timeout),
    )


def build_app(
    backend: ServingBackend,
    settings: ServerSettings,
    *,
    preset_name: str = "hybridserve",
    config_file: Path | None = None,
    retention: str | None = None,
    num_blocks: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """The FastAPI app over `backend` with the resolved scheduler settings."""
    from hybridserve.kvcache import RetentionPolicy
    from hybridserve.kvcache.spec import state_quantum
    from hybridserve.server.app import ServerState, create_app
    from hybridserve.server.backend import build_engine

    overrides = dict(overrides or {})
    if overrides.get("max_model_len") is None:
        overrides["max_model_len"] = backend.max_model_len
    scheduler, retention_text = scheduler_settings(
        groups_quantum=state_quantum(backend.cache_groups()),
        max_model_len=backend.max_model_len,
        preset_name=preset_name,
        config_file=config_file,
        overrides=overrides,
    )
    policy = RetentionPolicy.parse(retention or retention_text)
    parts = build_engine(backend, scheduler, retention=policy, num_blocks=num_blocks)
    return create_app(ServerState(backend, parts, settings))
