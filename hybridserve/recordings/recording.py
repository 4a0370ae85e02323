"""Read a `vllm-sched-trace/1` recording and rebuild its scenario exactly.

The prompts come from the header's closed-form generator (with the prompt map of siblings and
identical resends, FORMAT.md 7.3); each is checked against the recorded sha256, so a replay
proves it rebuilt the exact token sequences. Extension files (FORMAT.md 7) also carry the
speculative config, the fake rejection sampler and sliding-window groups.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.core.config import (
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    SpeculativeMethod,
)
from hybridserve.core.request import Request, SamplingParams
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, MambaSpec, Retention
from hybridserve.kvcache.spec import GroupSpec, MambaCacheMode, SlidingWindowSpec
from hybridserve.recordings.checks import (
    RecordingError,
    check_complete,
    check_header,
    check_request,
    field,
    read_rows,
)

__all__ = ["FORMAT", "RecordedRequest", "Recording", "RecordingError", "load_recording"]

FORMAT = "vllm-sched-trace/1"


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    req_id: str
    index: int
    arrival_step: int
    arrival_time: float
    priority: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampler_base: int
    sampler_offset: int
    sampler_mod: int

    def output_token(self, t: int) -> int:
        return self.sampler_base + (self.sampler_offset + t) % self.sampler_mod

    def accepted_drafts(self, step: int, sampler: dict[str, int]) -> int:
        """The fake rejection sampler's k for this request in `step` (FORMAT.md 7.4)."""
        return (self.index * sampler["i_mul"] + step * sampler["s_mul"] + sampler["off"]) % sampler[
            "mod"
        ]

    def to_request(self) -> Request:
        """The request as the recorder passed it to vLLM (ignore_eos, greedy)."""
        return Request(
            req_id=self.req_id,
            prompt_token_ids=self.prompt,
            sampling=SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
            arrival_time=self.arrival_time,
            priority=self.priority,
        )


@dataclass(frozen=True, slots=True)
class Recording:
    path: Path
    header: dict[str, Any]
    requests: tuple[RecordedRequest, ...]
    steps: tuple[dict[str, Any], ...]

    @property
    def scenario(self) -> str:
        return str(self.header.get("scenario", self.path.stem))

    @property
    def draft_sampler(self) -> dict[str, int] | None:
        """The fake rejection sampler of a speculative recording, None without speculation."""
        sampler = self.header["workload"].get("spec_sampler")
        return dict(sampler) if sampler else None


def load_recording(path: Path) -> Recording:
    """Read and check a recording. Raises RecordingError naming the file, the line and the
    field; a file that ends early says "truncated recording"."""
    rows = read_rows(path)
    header_line, header = rows[0]
    if header.get("format") != FORMAT or header_line != 1:
        raise RecordingError(
            f"{path}:{header_line}: format={header.get('format')!r}; line 1 must be a "
            f"{FORMAT!r} header"
        )
    check_header(path, header)
    params = header["workload"]["params"]
    max_model_len = header["engine"]["max_model_len"]
    requests: list[RecordedRequest] = []
    steps: list[dict[str, Any]] = []
    for lineno, row in rows[1:]:
        where = f"{path}:{lineno}"
        if "req_id" in row:
            check_request(where, row)
            requests.append(_build_request(where, row, params, header, max_model_len))
        elif "step" in row:
            field(row, "step", int, where, len(steps))
            if row["step"] != len(steps):
                raise RecordingError(
                    f"{where}: step={row['step']}; the steps run 0, 1, 2, ... and step "
                    f"{len(steps)} comes next"
                )
            steps.append(row)
        else:
            raise RecordingError(
                f"{where}: neither a request (field 'req_id') nor a step (field 'step')"
            )
    check_complete(
        path, header, num_requests=len(requests), num_steps=len(steps), last_line=rows[-1][0]
    )
    return Recording(path, header, tuple(requests), tuple(steps))


def prompt_length(i: int, p: dict[str, int], prompt_map: dict[str, Any] | None = None) -> int:
    """The length of request i's prompt under the closed form, without building it."""
    ctx, sfx = prompt_indices(i, prompt_map)
    a, k = ctx % p["n_agents"], ctx // p["n_agents"]
    shared_len = p["base_min"] + (a * p["base_mul"]) % p["base_mod"] + k * p["growth"]
    suffix_len = p["suffix_min"] + (sfx * p["suffix_len_mul"]) % p["suffix_len_mod"]
    return max(shared_len, 1) + max(suffix_len, 1)


def prompt_indices(i: int, prompt_map: dict[str, Any] | None) -> tuple[int, int]:
    """(ctx_idx, sfx_idx): the generator indices of request i's shared part and suffix."""
    if not prompt_map:
        return i, i
    m = i % prompt_map["period"]
    return i - prompt_map["ctx_back"][m], i - prompt_map["sfx_back"][m]


def generate_prompt(
    i: int, p: dict[str, int], prompt_map: dict[str, Any] | None = None
) -> list[int]:
    """The recorder's closed-form prompt generator (FORMAT.md, workload.formulas), with the
    shared part from ctx_idx and the suffix from sfx_idx under a prompt map (FORMAT.md 7.3)."""
    ctx, sfx = prompt_indices(i, prompt_map)
    a, k = ctx % p["n_agents"], ctx // p["n_agents"]
    shared_len = p["base_min"] + (a * p["base_mul"]) % p["base_mod"] + k * p["growth"]
    suffix_len = p["suffix_min"] + (sfx * p["suffix_len_mul"]) % p["suffix_len_mod"]
    i = sfx
    prompt = [p["agent_tag_base"] + a]
    a_term = a * p["agent_a_mul"]
    prompt += [
        p["agent_tok_base"] + (a_term + q * p["agent_p_mul"]) % p["agent_tok_mod"]
        for q in range(1, shared_len)
    ]
    prompt.append(p["suffix_tag_base"] + i)
    i_term = i * p["suffix_i_mul"]
    prompt += [
        p["suffix_tok_base"] + (i_term + j * p["suffix_j_mul"]) % p["suffix_tok_mod"]
        for j in range(1, suffix_len)
    ]
    return prompt


def _build_request(
    where: str,
    row: dict[str, Any],
    params: dict[str, int],
    header: dict[str, Any],
    max_model_len: int,
) -> RecordedRequest:
    index = row["idx"]
    prompt_map = header["workload"].get("prompt_map")
    length = prompt_length(index, params, prompt_map)
    # The length is checked before the prompt is built: a bad parameter cannot allocate.
    if length != row["prompt_len"] or length > max_model_len:
        raise RecordingError(
            f"{where}: request {row['req_id']}: the generator gives a {length}-token prompt "
            f"where prompt_len={row['prompt_len']} (engine.max_model_len={max_model_len}); "
            "the generator parameters disagree with the recording"
        )
    prompt = generate_prompt(index, params, prompt_map)
    digest = hashlib.sha256(",".join(map(str, prompt)).encode("ascii")).hexdigest()
    if digest != row["prompt_sha256"] or len(prompt) != row["prompt_len"]:
        raise RecordingError(
            f"{where}: request {row['req_id']}: the rebuilt prompt ({len(prompt)} tokens) does "
            "not match the recorded prompt_sha256; the generator parameters disagree"
        )
    sampler = row["sampler"]
    return RecordedRequest(
        req_id=row["req_id"],
        index=index,
        arrival_step=row["arrival_step"],
        arrival_time=float(row["arrival_time"]),
        priority=row["priority"],
        prompt=tuple(prompt),
        max_tokens=row["max_tokens"],
        sampler_base=sampler["base"],
        sampler_offset=sampler["offset"],
        sampler_mod=sampler["mod"],
    )


def speculative_config(header: dict[str, Any]) -> SpeculativeConfig:
    """The recorded vLLM SpeculativeConfig as ours (FORMAT.md 7.1)."""
    recorded = header["engine"].get("speculative")
    if not recorded:
        return SpeculativeConfig()
    try:
        method = SpeculativeMethod(recorded["method"])
    except ValueError:
        raise RecordingError(f"unsupported speculative method {recorded['method']!r}") from None
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=recorded["num_speculative_tokens"],
        lookahead_block_hashes=not recorded.get("disable_lookahead_block_hashes", False),
        multi_module_mtp=bool(recorded.get("use_multi_module_mtp", False)),
    )


def scheduler_config(header: dict[str, Any]) -> SchedulerConfig:
    engine = header["engine"]
    if engine["policy"] not in [p.value for p in SchedulingPolicy]:
        raise RecordingError(
            f"engine.policy={engine['policy']!r}; use one of {[p.value for p in SchedulingPolicy]}"
        )
    return SchedulerConfig(
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_scheduled_tokens"],
        max_model_len=engine["max_model_len"],
        enable_chunked_prefill=engine["enable_chunked_prefill"],
        long_prefill_token_threshold=engine["long_prefill_token_threshold"],
        policy=SchedulingPolicy(engine["policy"]),
        reserve_full_isl=engine["scheduler_reserve_full_isl"],
    )


def cache_layout(header: dict[str, Any]) -> CacheLayout:
    cache, engine = header["cache"], header["engine"]
    groups: list[GroupSpec] = []
    for group in cache["groups"]:
        if group["kind"] == "FullAttentionSpec":
            groups.append(FullAttentionSpec(block_size=group["block_size"]))
        elif group["kind"] == "SlidingWindowSpec":
            if group.get("extra_retained_tokens"):
                raise RecordingError("sliding-window groups with extra_retained_tokens")
            groups.append(
                SlidingWindowSpec(block_size=group["block_size"], window=group["sliding_window"])
            )
        elif group["kind"] == "MambaSpec":
            mode_name = group.get("mamba_cache_mode") or "align"
            if mode_name not in [m.value for m in MambaCacheMode]:
                raise RecordingError(
                    f"cache.groups.mamba_cache_mode={mode_name!r}; use one of "
                    f"{[m.value for m in MambaCacheMode]}"
                )
            mode = MambaCacheMode(mode_name)
            checkpoint = (group.get("num_prefill_checkpoint_blocks") or 0) > 0
            groups.append(
                MambaSpec(
                    block_size=group["block_size"],
                    mode=mode,
                    prefill_checkpoint=checkpoint,
                    num_speculative_blocks=group.get("num_speculative_blocks") or 0,
                )
            )
        else:
            raise RecordingError(f"unsupported cache group kind {group['kind']!r}")
    interval = cache.get("prefix_cache_retention_interval")
    if interval is None:
        retention = Retention.parse("dense")
    elif interval == 0:
        retention = Retention.parse("boundary")
    else:
        retention = Retention.parse(f"interval:{interval}")
    flagged = tuple(g for g, group in enumerate(cache["groups"]) if group.get("is_eagle_group"))
    return CacheLayout(
        groups=tuple(groups),
        num_blocks=engine["num_blocks"],
        hash_block_size=engine["hash_block_size"],
        alignment_tokens=cache.get("cache_hit_alignment_tokens") or 0,
        retention=retention,
        speculative=speculative_config(header),
        eagle_groups=flagged or None,
        partial_hash_hits=bool(cache.get("enable_partial_hash_hits")),
        max_in_flight_tokens=engine.get("max_in_flight_tokens") or 0,
    )
