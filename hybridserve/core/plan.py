"""The data contract between scheduler and executor: StepPlan in, StepResult out. Pure data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hybridserve.core.request import SamplingParams


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the first `num_tokens` slots of `src_block_id` into `dst_block_id` in one group.

    Issued when a prefix hit ends inside a block (alignment finer than the block): the shared
    block stays read-only and the request continues in its own copy (copy-on-write).
    """

    group_id: int
    src_block_id: int
    dst_block_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class HostCopy:
    """Copy one block of group `group_id` between device block `block_id` and host slot
    `slot` of the host tier: a save (device to host) or a load (host to device)."""

    group_id: int
    block_id: int
    slot: int
    # A write-through save of a block the last step computed: it may run beside the forward
    # (a side stream); every other transfer completes before the forward starts.
    background: bool = False


class ScheduledChunk(NamedTuple):
    """One request's work in a step (a NamedTuple: built for every request every step)."""

    req_id: str
    start: int  # first position computed this step (= num_computed_tokens before the step)
    token_ids: tuple[int, ...]  # tokens fed this step, positions [start, start + len), drafts last
    # Per cache group: the request's whole block table when `new_request`, else only the blocks
    # added this step (the executor keeps the tables, as vLLM's cached-request diff does).
    block_ids: tuple[tuple[int, ...], ...]
    sample: bool  # True when the chunk reaches the end of the known tokens (decode or last chunk)
    num_draft_tokens: int = 0  # how many of token_ids (at the end) are unverified drafts
    new_request: bool = False  # first step of this request (or of a resumption after preemption)
    # The request's sampling settings, sent with its first chunk (new_request) only.
    sampling: SamplingParams | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the executor must compute in one step. The executor never sees a Request."""

    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    block_copies: tuple[BlockCopy, ...] = ()  # run before the chunks
    # Host tier: saves (device -> host) run first, then loads (host -> device), then the
    # block copies: a block saved and loaded in one step is read after it is written.
    host_saves: tuple[HostCopy, ...] = ()
    host_loads: tuple[HostCopy, ...] = ()
    preempted_req_ids: tuple[str, ...] = ()  # their state may be dropped
    finished_req_ids: tuple[str, ...] = ()  # finished last step; the executor frees their state

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class TokenLogprob(NamedTuple):
    """One token's log-probability under the model, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


class ReadOnlyDict(dict[str, Any]):
    """A dict that refuses every change after it is built: a StepResult's mappings. Reads
    are a dict's own (no proxy in the step's hot path)."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a StepResult's mappings are read-only; build a new StepResult")

    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[ReadOnlyDict], tuple[dict[str, Any]]]:
        return (ReadOnlyDict, (dict(self),))  # unpickled whole, never item by item


_NONE: Mapping[str, Any] = ReadOnlyDict()


def _none() -> Mapping[str, Any]:
    return _NONE


def _read_only(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy of `mapping` (the shared empty one when it is empty)."""
    if type(mapping) is ReadOnlyDict:
        return mapping
    return ReadOnlyDict(mapping) if mapping else _NONE


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the executor produced for a StepPlan. Its mappings are read-only copies of what
    the executor passed in: no one downstream can change what another reads."""

    step_id: int
    # req_id -> tokens emitted this step (accepted drafts plus the bonus token), in order.
    sampled_token_ids: Mapping[str, tuple[int, ...]]
    duration_s: float  # wall (torch) or modelled (simulator) time of the step
    # req_id -> draft tokens proposed for the next step (speculative decoding), if any.
    draft_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=_none)
    # req_id -> one entry per emitted token, for requests whose sampling asks for `logprobs`.
    # Executors without a model leave it empty.
    logprobs: Mapping[str, tuple[TokenLogprob, ...]] = field(default_factory=_none)
    # req_id -> log-probabilities of prompt tokens computed this step, for requests asking for
    # `prompt_logprobs`: consecutive positions, continuing where the last step's ended (the
    # first prompt token has none; a request's entries total its prompt length - 1).
    prompt_logprobs: Mapping[str, tuple[TokenLogprob, ...]] = field(default_factory=_none)

    def __post_init__(self) -> None:
        for name in ("sampled_token_ids", "draft_token_ids", "logprobs", "prompt_logprobs"):
            object.__setattr__(self, name, _read_only(getattr(self, name)))
