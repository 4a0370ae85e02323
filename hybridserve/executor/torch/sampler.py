"""Sampling and draft verification: greedy, or temperature/top-k/top-p with per-request seeds.

Random numbers are drawn from a generator seeded by (request seed, token position), so a
request's output does not depend on its batch, on preemption, or on speculation. At each
position distinct seeds give distinct generator seeds. Settings go through
`SamplingParams.numerically_safe` first (temperatures below 1e-5 are greedy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridserve.core.request import SamplingParams
from hybridserve.executor.torch import cpu_kernels

_GREEDY = SamplingParams()


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers that scatters nearby inputs."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at `position`: for a fixed position, one-to-one in
    the 64-bit request seed (XOR with a constant, then a bijection)."""
    return _mix64((seed & _MASK64) ^ _mix64(position & _MASK64))


def _generator(params: SamplingParams, position: int, default_seed: int) -> torch.Generator:
    seed = params.seed if params.seed is not None else default_seed
    gen = torch.Generator()
    gen.manual_seed(position_seed(seed, position))
    return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of `logits` [V] after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams | None,
    *,
    first_position: int,
    default_seed: int = 0,
) -> tuple[int, ...]:
    """Tokens emitted for one request: accepted drafts plus one sampled (bonus) token.

    `logits` has `len(drafts) + 1` rows; row j predicts the token at `first_position + j`.
    Greedy accepts a draft iff it is the argmax (so the output equals non-speculative greedy);
    sampling accepts draft d with probability p(d) and on rejection samples from p without d
    (speculative sampling with a one-hot draft distribution).
    """
    finite = _finite_rows(logits)
    if finite is not None and not all(finite):
        return ()
    return _verify_finite(logits, drafts, params, first_position, default_seed)


def _verify_finite(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams | None,
    first_position: int,
    default_seed: int,
) -> tuple[int, ...]:
    """`verify` on finite logits; () where a row's probabilities are not finite (logits that
    overflow when divided by the temperature)."""
    params = (params or _GREEDY).numerically_safe()
    if params.temperature == 0.0:
        return accept_greedy(greedy_tokens(logits).tolist(), drafts)
    emitted: list[int] = []
    for j in range(len(drafts) + 1):
        gen = _generator(params, first_position + j, default_seed)
        probs = probabilities(logits[j], params)
        total = float(probs.sum())  # NaN or inf when any probability is
        if not (math.isfinite(total) and total > 0.0):
            return ()
        if j < len(drafts):
            draft = drafts[j]
            if torch.rand((), generator=gen).item() < probs[draft].item():
                emitted.append(draft)
                continue
            probs = probs.clone()
            probs[draft] = 0.0
            if probs.sum() <= 0:
                emitted.append(draft)
                continue
            probs = probs / probs.sum()
        emitted.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        break
    return tuple(emitted)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of tied maxima, NaN above all, as `argmax`). `max(dim)`
    computes the same indices 2.6-3.1x faster than `argmax` on the CPU (2 threads, 262,144-entry
    rows: 0.61 against 1.59 ms at 8 rows, 2.4 against 7.3 at 32)."""
    return logits.max(dim=-1).indices


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> tuple[int, ...]:
    """Greedy verification from each row's argmax: drafts up to the first mismatch, then the
    argmax there (or the bonus token after the last draft)."""
    out: list[int] = []
    for j, target in enumerate(targets):
        out.append(int(target))
        if j == len(drafts) or target != drafts[j]:
            break
    return tuple(out)


def verify_batch(
    logits: torch.Tensor,
    requests: Sequence[tuple[Sequence[int], SamplingParams | None, int]],
    *,
    default_seed: int = 0,
) -> list[tuple[int, ...]]:
    """`verify` for every sampling request of a step. `logits` holds `len(drafts) + 1` rows per
    request, request after request; `requests` gives (drafts, params, first_position) each.
    One argmax over all rows (on the logits' device) serves every greedy request; the others
    are verified row by row with their seeded generators, so no output depends on the batch.
    One cheap finiteness check covers the batch; only when it fails are the requests with a
    non-finite row found, and they get ()."""
    sizes = [len(drafts) + 1 for drafts, _, _ in requests]
    greedy = [params is None or params.temperature == 0.0 for _, params, _ in requests]
    found = _clean_greedy_rows(logits) if all(greedy) else None
    if found is not None:  # every row finite: one pass gave every argmax
        unusable, targets = frozenset[int](), found
    else:
        unusable = _non_finite_requests(logits, sizes)
        targets = greedy_tokens(logits).tolist() if any(greedy) else []
    host = logits if all(greedy) else logits.cpu()
    out: list[tuple[int, ...]] = []
    offset = 0
    for i, (drafts, params, first_position) in enumerate(requests):
        rows = slice(offset, offset + sizes[i])
        offset += sizes[i]
        if i in unusable:
            out.append(())
        elif greedy[i]:
            out.append(accept_greedy(targets[rows], drafts))
        else:
            out.append(_verify_finite(host[rows], drafts, params, first_position, default_seed))
    return out


def _clean_greedy_rows(logits: torch.Tensor) -> list[int] | None:
    """Every row's argmax from the CPU row kernel (one pass that also checks that each value is
    finite), or None: not a float32 CPU tensor, no kernel, or some row not all finite."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    kernels = cpu_kernels.load()
    return None if kernels is None else kernels.greedy_rows(logits)


def _non_finite_requests(logits: torch.Tensor, sizes: Sequence[int]) -> frozenset[int]:
    """The indices of the requests (`sizes[i]` rows each, in order) with a non-finite row."""
    finite = _finite_rows(logits)
    if finite is None:
        return frozenset()
    bad, offset = [], 0
    for i, size in enumerate(sizes):
        if not all(finite[offset : offset + size]):
            bad.append(i)
        offset += size
    return frozenset(bad)


def _finite_rows(logits: torch.Tensor) -> list[bool] | None:
    """Whether each row of `logits` can be sampled from; None when all can. A row can when it
    holds no NaN and no +inf and some finite logit: -inf is a token masked out (a grammar,
    `min_tokens`). A row's sum is finite only if every logit is (the cheap check, one pass);
    only when some sum is not are the rows checked exactly (large finite logits can sum past
    float32's range)."""
    if bool(torch.isfinite(logits.sum(dim=-1)).all()):
        return None
    unusable = torch.isnan(logits) | (logits == float("inf"))
    usable = ~unusable.any(dim=-1) & torch.isfinite(logits).any(dim=-1)
    finite: list[bool] = usable.tolist()
    return finite
