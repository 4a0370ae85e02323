"""Shared helpers of the reference tests: hybridserve versus transformers on the same weights.

* `make_checkpoint(config, folder)`: a transformers model with seeded random weights, saved as
  a checkpoint folder (config.json + safetensors); returns the transformers model.
* `transformers_greedy(model, prompt, n)`: greedy tokens and per-token logits, recomputing the
  whole sequence each step with explicit position ids (no transformers cache involved).
* `hybrid_generate(path, prompts, ...)`: the hybridserve Engine over the TorchExecutor with a
  chosen block size, token budget (chunked prefill), number of blocks (small forces
  preemption), speculation and request order; returns tokens, logits and what the scheduler did.
* `drop_earlier_kv()`: a context manager that breaks the K/V carry between steps (each chunk
  attends only to its own tokens) so that a meta-test can prove the comparisons fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import TokenLogprob
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.engine import Engine
from hybridserve.executor.torch import TorchExecutor, load_model
from hybridserve.executor.torch import executor as executor_module
from hybridserve.executor.torch import forward as forward_module
from hybridserve.executor.torch.models.base import CausalLM
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler import Scheduler


def make_checkpoint(config: Any, folder: Path, *, seed: int = 0) -> Any:
    """Build `AutoModelForCausalLM.from_config(config)` with seeded weights, save it to
    `folder`, return it (eval mode, float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval().float()
    model.save_pretrained(str(folder))
    return model


def transformers_greedy(
    model: Any, prompt: Sequence[int], num_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation and the logits that chose each token."""
    tokens = list(prompt)
    logits_out = []
    with torch.no_grad():
        for _ in range(num_tokens):
            ids = torch.tensor([tokens])
            positions = torch.arange(len(tokens))[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, -1]
            logits_out.append(logits.float())
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :], logits_out


@dataclass
class HybridRun:
    tokens: dict[str, list[int]]
    logits: dict[str, list[torch.Tensor]]
    hit_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens hit at admission
    num_preemptions: int = 0
    num_drafted_steps: int = 0
    num_accepted_drafts: int = 0
    # Per request, as the StepResults reported them (generated ones trimmed to the output).
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Block id -> the cache groups the plans gave it to (the null block 0 left out).
    block_groups: dict[int, set[int]] = field(default_factory=dict)


def hybrid_generate(
    model_path: Path | str | CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 8,
    block_size: int = 4,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    drafts: int = 0,
    draft_method: str = "ngram",
    sequential: bool = False,
    sampling: SamplingParams | None = None,
    layout_options: dict[str, Any] | None = None,
    packed_linears: bool = True,
    warm_up_tokens: int = 0,
) -> HybridRun:
    """Generate for every prompt (`model_path` may also be a loaded model); `sequential=True`
    runs them one after another (so later prompts can hit the cache of earlier ones)."""
    model = load_model(model_path) if isinstance(model_path, Path | str) else model_path
    speculative = (
        SpeculativeConfig.from_name(draft_method, drafts) if drafts else SpeculativeConfig()
    )
    executor = TorchExecutor(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        speculative=speculative,
        max_num_seqs=max_num_seqs,
        packed_linears=packed_linears,
    )
    if warm_up_tokens:
        assert executor.warm_up(warm_up_tokens, prompt_tokens=7) > 0
    executor.record_logits = True
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=4096,
    )
    scheduler = Scheduler(
        config,
        KVCacheManager(executor.cache_layout(**(layout_options or {}))),
        num_speculative_tokens=drafts,
    )
    engine = Engine(scheduler, executor)
    run = HybridRun(tokens={}, logits=executor.recorded_logits)
    params = sampling or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [
        Request(req_id=f"r{i}", prompt_token_ids=tuple(p), sampling=params)
        for i, p in enumerate(prompts)
    ]
    groups = [[r] for r in requests] if sequential else [requests]
    for group in groups:
        for request in group:
            engine.add_request(request)
            run.tokens[request.req_id] = []
        for _ in range(100_000):
            if not engine.has_requests():
                break
            step = engine.step()
            if not step.scheduled.plan.chunks and not step.scheduled.finished_req_ids:
                raise AssertionError("the engine scheduled nothing; raise num_blocks")
            run.num_preemptions += len(step.scheduled.preempted)
            for req_id, hit in (*step.scheduled.new_reqs, *step.scheduled.resumed):
                run.hit_tokens.setdefault(req_id, hit)
            for chunk in step.scheduled.plan.chunks:
                for gid, ids in enumerate(chunk.block_ids):
                    for block in ids:
                        if block:
                            run.block_groups.setdefault(block, set()).add(gid)
                if chunk.num_draft_tokens:
                    run.num_drafted_steps += 1
                    accepted = len(step.result.sampled_token_ids.get(chunk.req_id, ())) - 1
                    run.num_accepted_drafts += max(accepted, 0)
            for req_id, entries in step.result.prompt_logprobs.items():
                run.prompt_logprobs.setdefault(req_id, []).extend(entries)
            for out in step.outputs:
                run.tokens[out.req_id].extend(out.new_token_ids)
                entries = step.result.logprobs.get(out.req_id, ())[: len(out.new_token_ids)]
                run.logprobs.setdefault(out.req_id, []).extend(entries)
    return run


def random_prompt(length: int, seed: int, vocab: int = 96) -> list[int]:
    """A prompt of `length` token ids in [3, vocab), the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(3, vocab, (length,), generator=gen).tolist()
    return ids


def assert_greedy_matches(hf_model: Any, prompts: Sequence[Sequence[int]], run: HybridRun) -> None:
    """Each request's tokens equal transformers' greedy continuation of its prompt."""
    for i, prompt in enumerate(prompts):
        got = run.tokens[f"r{i}"]
        want, _ = transformers_greedy(hf_model, prompt, len(got))
        assert got == want, f"request r{i} (prompt of {len(prompt)} tokens) diverged"


@dataclass(frozen=True, kw_only=True)
class GreedyChecks:
    """One model family's runs against transformers' greedy continuation: the sizes differ per
    family (a recurrent model wants a prefill piece crossing its scan chunks), the checks do not.
    Each takes (checkpoint folder, transformers model) and fails with an AssertionError."""

    single: tuple[int, int, int]  # prompt tokens, answer tokens, token budget
    batch: tuple[tuple[int, ...], int, int]  # prompt lengths, answer tokens, token budget
    resume_answer: int
    preempt: tuple[int, int]  # answer tokens, num_blocks (few enough to force preemption)
    ngram_answer: int
    # Whether greedy outputs repeat enough that drafts are both accepted and rejected.
    ngram_accepts: bool = False

    def single_request(self, folder: Path, hf_model: Any) -> None:
        """One request: tokens identical, logits within 1e-4."""
        length, answer, budget = self.single
        prompt = random_prompt(length, seed=1)
        run = hybrid_generate(folder, [prompt], max_tokens=answer, max_num_batched_tokens=budget)
        want, want_logits = transformers_greedy(hf_model, prompt, answer)
        assert run.tokens["r0"] == want
        got_logits = torch.stack(run.logits["r0"])
        torch.testing.assert_close(got_logits, torch.stack(want_logits), atol=1e-4, rtol=0)

    def chunked_batch(self, folder: Path, hf_model: Any) -> None:
        """A mixed batch under a token budget that splits blocks at every offset."""
        lengths, answer, budget = self.batch
        prompts = [random_prompt(n, seed=n) for n in lengths]
        run = hybrid_generate(folder, prompts, max_tokens=answer, max_num_batched_tokens=budget)
        assert_greedy_matches(hf_model, prompts, run)

    def prefix_resume(self, folder: Path, hf_model: Any) -> None:
        """The second prompt extends the first (the next turn of a conversation) and resumes
        from the first's cached prefix (K/V, window or state snapshot)."""
        first = random_prompt(30, seed=3)
        prompts = [first, first + random_prompt(9, seed=5)]
        run = hybrid_generate(folder, prompts, max_tokens=self.resume_answer, sequential=True)
        assert run.hit_tokens["r1"] >= 24, "the second request must resume from the shared prefix"
        assert_greedy_matches(hf_model, prompts, run)

    def preemption(self, folder: Path, hf_model: Any) -> None:
        answer, num_blocks = self.preempt
        prompts = [random_prompt(18, seed=10 + i) for i in range(4)]
        run = hybrid_generate(folder, prompts, max_tokens=answer, num_blocks=num_blocks)
        assert run.num_preemptions > 0, "num_blocks is meant to force preemption"
        assert_greedy_matches(hf_model, prompts, run)

    def ngram_speculation(self, folder: Path, hf_model: Any) -> None:
        motif = random_prompt(6, seed=20)
        prompts = [motif * 4 + random_prompt(3, seed=21), random_prompt(9, seed=22) * 2]
        plain = hybrid_generate(folder, prompts, max_tokens=self.ngram_answer)
        drafted = hybrid_generate(folder, prompts, max_tokens=self.ngram_answer, drafts=3)
        if self.ngram_accepts:
            # Both rejected drafts (state rolled back) and accepted ones (committed) occur.
            assert drafted.num_accepted_drafts > 0
            assert drafted.num_drafted_steps * 3 > drafted.num_accepted_drafts
        else:
            assert drafted.num_drafted_steps > 0
        assert drafted.tokens == plain.tokens
        assert_greedy_matches(hf_model, prompts, drafted)


@contextlib.contextmanager
def drop_earlier_kv() -> Iterator[None]:
    """Break the K/V carry: every chunk attends only to the tokens it brings this step."""
    original = forward_module.build_attention_meta

    def broken(spans: Sequence[Any], **kwargs: Any) -> Any:
        meta = original(spans, **kwargs)
        window = kwargs.get("window")
        calls = []
        for call in meta.calls:
            qp, kp = call.q_pos[:, :, None], call.k_pos[:, None, :]
            mask = (kp <= qp) & (kp >= call.q_pos[:, :1, None])  # this step's tokens only
            if window is not None:
                mask &= kp > qp - window
            calls.append(dataclasses.replace(call, mask=mask[:, None], causal=False))
        decodes = meta.decodes
        if decodes is not None:  # the paged kernel's decodes: their own token only
            decodes = dataclasses.replace(decodes, lows=decodes.ends - 1)
        return dataclasses.replace(meta, calls=tuple(calls), prefix_calls=(), decodes=decodes)

    executor_module.build_attention_meta = broken  # type: ignore[assignment]
    try:
        yield
    finally:
        executor_module.build_attention_meta = original  # type: ignore[assignment]
