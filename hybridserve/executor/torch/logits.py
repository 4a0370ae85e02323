"""What the torch executor computes from a step's logits besides sampling: vLLM's penalties and
log-probabilities.

Penalties follow vLLM exactly (`apply_penalties` in vllm/model_executor/layers/utils.py, with
the torch fallback of its repetition kernel, `apply_repetition_penalties_torch` in
vllm/_custom_ops.py), applied to float32 logits before temperature, top-k and top-p, as
vLLM's sampler does:

- repetition: every token present in the prompt or the output so far has its logit divided by
  the penalty when positive and multiplied by it otherwise;
- frequency (OpenAI's definition): `logit -= penalty * (times the token occurs in the output)`;
- presence (OpenAI's definition): `logit -= penalty` for every token present in the output.

Log-probabilities are `log_softmax` of the model's logits, before penalties and temperature
(vLLM's default `logprobs_mode`, "raw_logprobs"): the same logits the sampler starts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridserve.core.plan import TokenLogprob
from hybridserve.core.request import SamplingParams


@dataclass(frozen=True, slots=True)
class PenaltyRow:
    """One logits row to penalize: the tokens seen before the position it predicts."""

    row: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    params: SamplingParams


def _bin_counts(token_lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """[len(token_lists), vocab_size] occurrence counts (ids outside the vocabulary ignored)."""
    longest = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    padded = torch.where((padded >= 0) & (padded < vocab_size), padded, vocab_size)
    counts = torch.zeros((len(token_lists), vocab_size + 1), dtype=torch.long)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenaltyRow]) -> torch.Tensor:
    """`logits` [R, V] with vLLM's repetition, frequency and presence penalties applied to the
    given rows (a float32 copy; `logits` itself is returned when no row is given)."""
    if not rows:
        return logits
    vocab = logits.shape[-1]
    index = torch.tensor([r.row for r in rows], dtype=torch.long, device=logits.device)
    scores = logits.float()[index]
    prompt_mask = (_bin_counts([r.prompt_token_ids for r in rows], vocab) > 0).to(logits.device)
    output_counts = _bin_counts([r.output_token_ids for r in rows], vocab).to(logits.device)
    output_mask = output_counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=logits.device).unsqueeze(1)

    repetition = column([r.params.repetition_penalty for r in rows]).expand(-1, vocab)
    penalties = torch.where(prompt_mask | output_mask, repetition, 1.0)
    scores *= torch.where(scores > 0, 1.0 / penalties, penalties)
    scores -= column([r.params.frequency_penalty for r in rows]) * output_counts
    scores -= column([r.params.presence_penalty for r in rows]) * output_mask
    out = logits.float().clone()
    out[index] = scores
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """Row i's log-probability of `token_ids[i]` and its `num_top` most likely tokens."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids).squeeze(1).tolist()
    if num_top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen, strict=True)]
    top_values, top_ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
    out = []
    for t, lp, values, top in zip(
        token_ids, chosen, top_values.tolist(), top_ids.tolist(), strict=True
    ):
        out.append(TokenLogprob(t, lp, tuple(zip(top, values, strict=True))))
    return out


@dataclass(slots=True)
class PromptLogprobState:
    """Where a request's prompt log-probabilities stand: the next prompt position that needs
    one, and the last row of a partial prefill (it predicts the next chunk's first token)."""

    next_position: int = 1  # the first prompt token has no log-probability
    pending: torch.Tensor | None = None  # [V] logits predicting `pending_position`
    pending_position: int = -1
    done: bool = False


# Rows whose logits are computed at once for prompt log-probabilities (bounds the memory).
PROMPT_ROWS_PER_SLICE = 256
