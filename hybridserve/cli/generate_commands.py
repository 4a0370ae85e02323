"""`hybridserve generate`: offline batch generation through the Engine on the torch executor.

Scheduler settings resolve as in `hybridserve serve` and `simulate`: the preset, then
`--config FILE.toml`, then the flags given on the command line (`hybridserve.engine.settings`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hybridserve.cli.app import (
    FINITE_FLOAT,
    MODELS_EXTRA,
    app,
    err,
    fail,
    need_extra,
    read_settings_file,
)
from hybridserve.cli.choices import CHECKPOINT_HELP, DEFAULT_DEVICE
from hybridserve.cli.options import (
    BlockSizeOption,
    ConfigOption,
    DeviceOption,
    PresetOption,
    RetentionOption,
    ThreadsOption,
    scheduler_flags,
)
from hybridserve.core.config import SpeculativeConfig
from hybridserve.core.errors import HybridServeError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.offline import run_to_completion
from hybridserve.engine.settings import SettingsSources
from hybridserve.offline.runtime import (
    PoolFor,
    build_runtime,
    generation_progress,
    parse_speculation,
)

if TYPE_CHECKING:
    from hybridserve.executor.torch.tokenizer import TextTokenizer

CheckpointOption = Annotated[
    str,
    typer.Option(help=CHECKPOINT_HELP),
]
PromptsOption = Annotated[Path | None, typer.Option(help="Text prompts, one per line.")]
TokenIdsOption = Annotated[
    Path | None, typer.Option(help="JSONL prompts: one list of token ids per line.")
]
MaxTokensOption = Annotated[int, typer.Option(help="New tokens per prompt at most.")]
NgramSpeculationOption = Annotated[
    str | None, typer.Option("--spec", help="Speculative decoding: ngram:K (K draft tokens).")
]
TemperatureOption = Annotated[float, typer.Option(parser=FINITE_FLOAT, help="0 = greedy.")]
TopPOption = Annotated[float, typer.Option(parser=FINITE_FLOAT, help="Nucleus sampling mass.")]
TopKOption = Annotated[int, typer.Option(help="0 = off.")]
SamplingSeedOption = Annotated[int | None, typer.Option(help="Sampling seed (per request).")]
RawOption = Annotated[
    bool, typer.Option("--raw", help="Do not apply the model's chat template to text.")
]
GenerateBlocksOption = Annotated[int, typer.Option(help="KV blocks (0 = enough for all).")]
JsonLinesOption = Annotated[
    bool, typer.Option("--json", help="One JSON object per prompt: token_ids, text.")
]
DcpRanksOption = Annotated[
    int,
    typer.Option(
        help="Decode context parallel ranks: full-attention KV sharded by token across N "
        "processes (gloo on CPU, nccl on CUDA); rank 0 schedules. Under torchrun, every "
        "process joins from the environment and WORLD_SIZE must equal N."
    ),
]
DcpInterleaveOption = Annotated[
    int, typer.Option(help="Consecutive tokens per rank in the DCP token round-robin.")
]
DcpTimeoutOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT, help="Seconds a DCP run may take before its ranks are stopped."
    ),
]


@dataclass(frozen=True, slots=True)
class GenerateSettings:
    """The flags of one `generate` run, checked by `check()` before the model loads."""

    max_tokens: int = 64
    speculation: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    raw: bool = False
    device: str = DEFAULT_DEVICE
    threads: int | None = None
    block_size: int = 16
    num_blocks: int = 0
    # SchedulerConfig fields given as flags (None: not given, the preset's or the file's).
    scheduler: tuple[tuple[str, Any], ...] = ()
    preset: str | None = None
    config: Path | None = None
    retention: str | None = None
    as_json: bool = False
    dcp: int = 1
    dcp_interleave: int = 1
    dcp_timeout: float = 3600.0

    def check(self) -> None:
        if self.block_size < 1:
            raise fail(
                f"--block-size={self.block_size} is invalid: use 1 or more tokens per KV block (16)"
            )
        if self.num_blocks < 0:
            raise fail(f"--num-blocks={self.num_blocks} is invalid: use 0 (enough for all) or more")
        if self.dcp < 1 or self.dcp_interleave < 1:
            raise fail(f"--dcp={self.dcp}, --dcp-interleave={self.dcp_interleave}: use 1 or more")
        if self.dcp > 1 and self.speculation:
            raise fail(
                f"--spec={self.speculation} with --dcp={self.dcp}: speculative decoding does not "
                "run under DCP"
            )

    def settings_sources(self) -> SettingsSources:
        """The preset, the `--config` file (read now: a bad file fails before the model
        loads) and the scheduler flags, resolved once the model is loaded."""
        file = read_settings_file(self.config)
        return SettingsSources(
            preset=self.preset, file=file, flags=self.scheduler, retention=self.retention
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )


@app.command("generate")
@scheduler_flags
def generate(
    model: CheckpointOption,
    prompts: PromptsOption = None,
    token_ids: TokenIdsOption = None,
    max_tokens: MaxTokensOption = 64,
    speculation: NgramSpeculationOption = None,
    temperature: TemperatureOption = 0.0,
    top_p: TopPOption = 1.0,
    top_k: TopKOption = 0,
    seed: SamplingSeedOption = None,
    raw: RawOption = False,
    device: DeviceOption = DEFAULT_DEVICE,
    threads: ThreadsOption = None,
    block_size: BlockSizeOption = 16,
    num_blocks: GenerateBlocksOption = 0,
    preset: PresetOption = None,
    config: ConfigOption = None,
    retention: RetentionOption = None,
    as_json: JsonLinesOption = False,
    dcp: DcpRanksOption = 1,
    dcp_interleave: DcpInterleaveOption = 1,
    dcp_timeout: DcpTimeoutOption = 3600.0,
    **scheduler: Any,
) -> None:
    """Generate continuations for a file of prompts (greedy unless sampling flags are given),
    scheduled by the preset, then the --config file, then the scheduler flags."""
    need_extra("models", *MODELS_EXTRA, what="hybridserve generate")
    if (prompts is None) == (token_ids is None):
        raise fail("give exactly one of --prompts FILE or --token-ids FILE")
    settings = GenerateSettings(
        max_tokens=max_tokens,
        speculation=speculation,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        raw=raw,
        device=device,
        threads=threads,
        block_size=block_size,
        num_blocks=num_blocks,
        scheduler=tuple(scheduler.items()),
        preset=preset,
        config=config,
        retention=retention,
        as_json=as_json,
        dcp=dcp,
        dcp_interleave=dcp_interleave,
        dcp_timeout=dcp_timeout,
    )
    settings.check()
    source = prompts or token_ids
    assert source is not None
    if not source.is_file():
        raise fail(f"--{'prompts' if prompts else 'token-ids'}={source}: no such file")
    try:
        _generate(model, source, text=prompts is not None, settings=settings)
    except HybridServeError as error:
        raise fail(str(error)) from None


def _generate(model: str, source: Path, *, text: bool, settings: GenerateSettings) -> None:
    """Resolve the model, read the prompts, run on one process or a DCP group, print."""
    from hybridserve.executor.torch.checkpoints import (
        GEMMA_TERMS_NOTICE,
        config_vocab_size,
        gemma_terms_path,
        resolve_model,
    )
    from hybridserve.executor.torch.runtime import resolve_device

    path = resolve_model(model)
    # `auto` is resolved once, here: a DCP group's ranks and backend then agree on the device.
    settings = replace(settings, device=resolve_device(settings.device))
    if model == "gemma3-270m" or "gemma" in path.name.lower():
        err.print(GEMMA_TERMS_NOTICE.format(terms=gemma_terms_path()), highlight=False)
    # Validate the sampling flags before the (slow) model load.
    sampling = settings.sampling()
    speculative = parse_speculation(settings.speculation)
    sources = settings.settings_sources()
    if settings.threads is not None and settings.threads < 1:
        raise fail(f"--threads={settings.threads}: use 1 or more (or leave it out: all cores)")
    texts = read_prompts(source) if text else None
    ids = None if text else read_token_ids(source)
    if not (texts or ids):
        raise fail(f"{source}: no prompts in the file")
    err.print(f"loading {path} ...", highlight=False)
    lengths = [len(t) * 2 for t in texts] if texts else [len(i) for i in ids or ()]
    # Room for every request at once in each of the model's cache groups (known once it loads).
    blocks = settings.num_blocks or PoolFor(tuple(lengths), settings.max_tokens)
    if settings.dcp > 1:
        if ids is not None:
            check_token_ids(ids, config_vocab_size(path), source)
        _generate_dcp(
            path,
            texts=texts,
            ids=ids,
            raw=settings.raw,
            as_json=settings.as_json,
            sampling=sampling,
            num_blocks=blocks,
            block_size=settings.block_size,
            device=settings.device,
            sources=sources,
            dcp=settings.dcp,
            interleave=settings.dcp_interleave,
            timeout_s=settings.dcp_timeout,
        )
        return
    _generate_local(
        path, texts=texts, ids=ids, source=source, sampling=sampling, blocks=blocks,
        speculative=speculative, settings=settings, sources=sources,
    )  # fmt: skip


def _generate_local(
    path: Path,
    *,
    texts: list[str] | None,
    ids: list[list[int]] | None,
    source: Path,
    sampling: SamplingParams,
    blocks: int | PoolFor,
    speculative: SpeculativeConfig,
    settings: GenerateSettings,
    sources: SettingsSources,
) -> None:
    """One process: build the runtime, run every prompt to completion, print."""
    block_size, device = settings.block_size, settings.device
    from hybridserve.executor.torch.runtime import keep_freed_memory, resolve_device, set_threads

    set_threads(settings.threads)
    if resolve_device(device) == "cpu":
        keep_freed_memory()
    runtime = build_runtime(
        path,
        num_blocks=blocks,
        block_size=block_size,
        device=device,
        speculative=speculative,
        settings=sources,
    )
    tokenizer = runtime.tokenizer
    ids = _prompt_ids(tokenizer, path, texts, ids, raw=settings.raw)
    check_token_ids(ids, runtime.executor.model.vocab_size, source)
    sampling = replace(sampling, stop_token_ids=runtime.stop_token_ids)
    requests = [
        Request(req_id=str(i), prompt_token_ids=tuple(p), sampling=sampling)
        for i, p in enumerate(ids)
    ]
    outputs = _run(runtime, requests)
    _print_outputs([outputs[r.req_id] for r in requests], tokenizer, as_json=settings.as_json)


def _generate_dcp(
    path: Path,
    *,
    texts: list[str] | None,
    ids: list[list[int]] | None,
    raw: bool,
    as_json: bool,
    sampling: SamplingParams,
    num_blocks: int | PoolFor,
    block_size: int,
    device: str,
    sources: SettingsSources,
    dcp: int,
    interleave: int,
    timeout_s: float,
) -> None:
    """Tokenize here, run the job on N ranks (spawned, or this process's torchrun rank), print
    rank 0's outputs."""
    from hybridserve.executor.torch.dcp import run_on_group
    from hybridserve.executor.torch.runtime import load_text_tokenizer
    from hybridserve.offline.runtime import DcpJob, run_dcp_job

    tokenizer = load_text_tokenizer(path)
    ids = _prompt_ids(tokenizer, path, texts, ids, raw=raw)
    requests = tuple(
        Request(req_id=str(i), prompt_token_ids=tuple(p), sampling=sampling)
        for i, p in enumerate(ids)
    )
    job = DcpJob(
        model_path=str(path),
        waves=(requests,),
        num_blocks=num_blocks,
        block_size=block_size,
        device=device,
        settings=sources,
        load_tokenizer=True,
        show_progress=True,
    )
    outcome = run_on_group(
        run_dcp_job,
        job,
        ranks=dcp,
        device=device,
        interleave=interleave,
        timeout_s=timeout_s,
        announce=lambda message: err.print(message, highlight=False),
    )
    if outcome is None:
        return  # ranks 1..N-1 of a torchrun group print nothing
    _print_outputs([outcome.tokens[r.req_id] for r in requests], tokenizer, as_json=as_json)


def _prompt_ids(
    tokenizer: TextTokenizer | None,
    path: Path,
    texts: list[str] | None,
    ids: list[list[int]] | None,
    *,
    raw: bool,
) -> list[list[int]]:
    """The token ids of the prompts: `ids` as given, or `texts` encoded (through the chat
    template unless `raw`)."""
    if texts is None:
        assert ids is not None
        return ids
    if tokenizer is None:
        raise fail(f"{path} has no tokenizer; use --token-ids")
    return [tokenizer.encode_prompt(text, chat=not raw) for text in texts]


def read_token_ids(path: Path) -> list[list[int]]:
    """JSONL: one list of token ids per line (blank lines skipped)."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)
        except json.JSONDecodeError:
            raise fail(f"{path}:{number}: not JSON; write one list of token ids per line") from None
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and t >= 0 for t in ids)
        ):
            raise fail(f"{path}:{number}: expected a non-empty list of token ids >= 0")
        prompts.append(ids)
    return prompts


def check_token_ids(prompts: list[list[int]], vocab_size: int | None, source: Path) -> None:
    """Every id must be a token of the model: one outside [0, vocab_size) is refused with its
    line, never fed to the embedding."""
    if vocab_size is None:
        return
    for number, ids in enumerate(prompts, start=1):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise fail(
                f"--token-ids {source}: prompt {number} has token id {bad[0]}, outside the "
                f"model's vocabulary [0, {vocab_size}); use ids below {vocab_size}"
            )


def read_prompts(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def _print_outputs(
    outputs: list[list[int]], tokenizer: TextTokenizer | None, *, as_json: bool
) -> None:
    for i, out in enumerate(outputs):
        text = tokenizer.decode(out) if tokenizer is not None else None
        if as_json:
            record: dict[str, object] = {"index": i, "token_ids": out}
            if text is not None:
                record["text"] = text
            typer.echo(json.dumps(record))
        else:
            typer.echo(text if text is not None else " ".join(map(str, out)))


def _run(runtime: object, requests: list[Request]) -> dict[str, list[int]]:
    from hybridserve.offline.runtime import TorchRuntime

    assert isinstance(runtime, TorchRuntime)
    with generation_progress("generating") as progress:
        task = progress.add_task("generate", total=len(requests), tokens=0)

        def report(finished: int, total: int, generated: int) -> None:
            progress.update(task, completed=finished, tokens=generated)

        return run_to_completion(
            runtime.engine,
            requests,
            progress=report,
        )
