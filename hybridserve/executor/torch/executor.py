"""TorchExecutor: runs a StepPlan through a model on CPU or CUDA (the same code).

It owns the tensors (paged K/V per attention layer, shared by the layers at the same position
of different cache groups; state slots per recurrent layer), mirrors each running request's
block tables from the plan's diffs, honours copy-on-write block copies, drops the tables of
finished and preempted requests, samples, verifies drafts and proposes the next step's drafts
(n-gram lookup, or a draft head).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridserve.core.config import DEFAULT_MAX_NUM_SEQS, SpeculativeConfig, SpeculativeMethod
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import ScheduledChunk, StepPlan, StepResult, TokenLogprob
from hybridserve.core.request import SamplingParams, keep_sampled
from hybridserve.executor.grammar import Grammars
from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.cache import DeviceCache
from hybridserve.executor.torch.constraints import Constraints, RuleRows, has_rules
from hybridserve.executor.torch.draft_head import DraftHead, DraftHeadRunner
from hybridserve.executor.torch.drafting import ngram_propose
from hybridserve.executor.torch.forward import (
    ChunkSpan,
    ForwardContext,
    GatherBuffers,
    StateChunk,
    build_attention_meta,
    build_shard_meta,
    to_device,
)
from hybridserve.executor.torch.host_cache import HostCache
from hybridserve.executor.torch.layers.packed import pack_linears
from hybridserve.executor.torch.logits import (
    PROMPT_ROWS_PER_SLICE,
    PenaltyRow,
    PromptLogprobState,
    apply_penalties,
    token_logprobs,
)
from hybridserve.executor.torch.models.base import CausalLM, derive_cache_groups
from hybridserve.executor.torch.sampler import verify_batch
from hybridserve.executor.torch.state_tables import NULL_BLOCK, extend_table, state_snapshots
from hybridserve.kvcache.layout import CacheLayout
from hybridserve.kvcache.spec import GroupKind, MambaCacheMode, MambaSpec, SlidingWindowSpec
from hybridserve.parallel.group import DcpGroup

# The prompts a warm-up step runs are this long (a typical prompt; one prompt of the whole token
# budget would spend its time in attention).
WARM_UP_PROMPT_TOKENS = 256


@dataclass(slots=True)
class _RequestState:
    tables: list[list[int]]
    known: list[int] = field(default_factory=list)  # token id by position (-1 = unknown)


@dataclass(frozen=True, slots=True)
class _Commit:
    """Draft-token states in scratch slots, committed once the drafts are verified."""

    group_id: int
    verified_end: int  # position after the last verified token of the chunk
    scratch: tuple[int, ...]  # scratch[j]: the state after verified_end + j tokens


class TorchExecutor:
    """Implements the Executor protocol over a `CausalLM`."""

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        speculative: SpeculativeConfig | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN,
        seed: int = 0,
        dcp: DcpGroup | None = None,
        share_prefixes: bool = True,
        packed_linears: bool = True,
        grammars: Grammars | None = None,
        host_blocks: int = 0,
        uniform_pages: bool = True,
        paged_kernel: bool = True,
    ) -> None:
        """`packed_linears`: on the CPU, float32 linear layers read a oneDNN-packed copy of
        their weights (`layers.packed`; off, `F.linear`). `share_prefixes`: chunks whose block
        tables begin with the same blocks attend to those keys in one call (see
        `forward.build_attention_meta`); off, each chunk reads its whole context. `dcp`: this
        rank's decode-context-parallel group. Every rank builds the same model and executes the
        same plans (see `executor.torch.dcp`); full-attention and MLA KV is sharded by token,
        so one block id covers `block_size * dcp.world_size` tokens. `host_blocks`: slots of
        the host tier (`executor.torch.host_cache`; 0 = none), in pinned memory on CUDA; the
        layout's `host_blocks` must not exceed it. `uniform_pages`: the cache groups of a model
        mixing full and sliding-window attention are vLLM's groups of equal size (see
        `derive_cache_groups`); off, one group per layer kind. Either way layers at the same
        position of different groups share their K/V tensors (`cache.kv_storage`).
        `paged_kernel`: on the CPU, decodes attend through the paged decode kernel
        (`cpu_kernels`) where it is built; off, through the gather path."""
        self.device = torch.device(device)
        self.dcp = dcp or DcpGroup()
        self.model = model.to(self.device).eval()
        self.speculative = speculative or SpeculativeConfig()
        method = self.speculative.method
        if method not in (
            SpeculativeMethod.NONE,
            SpeculativeMethod.NGRAM,
            SpeculativeMethod.MTP,
            SpeculativeMethod.EAGLE,
        ):
            raise ConfigError(
                "speculative.method",
                method.value,
                "this executor drafts with ngram or a draft head (mtp, eagle); use one of them",
            )
        if self.dcp.world_size > 1 and block_size % self.dcp.interleave:
            raise ConfigError(
                "dcp.interleave",
                self.dcp.interleave,
                f"use a divisor of block_size={block_size}: a block holds whole interleave runs",
            )
        if self.dcp.world_size > 1 and method in (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE):
            raise ConfigError(
                "speculative.method",
                method.value,
                f"a draft head does not run under dcp={self.dcp.world_size}; use ngram or none",
            )
        # logit_bias, min_tokens and grammars: `grammars` compiles structured outputs for the
        # model's tokenizer (None: a request with one fails).
        self.constraints = Constraints(grammars)
        self.num_lookahead = self.speculative.num_speculative_tokens
        self.block_size = block_size
        self.seed = seed
        self.share_prefixes = share_prefixes
        self.paged_decodes = (
            paged_kernel
            and self.device.type == "cpu"
            and model.dtype == torch.float32
            and cpu_kernels.load() is not None
        )
        layers = model.layer_caches()
        self.head = None
        if method in (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE):
            self.head = DraftHead(model, len(layers), seed=seed).to(self.device).eval()
            layers = [*layers, self.head.cache_spec()]
        self.groups = derive_cache_groups(
            layers, block_size=block_size, mamba_mode=mamba_mode, uniform_pages=uniform_pages
        )
        self.num_packed_linears = 0
        if packed_linears:
            self.num_packed_linears = pack_linears(self.model)
            if self.head is not None:
                self.num_packed_linears += pack_linears(self.head)
        has_state = any(isinstance(s, MambaSpec) for s in self.groups.specs)
        self.cache = DeviceCache(
            layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_scratch_slots=max_num_seqs * (self.num_lookahead + 1) if has_state else 0,
            dtype=model.dtype,
            device=self.device,
            layer_group=self.groups.layer_group,
        )
        self.num_blocks = num_blocks
        self.host_blocks = 0
        self.host_cache: HostCache | None = None
        # Groups attended through hybridserve.parallel: MLA always, full attention under DCP.
        sharded = (GroupKind.FULL, GroupKind.MLA) if self.dcp.world_size > 1 else (GroupKind.MLA,)
        self._sharded_groups = frozenset(
            g for g, spec in enumerate(self.groups.specs) if spec.kind in sharded
        )
        self._token_group = next(
            (
                g
                for g, s in enumerate(self.groups.specs)
                if s.kind in (GroupKind.FULL, GroupKind.MLA)
            ),
            None,
        )
        # Token ids by (block id, offset) of the full-attention group, for n-gram drafts after a
        # prefix hit; a block id covers block_size * N tokens under DCP.
        self._token_unit = block_size * self.dcp.world_size
        self._slot_tokens = (
            torch.full((num_blocks * self._token_unit,), -1, dtype=torch.long)
            if self._token_group is not None
            else None
        )
        self._requests: dict[str, _RequestState] = {}
        self.drafter = (
            DraftHeadRunner(
                self.head,
                model,
                self.cache,
                group_id=self.groups.layer_group[self.head.layer_index],
                layer_group=self.groups.layer_group,
                num_tokens=self.num_lookahead,
                block_size=block_size,
            )
            if self.head is not None
            else None
        )
        if host_blocks:
            self.enable_host_tier(host_blocks)
        self._sampling: dict[str, SamplingParams] = {}
        # Kept until a request finishes (preemption included): its prompt length (the position
        # it first sampled at), and where its prompt log-probabilities stand.
        self._prompt_lens: dict[str, int] = {}
        self._prompt_logprob_states: dict[str, PromptLogprobState] = {}
        # This step's log-probabilities, for the StepResult.
        self._step_logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        self._step_prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        # When set, the logits of every emitted token are kept (tests compare them).
        self.record_logits = False
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}
        # Attention score elements the last step computed (all layers and heads, padding
        # included): what packing the batch saves is visible here.
        self.attention_elements = 0
        self.gathered_keys = 0  # K (and V) rows the last step gathered from the paged cache
        self._buffers = GatherBuffers()

    # ----- set-up ---------------------------------------------------------------------------

    def cache_layout(self, **options: object) -> CacheLayout:
        """The CacheLayout for this model's groups; pass it to the KVCacheManager. `options`
        override CacheLayout fields (retention, alignment_tokens, ...)."""
        fields: dict[str, object] = {
            "groups": self.groups.specs,
            "num_blocks": self.num_blocks,
            "speculative": self.speculative,
            "dcp": self.dcp.world_size,
            "host_blocks": self.host_blocks,
            **options,
        }
        return CacheLayout(**fields)  # type: ignore[arg-type]

    # ----- the step -------------------------------------------------------------------------

    def enable_host_tier(self, host_blocks: int) -> None:
        """Give the executor a host pool of `host_blocks` slots (once; refused under DCP)."""
        if self.host_cache is not None:
            raise ConfigError("host_blocks", host_blocks, "the executor has a host pool already")
        if self.dcp.world_size > 1:
            raise ConfigError("host_blocks", host_blocks, "the host tier does not run with DCP")
        self.host_cache = HostCache(
            self.cache, host_blocks, layer_group=self.groups.layer_group, device=self.device
        )
        self.host_blocks = host_blocks
        if self._slot_tokens is not None:
            assert self._token_group is not None
            self.host_cache.add_table(self._token_group, self._slot_tokens, self._token_unit)
        if self.drafter is not None:
            self.host_cache.add_table(
                self.drafter.group_id, self.drafter.next_token, self.cache.block_size
            )

    @property
    def block_bytes(self) -> int:
        """Bytes one block id holds (its pages in the layers of the largest group, shared by
        every group's; see `DeviceCache.block_bytes`): what one host slot holds."""
        return self.cache.block_bytes()

    def warm_up(self, num_tokens: int, *, prompt_tokens: int = WARM_UP_PROMPT_TOKENS) -> int:
        """Run one untimed step of fresh prompts of `prompt_tokens` tokens, `num_tokens` in all
        (fewer where the pool holds fewer), then forget them: the first touch of the memory a
        step of that size allocates, and the kernels' first calls at its shapes. Without it a
        fresh server's first large prefill pays them: five 208-token prompts took 2.06 s in a
        fresh Gemma 3 server, the next five 1.06 s (a third of the first in the kernel's page
        zeroing). vLLM runs a dummy forward of its token budget when it starts.

        Call it before serving only: its K/V is written into blocks 1.. of the pool (free then,
        so nothing reads it). Returns the tokens run; 0 where it is skipped (recurrent-state
        layers, whose state slots it would have to reserve; decode context parallelism, whose
        ranks run only the driver's plans)."""
        has_state = any(isinstance(spec, MambaSpec) for spec in self.groups.specs)
        if num_tokens < 1 or has_state or self.dcp.world_size > 1:
            return 0
        per_prompt = max(1, min(prompt_tokens, num_tokens))
        blocks_each = -(-per_prompt // self.block_size)
        prompts = min(-(-num_tokens // per_prompt), (self.num_blocks - 1) // blocks_each)
        vocab = int(self.model.vocab_size)
        chunks, next_block = [], 1  # block 0 stays free (the null block of state tables)
        for index in range(prompts):
            length = min(per_prompt, num_tokens - index * per_prompt)
            table = tuple(range(next_block, next_block + -(-length // self.block_size)))
            next_block += len(table)
            tokens = tuple((index * per_prompt + i) % vocab for i in range(length))
            chunks.append(
                ScheduledChunk(
                    req_id=f"warm-up-{index}",
                    start=0,
                    token_ids=tokens,
                    block_ids=(table,) * len(self.groups.specs),
                    sample=True,
                    new_request=True,
                )
            )
        if not chunks:
            return 0
        self.execute(StepPlan(-1, tuple(chunks)))
        self.execute(StepPlan(-1, (), finished_req_ids=tuple(c.req_id for c in chunks)))
        return sum(c.num_tokens for c in chunks)

    def execute(self, plan: StepPlan) -> StepResult:
        began = time.perf_counter()
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self._requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for req_id in plan.finished_req_ids:
            self._sampling.pop(req_id, None)
            self.constraints.forget(req_id)
            self._prompt_lens.pop(req_id, None)
            self._prompt_logprob_states.pop(req_id, None)
        self._step_logprobs, self._step_prompt_logprobs = {}, {}
        self._host_transfers(plan)
        for copy in plan.block_copies:
            self._copy_block(copy.group_id, copy.src_block_id, copy.dst_block_id, copy.num_tokens)
        if not plan.chunks:
            return StepResult(plan.step_id, {}, time.perf_counter() - began)
        for chunk in plan.chunks:
            if chunk.sampling is not None:  # a request's first chunk carries its settings
                self._sampling[chunk.req_id] = chunk.sampling
                self.constraints.start(chunk.req_id, chunk.sampling)
            self._update_tables(chunk)
        with torch.inference_mode():
            sampled, drafts = self._run(plan.chunks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(
            plan.step_id,
            sampled,
            time.perf_counter() - began,
            drafts,
            logprobs=self._step_logprobs,
            prompt_logprobs=self._step_prompt_logprobs,
        )

    def _host_transfers(self, plan: StepPlan) -> None:
        """The plan's host-tier saves, then its loads (before its block copies)."""
        if not plan.host_saves and not plan.host_loads:
            return
        if self.host_cache is None:
            raise ConfigError(
                "host_blocks",
                0,
                f"step {plan.step_id} moves blocks to and from the host tier; build the "
                "executor with the layout's host_blocks",
            )
        self.host_cache.transfer(plan.host_saves, plan.host_loads)

    def _run(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        ctx, commits = self._context(chunks)
        tokens = [t for c in chunks for t in c.token_ids]
        # Placeholder drafts (-1) are fed as token 0; they never verify.
        host_ids = torch.tensor(tokens, dtype=torch.long).clamp_(min=0)
        starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
        counts = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
        offsets = torch.cumsum(counts, 0) - counts
        owner = torch.repeat_interleave(torch.arange(len(chunks)), counts)
        host_positions = starts[owner] + torch.arange(len(tokens)) - offsets[owner]
        input_ids = to_device(host_ids, self.device)
        positions = to_device(host_positions, self.device)
        if self._slot_tokens is not None and self._token_group is not None:
            unit, group = self._token_unit, self._token_group
            rows = [self._requests[c.req_id].tables[group] for c in chunks]
            width = max(1, max(len(t) for t in rows))
            padded = torch.tensor([[*t, *([0] * (width - len(t)))] for t in rows])
            blocks = padded[owner, host_positions // unit]
            self._slot_tokens[blocks * unit + host_positions % unit] = host_ids
        hidden = self.model(input_ids, positions, ctx)
        self._prompt_logprobs(chunks, hidden)
        self.attention_elements = ctx.attention_elements
        self.gathered_keys = ctx.gathered_keys
        sampled, drafts = self._sample(chunks, hidden, commits)
        if self.drafter is not None:
            group = self.drafter.group_id
            tables = {c.req_id: self._requests[c.req_id].tables[group] for c in chunks}
            drafts = self.drafter.step(chunks, hidden, sampled, tables)
        return sampled, drafts

    def _sample(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, commits: dict[str, _Commit]
    ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """Verify drafts and sample for every chunk that samples; n-gram drafts for the next."""
        rows: list[int] = []
        owners: list[ScheduledChunk] = []
        row = 0
        for chunk in chunks:
            if chunk.sample:
                first = row + chunk.num_tokens - chunk.num_draft_tokens - 1
                rows.extend(range(first, row + chunk.num_tokens))
                owners.append(chunk)
                # A request first samples right after its prompt.
                verified_end = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
                self._prompt_lens.setdefault(chunk.req_id, verified_end)
            row += chunk.num_tokens
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        if not rows:
            return sampled, drafts
        index = torch.tensor(rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        # Sampling sees the penalized scores; log-probabilities come from the raw logits.
        scores = apply_penalties(logits, self._penalty_rows(owners))
        scores = self.constraints.apply(scores, self._rule_rows(owners))
        requests = []
        for chunk in owners:
            verified = chunk.num_tokens - chunk.num_draft_tokens
            requests.append(
                (
                    chunk.token_ids[verified:],
                    self._sampling.get(chunk.req_id),
                    chunk.start + verified,
                )
            )
        emitted_all = verify_batch(scores, requests, default_seed=self.seed)
        host = logits.cpu() if self.record_logits else None
        offset = 0
        for chunk, emitted in zip(owners, emitted_all, strict=True):
            start, offset = offset, offset + chunk.num_draft_tokens + 1
            if not emitted:  # its logits were not finite: the engine fails this request alone
                continue
            if not self.constraints.commit(chunk.req_id, emitted):
                continue  # outside its grammar: failed alone too
            sampled[chunk.req_id] = emitted
            emitted_logits = logits[start : start + len(emitted)]
            self._emitted(chunk, emitted, emitted_logits, commits.get(chunk.req_id))
            if host is not None:
                kept = host[start : start + len(emitted)].clone()
                self.recorded_logits.setdefault(chunk.req_id, []).extend(kept)
            proposal = self._propose(chunk, emitted)
            if proposal:
                drafts[chunk.req_id] = proposal
        return sampled, drafts

    def _emitted(
        self,
        chunk: ScheduledChunk,
        emitted: tuple[int, ...],
        logits: torch.Tensor,
        commit: _Commit | None,
    ) -> None:
        """Record what a chunk emitted: its log-probabilities (from `logits`, the raw rows of
        the emitted tokens), the accepted drafts as known tokens, the recurrent state kept."""
        params = self._sampling.get(chunk.req_id)
        if params is not None and params.logprobs is not None:
            self._step_logprobs[chunk.req_id] = tuple(
                token_logprobs(logits, emitted, params.logprobs)
            )
        # Accepted drafts now have K/V and state: they are known positions.
        self._requests[chunk.req_id].known.extend(emitted[:-1])
        if commit is not None:
            self._commit_states(chunk.req_id, commit, self._kept(chunk, emitted) - 1)

    def _kept(self, chunk: ScheduledChunk, emitted: tuple[int, ...]) -> int:
        """How many of a chunk's emitted tokens the scheduler keeps (`keep_sampled`: none past
        a stop token or max_tokens), so that the recurrent state committed is the one after
        the last kept token: a finished turn's state is where the request ends (exact tails
        resume from it)."""
        params = self._sampling.get(chunk.req_id)
        if params is None:
            return len(emitted)
        verified_end = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
        num_output = verified_end - self._prompt_lens[chunk.req_id]
        kept, _ = keep_sampled(params, num_output, emitted)
        return len(kept)

    # ----- penalties, rules and log-probabilities -----------------------------------------------

    def _rule_rows(self, owners: Sequence[ScheduledChunk]) -> list[RuleRows]:
        """The sampled rows of requests with logit rules (bias, min_tokens, a grammar)."""
        out: list[RuleRows] = []
        offset = 0
        for chunk in owners:
            params = self._sampling.get(chunk.req_id)
            if params is not None and has_rules(params):
                first = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
                drafts = chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens :]
                num_output = first - self._prompt_lens[chunk.req_id]
                out.append(RuleRows(chunk.req_id, offset, drafts, num_output, params))
            offset += chunk.num_draft_tokens + 1
        return out

    def _penalty_rows(self, owners: Sequence[ScheduledChunk]) -> list[PenaltyRow]:
        """The sampled rows of requests with penalties, each with the tokens before the
        position it predicts (a draft row also sees the drafts before it). Positions whose
        token the executor never saw (a prefix hit on a model without an attention group)
        are left out."""
        out: list[PenaltyRow] = []
        offset = 0
        for chunk in owners:
            params = self._sampling.get(chunk.req_id)
            if params is not None and params.has_penalties:
                first = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
                known = self._requests[chunk.req_id].known[:first]
                prompt_len = self._prompt_lens[chunk.req_id]
                prompt = [t for t in known[:prompt_len] if t >= 0]
                output = [t for t in known[prompt_len:] if t >= 0]
                drafts = chunk.token_ids[chunk.num_tokens - chunk.num_draft_tokens :]
                for j in range(chunk.num_draft_tokens + 1):
                    history = [*output, *(d for d in drafts[:j] if d >= 0)]
                    out.append(PenaltyRow(offset + j, prompt, history, params))
            offset += chunk.num_draft_tokens + 1
        return out

    def _prompt_logprobs(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this step's rows predict, for requests asking
        for `prompt_logprobs`. Row i of a chunk predicts the token at `start + i + 1`; the last
        row of a partial prefill predicts the next chunk's first token, so its logits wait for
        that chunk. Positions are reported once each, in order, even when a preempted request
        recomputes them; a request stops collecting once it samples."""
        row = 0
        for chunk in chunks:
            first_row, row = row, row + chunk.num_tokens
            params = self._sampling.get(chunk.req_id)
            if params is None or params.prompt_logprobs is None:
                continue
            state = self._prompt_logprob_states.setdefault(chunk.req_id, PromptLogprobState())
            if state.done:
                continue
            num_top, start = params.prompt_logprobs, chunk.start
            count = chunk.num_tokens - chunk.num_draft_tokens
            entries: list[TokenLogprob] = []
            if state.pending is not None and state.pending_position == start == state.next_position:
                entries += token_logprobs(state.pending[None], chunk.token_ids[:1], num_top)
                state.next_position += 1
            state.pending = None
            lo = state.next_position - start - 1  # the first row still needed
            if lo < 0:
                # Positions before this chunk were never computed here (a prefix hit): they
                # cannot be reported; the request's entries stay short, which the caller sees.
                state.done = True
                continue
            for begin in range(lo, count - 1, PROMPT_ROWS_PER_SLICE):
                end = min(begin + PROMPT_ROWS_PER_SLICE, count - 1)
                index = torch.arange(first_row + begin, first_row + end, device=self.device)
                logits = self.model.compute_logits(hidden[index])
                entries += token_logprobs(logits, chunk.token_ids[begin + 1 : end + 1], num_top)
                state.next_position = start + end + 1
            if chunk.sample:
                state.done = True
            elif state.next_position == start + count:
                last = torch.tensor([first_row + count - 1], device=self.device)
                state.pending = self.model.compute_logits(hidden[last])[0]
                state.pending_position = start + count
            if entries:
                self._step_prompt_logprobs[chunk.req_id] = tuple(entries)

    # ----- tables and metadata ------------------------------------------------------------------

    def _update_tables(self, chunk: ScheduledChunk) -> None:
        state = self._requests.get(chunk.req_id)
        if chunk.new_request or state is None:
            if not chunk.new_request:
                raise ValueError(
                    f"request {chunk.req_id!r}: first chunk without new_request; the executor "
                    "holds no block table for it"
                )
            state = _RequestState([list(ids) for ids in chunk.block_ids])
            state.known = self._recover_tokens(state.tables, chunk.start)
            self._requests[chunk.req_id] = state
            if self.drafter is not None:
                self.drafter.check_resume(chunk, state.tables[self.drafter.group_id])
        else:
            for gid, new_ids in enumerate(chunk.block_ids):
                spec = self.groups.specs[gid]
                extend_table(
                    state.tables[gid],
                    new_ids,
                    align=isinstance(spec, MambaSpec) and spec.mode is MambaCacheMode.ALIGN,
                    chunk_end=chunk.start + chunk.num_tokens,
                    lookahead=self.num_lookahead,
                    block_size=self.block_size,
                    req_id=chunk.req_id,
                )
        del state.known[chunk.start :]
        state.known.extend([-1] * (chunk.start - len(state.known)))
        state.known.extend(chunk.token_ids[: chunk.num_tokens - chunk.num_draft_tokens])

    def _context(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[ForwardContext, dict[str, _Commit]]:
        attention = {}
        shards = {}
        states: dict[int, list[StateChunk]] = {}
        commits: dict[str, _Commit] = {}
        for gid, spec in enumerate(self.groups.specs):
            spans, row = [], 0
            for chunk in chunks:
                table = self._requests[chunk.req_id].tables[gid]
                spans.append(ChunkSpan(row, chunk.num_tokens, chunk.start, table))
                row += chunk.num_tokens
            if isinstance(spec, MambaSpec):
                states[gid] = self._state_chunks(gid, chunks, spans, commits)
            elif gid in self._sharded_groups:
                shards[gid] = build_shard_meta(
                    spans, block_size=self.block_size, dcp=self.dcp, device=self.device
                )
            else:
                window = spec.window if isinstance(spec, SlidingWindowSpec) else None
                attention[gid] = build_attention_meta(
                    spans,
                    block_size=self.block_size,
                    window=window,
                    device=self.device,
                    share_prefixes=self.share_prefixes,
                    paged_decodes=self.paged_decodes,
                )
        ctx = ForwardContext(
            self.cache,
            layer_group=self.groups.layer_group,
            attention=attention,
            states=states,
            num_tokens=sum(c.num_tokens for c in chunks),
            shards=shards,
            dcp=self.dcp,
            buffers=self._buffers,
        )
        return ctx, commits

    def _state_chunks(
        self,
        gid: int,
        chunks: Sequence[ScheduledChunk],
        spans: Sequence[ChunkSpan],
        commits: dict[str, _Commit],
    ) -> list[StateChunk]:
        out = []
        num_drafted = 0
        for index, (chunk, span) in enumerate(zip(chunks, spans, strict=True)):
            scratch: tuple[int, ...] = ()
            if chunk.num_draft_tokens:
                base = self.cache.scratch_base + num_drafted * (self.num_lookahead + 1)
                scratch = tuple(range(base, base + chunk.num_draft_tokens + 1))
                num_drafted += 1
            read_slot, snapshots, slots = state_snapshots(
                span.table,
                start=chunk.start,
                num_tokens=chunk.num_tokens,
                num_draft_tokens=chunk.num_draft_tokens,
                block_size=self.block_size,
                scratch=scratch,
                req_id=chunk.req_id,
            )
            if scratch:
                verified_end = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
                commits[chunk.req_id] = _Commit(gid, verified_end, scratch)
            rows = slice(span.row_start, span.row_start + span.num_tokens)
            out.append(StateChunk(index, rows, read_slot, snapshots, slots))
        return out

    def _commit_states(self, req_id: str, commit: _Commit, num_accepted: int) -> None:
        table = self._requests[req_id].tables[commit.group_id]
        bs = self.block_size
        for j in range(num_accepted + 1):
            position = commit.verified_end + j
            if j != num_accepted and position % bs:
                continue
            index = -(-position // bs) - 1
            block = table[index] if index < len(table) else NULL_BLOCK
            if block == NULL_BLOCK:
                if j == num_accepted:
                    raise ValueError(
                        f"request {req_id!r}: no state block at table index {index} for the "
                        f"state after {position} tokens"
                    )
                continue
            for layer in self.groups.layers_of(commit.group_id):
                self.cache.copy_state(layer, commit.scratch[j], block)

    def _copy_block(self, gid: int, src: int, dst: int, num_tokens: int) -> None:
        sharded = self.dcp.world_size > 1 and self.groups.specs[gid].dcp_sharded
        for layer in self.groups.layers_of(gid):
            if self.cache.is_state_layer(layer):
                self.cache.copy_state(layer, src, dst)
            elif sharded:  # this rank's share of the first num_tokens: copy all its slots
                self.cache.copy_tokens(layer, src, dst, self.block_size)
            else:
                self.cache.copy_tokens(layer, src, dst, num_tokens)
        if self.drafter is not None and gid == self.drafter.group_id:
            self.drafter.copy_block(src, dst, num_tokens)
        if gid == self._token_group and self._slot_tokens is not None:
            unit = self._token_unit
            self._slot_tokens[dst * unit : dst * unit + num_tokens] = self._slot_tokens[
                src * unit : src * unit + num_tokens
            ]

    def _recover_tokens(self, tables: list[list[int]], start: int) -> list[int]:
        """Token ids of a prefix hit, read back from the full-attention blocks (for n-gram)."""
        if start == 0 or self._slot_tokens is None or self._token_group is None:
            return []
        table = torch.tensor(tables[self._token_group], dtype=torch.long)
        positions = torch.arange(start)
        unit = self._token_unit
        slots = table[positions // unit] * unit + positions % unit
        return [int(t) for t in self._slot_tokens[slots].tolist()]

    def _propose(self, chunk: ScheduledChunk, emitted: tuple[int, ...]) -> tuple[int, ...]:
        if self.speculative.method is not SpeculativeMethod.NGRAM or self.num_lookahead == 0:
            return ()
        known = self._requests[chunk.req_id].known
        proposal = ngram_propose([*known, emitted[-1]], num_tokens=self.num_lookahead)
        return proposal if min(proposal, default=0) >= 0 else ()


def compile_dense_layers(model: torch.nn.Module, *, backend: str = "inductor") -> int:
    """`torch.compile` every MLP and norm module of `model` in place (dynamic shapes: the token
    count changes every step); attention and the paged cache stay eager. The first steps of
    each new shape pay for compilation. Returns how many modules were compiled."""
    from hybridserve.executor.torch.layers.mlp import GatedMLP
    from hybridserve.executor.torch.layers.norm import RMSNorm

    count = 0
    for module in model.modules():
        if isinstance(module, GatedMLP | RMSNorm):
            module.compile(backend=backend, dynamic=True)
            count += 1
    return count
