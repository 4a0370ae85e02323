"""DecodeSharing: the KV blocks a step's decodes read in common, followed from the step plans.

A StepPlan carries each request's whole block table on its first chunk and only the blocks a
step adds after that (vLLM's cached-request diff), so a follower keeps the tables, as a real
executor does. Each step, `shared_kv_tokens` counts the context tokens of the step's
decodes (one token, or a verify of k + 1) that sit in a full-attention block another decode of
the step also reads, once per extra reader: the prefix cache gives every request whose prompt
begins with a shared system prompt the same blocks for it. The cost model's decode-attention
term reads those tokens once to the extent `Efficiency.shared_kv` says
(`hybridserve.sim.cost_model`), and a step log records them (`hybridserve.engine.step_log`).

Pure Python, and kept only where it is used (the simulator's, where its constants price the
sharing; a step log's): it costs one pass over the decodes' block tables a step.
"""

from __future__ import annotations

from collections import Counter

from hybridserve.core.plan import StepPlan
from hybridserve.kvcache.layout import CacheLayout
from hybridserve.kvcache.spec import FullAttentionSpec

NULL_BLOCK_ID = 0  # the pool's null block (a placeholder, never read)


class DecodeSharing:
    """The block tables of one full-attention group, and the shared reads of each step."""

    def __init__(self, group: int, block_size: int) -> None:
        self.group, self.block_size = group, block_size
        self._tables: dict[str, list[int]] = {}

    @classmethod
    def of(cls, layout: CacheLayout) -> DecodeSharing | None:
        """Over the layout's first full-attention group (None: the model has none)."""
        for index, spec in enumerate(layout.groups):
            if isinstance(spec, FullAttentionSpec):
                return cls(index, spec.block_size)
        return None

    def shared_kv_tokens(self, plan: StepPlan) -> int:
        """Follow `plan`'s tables, and count its decodes' shared context tokens."""
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self._tables.pop(req_id, None)
        counts: Counter[int] = Counter()
        for chunk in plan.chunks:
            added = chunk.block_ids[self.group] if self.group < len(chunk.block_ids) else ()
            if chunk.new_request:
                table = self._tables[chunk.req_id] = list(added)
            else:
                table = self._tables.setdefault(chunk.req_id, [])
                table.extend(added)
            if chunk.num_tokens <= 1 + chunk.num_draft_tokens:
                # Only whole blocks before the decode's own position can be another's too.
                counts.update(table[: chunk.start // self.block_size])
        counts.pop(NULL_BLOCK_ID, None)
        return self.block_size * sum(n - 1 for n in counts.values() if n > 1)
