"""Top-k key selection for sparse attention (DeepSeek-V3.2 / GLM DSA indexer), exact under DCP.

Each rank scores its own keys, keeps its local top-k as `(score, position)` candidates, and the
group all-gathers them: the global top-k is always inside the union of the local top-ks, so
every rank then knows exactly which of its keys are selected. Ties go to the earlier position on
every rank and in the unsharded run alike.
"""

from __future__ import annotations

import torch

from hybridserve.parallel.group import DcpGroup, all_gather_stacked

__all__ = ["index_scores", "select_top_k"]


def index_scores(
    index_q: torch.Tensor, index_weights: torch.Tensor, index_keys: torch.Tensor
) -> torch.Tensor:
    """`sum_h w_h relu(q_h . k)` per row and key: `[rows, heads, d]`, `[rows, heads]`,
    `[rows, keys, d]` to `[rows, keys]`."""
    logits = torch.einsum("rhd,rtd->rht", index_q, index_keys) * index_q.shape[-1] ** -0.5
    return torch.einsum("rht,rh->rt", torch.relu(logits), index_weights)


def _top_k_ordered(
    scores: torch.Tensor, positions: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best `(score, position)` per row: higher score first, then earlier position.

    Pads with `(-inf, -1)` when a row has fewer than `k` candidates.
    """
    rows, width = scores.shape
    if width < k:
        scores = torch.cat([scores, scores.new_full((rows, k - width), float("-inf"))], dim=1)
        positions = torch.cat([positions, positions.new_full((rows, k - width), -1)], dim=1)
    by_position = torch.sort(positions, dim=1, stable=True).indices
    scores, positions = scores.gather(1, by_position), positions.gather(1, by_position)
    by_score = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, by_score), positions.gather(1, by_score)


def select_top_k(
    scores: torch.Tensor,
    valid: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    k: int,
    dcp: DcpGroup,
) -> torch.Tensor:
    """Mask `[rows, keys]` of this rank's keys among each row's global top-k valid keys.

    `scores` and `valid` are `[rows, keys]` over this rank's keys, `key_positions` `[keys]`
    their sequence positions. A collective when `dcp.world_size > 1`: every rank must call it.
    """
    rows = scores.shape[0]
    positions = key_positions.unsqueeze(0).expand(rows, -1)
    masked = scores.masked_fill(~valid, float("-inf"))
    best_scores, best_positions = _top_k_ordered(masked, positions, k)
    if dcp.world_size > 1:
        all_scores = all_gather_stacked(best_scores, dcp).permute(1, 0, 2).reshape(rows, -1)
        all_positions = all_gather_stacked(best_positions, dcp).permute(1, 0, 2).reshape(rows, -1)
        best_scores, best_positions = _top_k_ordered(all_scores, all_positions, k)
    chosen = torch.where(best_scores > float("-inf"), best_positions, -1)
    selected = (positions.unsqueeze(-1) == chosen.unsqueeze(1)).any(dim=-1)
    return selected & valid
