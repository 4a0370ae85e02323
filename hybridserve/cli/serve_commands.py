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
import json
import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hybridserve.cli.app import MODELS_EXTRA, app, fail, install_hint, need_extra
from hybridserve.cli.choices import MODEL_HELP, SPEC_HELP
from hybridserve.cli.sim_commands import DtypeOption, GpuOption, SeedOption, TpOption
from hybridserve.core.config import SchedulerConfig, SchedulingPolicy
from hybridserve.core.errors import ConfigError, HybridServeError

if TYPE_CHECKING:
    from hybridserve.server.app import ServerSettings
    from hybridserve.server.backend import ServingBackend

TORCH_MODEL_ALIASES = ("smollm2", "gemma3-270m")
API_KEY_ENV = "HYBRIDSERVE_API_KEY"
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
    need_extra("models", *MODELS_EXTRA, what="serve --executor torch")
    try:
        importlib.import_module("hybridserve.executor.torch")
        module = importlib.import_module("hybridserve.cli.torch_serving")
    except ImportError as exc:
        raise fail(
            f"--executor torch needs the hybridserve.executor.torch package, which cannot be "
            f"imported here ({exc}). Install a build that includes it with its models extra "
            f"({install_hint('models')}), or serve synthetic tokens with --executor sim."
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
        str, typer.Option(help=f"Sim: the model. {MODEL_HELP}")
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
    spec: Annotated[str, typer.Option(help=f"Sim: {SPEC_HELP}")] = "none",
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
        str | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' (not on /health). Other local users can "
            "read a command line: prefer --api-key-file or $HYBRIDSERVE_API_KEY."
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="Read the API key from this file (one line).")
    ] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(help="A browser origin allowed to call the API (CORS); repeatable."),
    ] = None,
    max_request_bytes: Annotated[int, typer.Option(help="Largest request body.")] = 1 << 20,
    max_waiting: Annotated[
        int,
        typer.Option(
            help="Requests waiting for admission (1 or more) beyond which new ones get 503 + "
            "Retry-After."
        ),
    ] = 1024,
    max_failed_steps: Annotated[
        int,
        typer.Option(help="Failed executor steps in a row before the server exits (status 1)."),
    ] = 3,
    default_max_tokens: Annotated[
        int,
        typer.Option(
            help="max_tokens of a chat request that sets none (at most the room under "
            "--max-model-len); completions default to 16, as in OpenAI's API."
        ),
    ] = 2048,
    sim_eos_probability: Annotated[
        float,
        typer.Option(
            help="Sim: probability that each generated token is <eos> (answers of mean length "
            "1/P; 0 = only max_tokens or a stop ends them)."
        ),
    ] = 1 / 256,
    shutdown_timeout: Annotated[
        float, typer.Option(help="Seconds running requests get to finish on shutdown.")
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
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            help="The model id clients put in requests (repeatable: each is accepted, responses "
            "name the first). Default: the model's own name (the sim profile, the torch alias "
            "or the checkpoint folder's name)."
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(help="Torch: intra-op threads (default: every core this process may use)."),
    ] = None,
    kv_events: Annotated[
        str | None, typer.Option(help="Publish KV events (vLLM's format) at tcp://HOST:PORT.")
    ] = None,
) -> None:
    """Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /metrics."""
    need_extra(
        "server", "uvicorn", "fastapi", "pydantic", "prometheus_client", what="hybridserve serve"
    )

    from hybridserve.server.app import ServerSettings
    from hybridserve.server.kv_events import attach_kv_events
    from hybridserve.server.runner import serve

    if executor not in ("sim", "torch"):
        raise fail(f"--executor {executor!r}: use sim or torch")
    if dcp != 1 and executor != "torch":
        raise fail(f"--dcp={dcp}: decode context parallel runs with --executor torch")
    _check_serve_flags(port=port, max_waiting=max_waiting, default_max_tokens=default_max_tokens)
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
    if max_failed_steps < 1:
        raise fail(f"--max-failed-steps={max_failed_steps}: use 1 or more")
    if shutdown_timeout < 0:
        raise fail(f"--shutdown-timeout={shutdown_timeout}: use 0 or more seconds")
    names = tuple(dict.fromkeys(served_model_name or ()))
    if any(not name.strip() for name in names):
        raise fail("--served-model-name: give a non-empty name")
    settings = ServerSettings(
        served_model_names=names,
        api_key=resolve_api_key(api_key, api_key_file, os.environ.get(API_KEY_ENV)),
        max_request_bytes=max_request_bytes,
        max_waiting=max_waiting,
        max_failed_steps=max_failed_steps,
        shutdown_timeout_s=shutdown_timeout,
        allow_origins=tuple(allow_origin or ()),
        default_max_tokens=default_max_tokens,
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
                eos_probability=sim_eos_probability,
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
        attach_kv_events(server_app, kv_events)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    banner = startup_banner(server_app.state.hybridserve, host=host, port=port)
    code = serve(server_app, host=host, port=port, banner=banner)
    if code:
        raise typer.Exit(code)


def startup_banner(state: Any, *, host: str, port: int) -> str:
    """What `serve` prints once it listens: where, the model id to put in requests, what runs,
    and every resolved setting."""
    from hybridserve.kvcache.spec import state_quantum

    shown_host = f"[{host}]" if ":" in host else host
    base = f"http://{shown_host}:{port}"
    scheduler = state.parts.scheduler.config
    layout = state.parts.cache.layout
    settings = state.settings
    names = ", ".join(f'"{name}"' for name in state.model_names)
    values = {f.name: getattr(scheduler, f.name) for f in fields(scheduler)}
    limits = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in values.items())
    example = json.dumps({"model": state.model_name, "prompt": "Hello", "max_tokens": 16})
    lines = [
        f"hybridserve serve: listening on {base} (OpenAI API at {base}/v1)",
        f'  model id:  {names} (the "model" of every request; GET /v1/models lists it)',
        f"  executor:  {state.backend.description}",
        f"  cache:     {layout.num_blocks} blocks, groups "
        + ", ".join(g.kind.value for g in layout.groups)
        + f", retention {layout.retention.kind.value}, state quantum "
        f"{state_quantum(layout.groups)} tokens",
        f"  scheduler: {limits}",
        f"  requests:  default max_tokens {settings.default_max_tokens} (chat) / 16 "
        f"(completions); max_waiting={settings.max_waiting}; "
        f"max_request_bytes={settings.max_request_bytes}; "
        f"API key {'required' if settings.api_key else 'not required'}; "
        f"shutdown_timeout={settings.shutdown_timeout_s:g}s",
        f"  try:       curl -s {base}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{example}'",
    ]
    return "\n".join(lines)


def resolve_api_key(flag: str | None, file: Path | None, env: str | None) -> str | None:
    """The API key from --api-key, else --api-key-file, else $HYBRIDSERVE_API_KEY; None when
    none is given. Giving both flags, or an empty key, is an error."""
    if flag is not None and file is not None:
        raise fail("--api-key and --api-key-file: give one of them")
    if file is not None:
        try:
            key = file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"--api-key-file {str(file)!r}: cannot read it ({exc})") from None
        if not key:
            raise fail(f"--api-key-file {str(file)!r} is empty; write the key on one line")
        return key
    given = flag if flag is not None else env
    if given is None:
        return None
    if not given.strip():
        source = "--api-key" if flag is not None else f"${API_KEY_ENV}"
        raise fail(f"{source} is empty; give a key or leave it unset")
    return given.strip()


def _check_serve_flags(*, port: int, max_waiting: int, default_max_tokens: int) -> None:
    """Refuse, before anything starts, the values the server could only fail on later."""
    if not 1 <= port <= 65535:
        raise fail(f"--port={port} is invalid: use a TCP port in 1-65535 (e.g. 8000)")
    if max_waiting < 1:
        raise fail(
            f"--max-waiting={max_waiting} is invalid: it is how many requests may wait for "
            "admission before new ones get 503; use 1 or more (default 1024)"
        )
    if default_max_tokens < 1:
        raise fail(f"--default-max-tokens={default_max_tokens} is invalid: use 1 or more")


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
