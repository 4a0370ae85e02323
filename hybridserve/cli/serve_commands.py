"""`hybridserve serve`: the OpenAI-compatible server on the simulated or the torch executor.

Scheduler settings and retention resolve as in `hybridserve simulate`: the preset, then
`--config FILE.toml` (the one settings file, `hybridserve.engine.settings`), then the flags
given on the command line.
"""

from __future__ import annotations

import errno
import importlib
import json
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hybridserve.cli.app import (
    FINITE_FLOAT,
    MODELS_EXTRA,
    app,
    err,
    fail,
    install_hint,
    need_extra,
    read_settings_file,
)
from hybridserve.cli.choices import (
    CHECKPOINT_HELP,
    DEFAULT_DEVICE,
    MODEL_HELP,
    SPECULATION_HELP,
)
from hybridserve.cli.options import (
    BlockSizeOption,
    ConfigOption,
    DeviceOption,
    DtypeOption,
    GpuOption,
    PresetOption,
    RetentionOption,
    SeedOption,
    ThreadsOption,
    TpOption,
    scheduler_flags,
)
from hybridserve.core.errors import HybridServeError

if TYPE_CHECKING:
    from hybridserve.engine.settings import SettingsFile
    from hybridserve.server.app import ServerSettings
    from hybridserve.server.backend import ServingBackend

TORCH_MODEL_ALIASES = ("smollm2", "gemma3-270m")
DEFAULT_TORCH_MODEL = "smollm2"
API_KEY_ENV = "HYBRIDSERVE_API_KEY"


def _torch_loader(
    model: str,
    *,
    device: str,
    max_model_len: int | None,
    dcp: int = 1,
    dcp_interleave: int = 1,
    threads: int | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
) -> Callable[[], ServingBackend]:
    """Check that `model` and the torch executor are there; return what loads the model."""
    if model not in TORCH_MODEL_ALIASES and not Path(model).exists():
        raise fail(f"--model {model!r}: use {' or '.join(TORCH_MODEL_ALIASES)} or a local path")
    need_extra("models", *MODELS_EXTRA, what="serve --executor torch")
    try:
        importlib.import_module("hybridserve.executor.torch")
        runtime = importlib.import_module("hybridserve.executor.torch.runtime")
        module = importlib.import_module("hybridserve.server.torch_backend")
        from hybridserve.executor.torch.checkpoints import resolve_model
    except ImportError as exc:
        raise fail(
            f"--executor torch needs the hybridserve.executor.torch package, which cannot be "
            f"imported here ({exc}). Install a build that includes it with its models extra "
            f"({install_hint('models')}), or serve synthetic tokens with --executor sim."
        ) from None

    def load() -> ServingBackend:
        runtime.set_threads(threads)
        if runtime.resolve_device(device) == "cpu":
            runtime.keep_freed_memory()
        backend: ServingBackend = module.serving_backend(
            resolve_model(model),
            name=model if model in TORCH_MODEL_ALIASES else None,
            device=device,
            max_model_len=max_model_len,
            dcp=dcp,
            dcp_interleave=dcp_interleave,
            block_size=block_size,
            num_blocks=num_blocks,
        )
        return backend

    return load


ExecutorOpt = Annotated[
    str | None,
    typer.Option(
        help="sim (synthetic tokens) or torch [default: torch when --model names a checkpoint, "
        "else sim]."
    ),
]
ModelProfileOpt = Annotated[str, typer.Option(help=f"Sim: {MODEL_HELP}")]
TorchModelOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Torch: {CHECKPOINT_HELP} Implies --executor torch [default: {DEFAULT_TORCH_MODEL}]."
    ),
]
ServeSpeculationOpt = Annotated[str, typer.Option("--spec", help=f"Sim: {SPECULATION_HELP}")]
SimSpeedOpt = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT, help="Sim: wall time of a step = modelled time / this (1 = real)."
    ),
]
NumBlocksOpt = Annotated[
    int | None,
    typer.Option(
        help="The KV pool in blocks. With --executor torch it is also what the executor "
        "allocates (K/V per block, and a recurrent state per block for Mamba and gated delta "
        "layers) [default: 4 x max-model-len / block-size, at least 256]."
    ),
]
HostOpt = Annotated[str, typer.Option(help="Address to bind.")]
PortOpt = Annotated[int, typer.Option(help="Port to bind.")]
ServerApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        help="Require 'Authorization: Bearer KEY' (not on /health). Other local users can "
        "read a command line: prefer --api-key-file or $HYBRIDSERVE_API_KEY."
    ),
]
ApiKeyFileOpt = Annotated[
    Path | None, typer.Option(help="Read the API key from this file (one line).")
]
OriginOpt = Annotated[
    list[str] | None,
    typer.Option(help="A browser origin allowed to call the API (CORS); repeatable."),
]
RequestBytesOpt = Annotated[int, typer.Option(help="Largest request body.")]
MaxWaitingOpt = Annotated[
    int,
    typer.Option(
        help="Requests waiting for admission (1 or more) beyond which new ones get 503 + "
        "Retry-After."
    ),
]
FailedStepsOpt = Annotated[
    int, typer.Option(help="Failed executor steps in a row before the server exits (status 1).")
]
DefaultMaxTokensOpt = Annotated[
    int,
    typer.Option(
        help="max_tokens of a chat request that sets none (at most the room under "
        "--max-model-len); completions default to 16, as in OpenAI's API."
    ),
]
EosProbabilityOpt = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Sim: probability that each generated token is <eos> (answers of mean length "
        "1/P; 0 = only max_tokens or a stop ends them).",
    ),
]
SharedKvOpt = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Sim: the share of a decode's reads of KV blocks that another decode of the step "
        "reads too that costs nothing (the cost model's shared_kv: 0 = none, 1 = read once).",
    ),
]
ShutdownOpt = Annotated[
    float,
    typer.Option(parser=FINITE_FLOAT, help="Seconds running requests get to finish on shutdown."),
]
StepTimeoutOpt = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="The watchdog: a step running longer than this many seconds kills the engine "
        "(/health 503, exit 1); 0 = no watchdog.",
    ),
]
WarmUpOpt = Annotated[
    int,
    typer.Option(
        help="Before its first step the engine runs one untimed step of this many prompt "
        "tokens (at most the token budget), so that the first real prefill does not pay the "
        "first touch of its memory; 0 = none.",
    ),
]
StepLogOpt = Annotated[
    Path | None,
    typer.Option(
        "--step-log",
        help="Write one JSON line per engine step here (when it began, its seconds, each "
        "scheduled request's new and context tokens): the schedule a real run took, to set "
        "beside `simulate --step-log` (benchmarks/step_log_check.py).",
    ),
]
ServeDcpOpt = Annotated[
    int,
    typer.Option(
        help="Torch: decode context parallel ranks (local processes; this one is rank 0 "
        "and schedules). Full-attention KV is sharded by token across them."
    ),
]
InterleaveOpt = Annotated[
    int, typer.Option(help="Torch: consecutive tokens per rank in the DCP round-robin.")
]
ServedNameOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="The model id clients put in requests (repeatable: each is accepted, responses "
        "name the first). Default: the model's own name (the sim profile, the torch alias "
        "or the checkpoint folder's name)."
    ),
]
ToolParserOpt = Annotated[
    str,
    typer.Option(
        help="How tool calls are read from chat outputs, and written when tool_choice is "
        '"required" or names a function: hermes (<tool_call> blocks: Qwen3, Qwen3-Next, '
        "Hermes, SmolLM; templates without tool support get this convention), llama3_json, "
        "mistral.",
    ),
]
AutoToolChoiceOpt = Annotated[
    bool,
    typer.Option(
        "--enable-auto-tool-choice",
        help='Accepted so that vLLM command lines run unchanged: tool_choice "auto" is '
        "always served (with --tool-call-parser).",
    ),
]
ReasoningParserOpt = Annotated[
    str | None,
    typer.Option(
        help="Split <think>...</think> reasoning into reasoning_content: qwen3 (needs the "
        "opening tag) or deepseek_r1 (everything before </think>). Default: reasoning stays "
        "content.",
    ),
]
MetricsNamesOpt = Annotated[
    str,
    typer.Option(
        help="Metric names on /metrics: hybridserve (hybridserve:...) or vllm (vLLM's own "
        "vllm:... names, for dashboards, autoscalers and routers built for vLLM).",
    ),
]
KvEventsOpt = Annotated[
    str | None, typer.Option(help="Publish KV events (vLLM's format) at tcp://HOST:PORT.")
]
KvReplayOpt = Annotated[
    str | None,
    typer.Option(
        help="With --kv-events: answer replay requests for missed batches at tcp://HOST:PORT "
        "(the last 10,000 batches, as vLLM's replay_endpoint)."
    ),
]


ServeHostMemoryOpt = Annotated[
    float,
    typer.Option(
        "--host-memory-gib",
        parser=FINITE_FLOAT,
        help="Host memory for a host tier of the KV cache, in GiB (0 = none): evicted blocks "
        "and states go there and come back on a hit (not with --dcp).",
    ),
]


@dataclass(frozen=True, slots=True)
class ServeFlags:
    """Every `serve` flag, as given."""

    executor: str
    model_profile: str
    model: str
    device: str
    gpu: str
    tp: int
    dtype: str
    speculation: str
    seed: int
    sim_speed: float
    preset: str | None
    config: Path | None
    retention: str | None
    num_blocks: int | None
    host: str
    port: int
    api_key: str | None
    api_key_file: Path | None
    allow_origin: list[str] | None
    max_request_bytes: int
    max_waiting: int
    max_failed_steps: int
    default_max_tokens: int
    sim_eos_probability: float
    sim_shared_kv: float
    shutdown_timeout: float
    step_timeout: float
    warm_up_tokens: int
    step_log: Path | None
    dcp: int
    dcp_interleave: int
    served_model_name: list[str] | None
    tool_call_parser: str
    enable_auto_tool_choice: bool
    reasoning_parser: str | None
    metrics_names: str
    threads: int | None
    block_size: int
    kv_events: str | None
    kv_events_replay: str | None
    host_memory_gib: float
    scheduler: dict[str, Any]  # SchedulerConfig fields by name; None: not given

    @property
    def max_model_len(self) -> int | None:
        return self.scheduler.get("max_model_len")


@app.command("serve")
@scheduler_flags
def serve_cmd(
    executor: ExecutorOpt = None,
    model_profile: ModelProfileOpt = "qwen3-next-80b-a3b",
    model: TorchModelOpt = None,
    device: DeviceOption = DEFAULT_DEVICE,
    gpu: GpuOption = "H200",
    tp: TpOption = 1,
    dtype: DtypeOption = "fp8",
    speculation: ServeSpeculationOpt = "auto",
    seed: SeedOption = 0,
    sim_speed: SimSpeedOpt = 1.0,
    preset: PresetOption = None,
    config: ConfigOption = None,
    retention: RetentionOption = None,
    num_blocks: NumBlocksOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ServerApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    allow_origin: OriginOpt = None,
    max_request_bytes: RequestBytesOpt = 1 << 20,
    max_waiting: MaxWaitingOpt = 1024,
    max_failed_steps: FailedStepsOpt = 3,
    default_max_tokens: DefaultMaxTokensOpt = 2048,
    sim_eos_probability: EosProbabilityOpt = 1 / 256,
    sim_shared_kv: SharedKvOpt = 0.0,
    shutdown_timeout: ShutdownOpt = 30.0,
    step_timeout: StepTimeoutOpt = 300.0,
    warm_up_tokens: WarmUpOpt = 2048,
    step_log: StepLogOpt = None,
    dcp: ServeDcpOpt = 1,
    dcp_interleave: InterleaveOpt = 1,
    served_model_name: ServedNameOpt = None,
    tool_call_parser: ToolParserOpt = "hermes",
    enable_auto_tool_choice: AutoToolChoiceOpt = False,
    reasoning_parser: ReasoningParserOpt = None,
    metrics_names: MetricsNamesOpt = "hybridserve",
    threads: ThreadsOption = None,
    block_size: BlockSizeOption = 16,
    kv_events: KvEventsOpt = None,
    kv_events_replay: KvReplayOpt = None,
    host_memory_gib: ServeHostMemoryOpt = 0.0,
    **scheduler: Any,
) -> None:
    """Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /metrics.

    Every SchedulerConfig field is a flag (`--max-num-seqs`, ...): over the preset and the
    `--config` file."""
    executor, model = chosen_executor(executor, model)
    code = _serve(ServeFlags(**locals()))
    if code:
        raise typer.Exit(code)


def _serve(flags: ServeFlags) -> int:
    """Build the app the flags describe and serve it until shutdown; the exit code."""
    need_extra(
        "server", "uvicorn", "fastapi", "pydantic", "prometheus_client", what="hybridserve serve"
    )
    from hybridserve.server.kv_events import attach_kv_events, check_kv_event_flags
    from hybridserve.server.runner import serve

    settings = _server_settings(flags)
    try:
        check_kv_event_flags(flags.kv_events, flags.kv_events_replay)
        file = read_settings_file(flags.config)
        load_backend = _backend_loader(flags, file)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    # Every cheap check is done; bind now, before the model loads: a port in use is an error
    # at once, not after a long load.
    sock = bind_port(flags.host, flags.port)
    try:
        try:
            server_app = build_app(
                load_backend(),
                settings,
                preset_name=flags.preset,
                settings_file=file,
                retention=flags.retention,
                num_blocks=flags.num_blocks,
                overrides=flags.scheduler,
                host_memory_gib=flags.host_memory_gib,
            )
            attach_kv_events(server_app, flags.kv_events, flags.kv_events_replay)
        except HybridServeError as exc:
            raise fail(str(exc)) from None
        banner = startup_banner(server_app.state.hybridserve, host=flags.host, port=flags.port)
        return serve(server_app, host=flags.host, port=flags.port, banner=banner, sock=sock)
    finally:
        sock.close()


def chosen_executor(executor: str | None, model: str | None) -> tuple[str, str]:
    """(executor, checkpoint) that `serve` runs: `--model` (a checkpoint) without `--executor`
    implies torch, said once on stderr; `--executor sim` with `--model` is refused (the
    simulator serves `--model-profile`)."""
    if executor is None:
        if model is None:
            return "sim", DEFAULT_TORCH_MODEL
        err.print(
            f"serve: --model {model} is a checkpoint: serving it on the torch executor "
            "(--executor torch)",
            soft_wrap=True,
            highlight=False,
        )
        return "torch", model
    if executor == "sim" and model is not None:
        raise fail(
            f"--model {model!r} with --executor sim: --model names a checkpoint for the torch "
            "executor, and the simulator serves synthetic tokens for --model-profile NAME; "
            "drop --model, or pass --executor torch"
        )
    return executor, model if model is not None else DEFAULT_TORCH_MODEL


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound to --host/--port; a port in use (or an address that is not
    this machine's) is an error naming the flag."""
    from hybridserve.server.runner import listening_socket

    try:
        return listening_socket(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise fail(
                f"--port {port}: {host}:{port} is already in use (another server listens "
                "there); stop it or pass a free --port"
            ) from None
        raise fail(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); pass "
            "an address of this machine (e.g. --host 127.0.0.1) and a free --port"
        ) from None


def _server_settings(flags: ServeFlags) -> ServerSettings:
    """The server's own settings, after refusing the flags it could only fail on later."""
    from hybridserve.server.app import ServerSettings

    if flags.executor not in ("sim", "torch"):
        raise fail(f"--executor {flags.executor!r}: use sim or torch")
    if flags.dcp != 1 and flags.executor != "torch":
        raise fail(f"--dcp={flags.dcp}: decode context parallel runs with --executor torch")
    _check_serve_flags(
        port=flags.port, max_waiting=flags.max_waiting, default_max_tokens=flags.default_max_tokens
    )
    if flags.threads is not None and flags.executor != "torch":
        raise fail(
            f"--threads={flags.threads}: sets the torch executor's threads; use --executor torch"
        )
    if flags.block_size != 16 and flags.executor != "torch":
        raise fail(
            f"--block-size={flags.block_size}: sets the torch executor's KV block; the "
            "simulator takes its model profile's; use --executor torch"
        )
    if flags.block_size < 1:
        raise fail(f"--block-size={flags.block_size}: use 1 or more tokens (16, 32, ...)")
    if flags.max_failed_steps < 1:
        raise fail(f"--max-failed-steps={flags.max_failed_steps}: use 1 or more")
    if not flags.shutdown_timeout >= 0:  # NaN too
        raise fail(f"--shutdown-timeout={flags.shutdown_timeout}: use 0 or more seconds")
    if not 0 <= flags.step_timeout < math.inf:
        raise fail(f"--step-timeout={flags.step_timeout}: use 0 (no watchdog) or more seconds")
    if flags.warm_up_tokens < 0:
        raise fail(f"--warm-up-tokens={flags.warm_up_tokens}: use 0 (no warm-up) or more tokens")
    if flags.step_log is not None and not flags.step_log.parent.is_dir():
        raise fail(
            f"--step-log {flags.step_log}: its folder {flags.step_log.parent} does not exist; "
            "create it or pass a path in an existing folder"
        )
    names = tuple(dict.fromkeys(flags.served_model_name or ()))
    if any(not name.strip() for name in names):
        raise fail("--served-model-name: give a non-empty name")
    _check_readers(flags)
    return ServerSettings(
        tool_call_parser=flags.tool_call_parser,
        reasoning_parser=flags.reasoning_parser,
        metrics_names=flags.metrics_names,
        served_model_names=names,
        api_key=resolve_api_key(flags.api_key, flags.api_key_file, os.environ.get(API_KEY_ENV)),
        max_request_bytes=flags.max_request_bytes,
        max_waiting=flags.max_waiting,
        max_failed_steps=flags.max_failed_steps,
        shutdown_timeout_s=flags.shutdown_timeout,
        step_timeout_s=flags.step_timeout,
        warm_up_tokens=flags.warm_up_tokens,
        step_log=flags.step_log,
        allow_origins=tuple(flags.allow_origin or ()),
        default_max_tokens=flags.default_max_tokens,
    )


def _check_readers(flags: ServeFlags) -> None:
    """Refuse an unknown tool-call parser, reasoning parser or metric namespace before the
    model loads."""
    from hybridserve.server.metrics import NAMESPACES
    from hybridserve.server.reasoning import reasoning_parser
    from hybridserve.server.tool_parsers import tool_parser

    try:
        tool_parser(flags.tool_call_parser)
        if flags.reasoning_parser is not None:
            reasoning_parser(flags.reasoning_parser)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if flags.metrics_names not in NAMESPACES:
        raise fail(f"--metrics-names {flags.metrics_names!r}: use one of {', '.join(NAMESPACES)}")


def _backend_loader(flags: ServeFlags, file: SettingsFile | None) -> Callable[[], ServingBackend]:
    """What loads the model side `--executor` names (a real model on torch, or the simulator),
    after the checks that need no load: a bad flag is refused before the port is bound."""
    if flags.executor == "torch":
        return _torch_loader(
            flags.model,
            device=flags.device,
            max_model_len=flags.max_model_len,
            dcp=flags.dcp,
            dcp_interleave=flags.dcp_interleave,
            threads=flags.threads,
            block_size=flags.block_size,
            num_blocks=flags.num_blocks,
        )
    from hybridserve.cli.sim_backend import DEFAULT_MAX_MODEL_LEN, SimServingBackend
    from hybridserve.engine.settings import preset_name

    # The simulator loads nothing: its backend is built (and its flags checked) now.
    backend = SimServingBackend(
        model_profile=flags.model_profile,
        preset=preset_name(flags.preset, file),
        gpu=flags.gpu,
        tp=flags.tp,
        dtype=flags.dtype,
        speculation=flags.speculation,
        seed=flags.seed,
        sim_speed=flags.sim_speed,
        max_model_len=flags.max_model_len or DEFAULT_MAX_MODEL_LEN,
        eos_probability=flags.sim_eos_probability,
        shared_kv=flags.sim_shared_kv,
    )
    return lambda: backend


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
        f"shutdown_timeout={settings.shutdown_timeout_s:g}s; "
        f"step_timeout={settings.step_timeout_s:g}s; warm_up_tokens={settings.warm_up_tokens}",
        f"  try:       curl -s {base}/v1/completions -H 'Content-Type: application/json' "
        + ('-H "Authorization: Bearer $HYBRIDSERVE_API_KEY" ' if settings.api_key else "")
        + f"-d '{example}'",
    ]
    lines += [f"  note:      {notice}" for notice in state.parts.scheduler.notices]
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
    preset_name: str | None = None,
    config_file: Path | None = None,
    retention: str | None = None,
    num_blocks: int | None = None,
    overrides: dict[str, Any] | None = None,
    settings_file: SettingsFile | None = None,
    host_memory_gib: float = 0.0,
) -> Any:
    """The FastAPI app over `backend` with the settings resolved as every command resolves
    them (`hybridserve.engine.settings`: preset, then the file, then the flags). The file is
    `settings_file` when it was read already, else `config_file`."""
    from hybridserve.engine.settings import SettingsSources
    from hybridserve.server.app import ServerState, create_app
    from hybridserve.server.backend import serve_settings, serving_engine

    file = settings_file if settings_file is not None else read_settings_file(config_file)
    sources = SettingsSources(
        preset=preset_name, file=file, flags=tuple((overrides or {}).items()), retention=retention
    )
    parts = serving_engine(
        backend,
        serve_settings(backend, sources),
        num_blocks=num_blocks,
        host_memory_gib=host_memory_gib,
    )
    return create_app(ServerState(backend, parts, settings))
