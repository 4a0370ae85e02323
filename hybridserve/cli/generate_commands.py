"""`hybridserve generate`: offline batch generation through the Engine on the torch executor."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hybridserve.cli.app import MODELS_EXTRA, app, err, fail, need_extra
from hybridserve.cli.builtin_models import GEMMA_TERMS_NOTICE, gemma_terms_path, resolve_model
from hybridserve.core.errors import HybridServeError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.offline import run_to_completion
from hybridserve.offline.runtime import blocks_for, build_runtime, generation_progress, parse_spec

if TYPE_CHECKING:
    from hybridserve.executor.torch.tokenizer import TextTokenizer


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


def config_vocab_size(path: Path) -> int | None:
    """The vocabulary size in a checkpoint folder's config.json (None for a GGUF or without)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    size = text.get("vocab_size", data.get("vocab_size"))
    return int(size) if isinstance(size, int) else None


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


@app.command("generate")
def generate(
    model: Annotated[
        str,
        typer.Option(
            help="Checkpoint folder (config.json + safetensors), a .gguf file, or a built-in "
            "alias: smollm2, gemma3-270m (fetch them with `make models`)."
        ),
    ],
    prompts: Annotated[Path | None, typer.Option(help="Text prompts, one per line.")] = None,
    token_ids: Annotated[
        Path | None, typer.Option(help="JSONL prompts: one list of token ids per line.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="New tokens per prompt at most.")] = 64,
    spec: Annotated[
        str | None, typer.Option(help="Speculative decoding: ngram:K (K draft tokens).")
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (per request).")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Do not apply the model's chat template to text.")
    ] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    threads: Annotated[
        int | None,
        typer.Option(help="Torch intra-op threads (default: every core this process may use)."),
    ] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    num_blocks: Annotated[int, typer.Option(help="KV blocks (0 = enough for all).")] = 0,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget per step.")] = 2048,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per prompt: token_ids, text.")
    ] = False,
    dcp: Annotated[
        int,
        typer.Option(
            help="Decode context parallel ranks: full-attention KV sharded by token across N "
            "processes (gloo on CPU, nccl on CUDA); rank 0 schedules. Under torchrun, every "
            "process joins from the environment and WORLD_SIZE must equal N."
        ),
    ] = 1,
    dcp_interleave: Annotated[
        int, typer.Option(help="Consecutive tokens per rank in the DCP token round-robin.")
    ] = 1,
    dcp_timeout: Annotated[
        float, typer.Option(help="Seconds a DCP run may take before its ranks are stopped.")
    ] = 3600.0,
) -> None:
    """Generate continuations for a file of prompts (greedy unless sampling flags are given)."""
    need_extra("models", *MODELS_EXTRA, what="hybridserve generate")
    if (prompts is None) == (token_ids is None):
        raise fail("give exactly one of --prompts FILE or --token-ids FILE")
    if block_size < 1:
        raise fail(f"--block-size={block_size} is invalid: use 1 or more tokens per KV block (16)")
    if num_blocks < 0:
        raise fail(f"--num-blocks={num_blocks} is invalid: use 0 (enough for all) or more")
    if max_num_batched_tokens < 1:
        raise fail(f"--max-num-batched-tokens={max_num_batched_tokens} is invalid: use 1 or more")
    if dcp < 1 or dcp_interleave < 1:
        raise fail(f"--dcp={dcp}, --dcp-interleave={dcp_interleave}: use 1 or more")
    if dcp > 1 and spec:
        raise fail(f"--spec={spec} with --dcp={dcp}: speculative decoding does not run under DCP")
    source = prompts or token_ids
    assert source is not None
    if not source.is_file():
        raise fail(f"--{'prompts' if prompts else 'token-ids'}={source}: no such file")
    try:
        path = resolve_model(model)
        if model == "gemma3-270m" or "gemma" in path.name.lower():
            err.print(GEMMA_TERMS_NOTICE.format(terms=gemma_terms_path()), highlight=False)
        # Validate the sampling flags before the (slow) model load.
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        speculative = parse_spec(spec)
        if threads is not None and threads < 1:
            raise fail(f"--threads={threads}: use 1 or more (or leave it out: all cores)")
        texts = read_prompts(source) if prompts else None
        ids = read_token_ids(source) if token_ids else None
        if not (texts or ids):
            raise fail(f"{source}: no prompts in the file")
        err.print(f"loading {path} ...", highlight=False)
        lengths = [len(t) * 2 for t in texts] if texts else [len(i) for i in ids or ()]
        blocks = num_blocks or blocks_for(
            lengths, max_tokens=max_tokens, block_size=block_size, num_groups=2
        )
        if dcp > 1:
            if ids is not None:
                check_token_ids(ids, config_vocab_size(path), source)
            _generate_dcp(
                path,
                texts=texts,
                ids=ids,
                raw=raw,
                as_json=as_json,
                sampling=sampling,
                num_blocks=blocks,
                block_size=block_size,
                device=device,
                max_num_batched_tokens=max_num_batched_tokens,
                dcp=dcp,
                interleave=dcp_interleave,
                timeout_s=dcp_timeout,
            )
            return
        from hybridserve.executor.torch.runtime import set_threads

        set_threads(threads)
        runtime = build_runtime(
            path,
            num_blocks=blocks,
            block_size=block_size,
            device=device,
            speculative=speculative,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        tokenizer = runtime.tokenizer
        if texts is not None:
            if tokenizer is None:
                raise fail(f"{path} has no tokenizer; use --token-ids")
            ids = [_encode(tokenizer, text, chat=not raw) for text in texts]
        assert ids is not None
        check_token_ids(ids, runtime.executor.model.vocab_size, source)
        sampling = replace(sampling, stop_token_ids=runtime.stop_token_ids)
        requests = [
            Request(req_id=str(i), prompt_token_ids=tuple(p), sampling=sampling)
            for i, p in enumerate(ids)
        ]
        outputs = _run(runtime, requests)
    except HybridServeError as error:
        raise fail(str(error)) from None
    _print_outputs([outputs[r.req_id] for r in requests], tokenizer, as_json=as_json)


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


def _generate_dcp(
    path: Path,
    *,
    texts: list[str] | None,
    ids: list[list[int]] | None,
    raw: bool,
    as_json: bool,
    sampling: SamplingParams,
    num_blocks: int,
    block_size: int,
    device: str,
    max_num_batched_tokens: int,
    dcp: int,
    interleave: int,
    timeout_s: float,
) -> None:
    """Tokenize here, run the job on N ranks (spawned, or this process's torchrun rank), print
    rank 0's outputs."""
    from hybridserve.executor.torch.runtime import load_text_tokenizer
    from hybridserve.offline.runtime import DcpJob, run_dcp_job
    from hybridserve.parallel.launch import (
        init_from_env,
        leave_group,
        run_ranks,
        torchrun_env_present,
    )

    tokenizer = load_text_tokenizer(path)
    if texts is not None:
        if tokenizer is None:
            raise fail(f"{path} has no tokenizer; use --token-ids")
        ids = [_encode(tokenizer, text, chat=not raw) for text in texts]
    assert ids is not None
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
        max_num_batched_tokens=max_num_batched_tokens,
        load_tokenizer=True,
        show_progress=True,
    )
    if torchrun_env_present():
        group = init_from_env(interleave=interleave, timeout_s=timeout_s)
        try:
            if group.world_size != dcp:
                raise fail(f"--dcp={dcp} but torchrun started WORLD_SIZE={group.world_size}")
            outcome = run_dcp_job(group, job)
        finally:
            leave_group()
        if outcome is None:
            return  # ranks 1..N-1 print nothing
    else:
        err.print(f"starting {dcp} DCP ranks ...", highlight=False)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        results = run_ranks(
            run_dcp_job, dcp, job, interleave=interleave, backend=backend, timeout_s=timeout_s
        )
        outcome = results[0]
    _print_outputs([outcome.tokens[r.req_id] for r in requests], tokenizer, as_json=as_json)


def _encode(tokenizer: object, text: str, *, chat: bool) -> list[int]:
    from hybridserve.executor.torch.tokenizer import TextTokenizer

    assert isinstance(tokenizer, TextTokenizer)
    if chat and tokenizer.chat_template:
        rendered = tokenizer.chat_prompt(text)
        bos = tokenizer.bos_token
        return tokenizer.encode(rendered, add_special_tokens=not (bos and rendered.startswith(bos)))
    return tokenizer.encode(text)


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
