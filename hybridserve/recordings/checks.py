"""A recording's lines read and checked: each error names the file, the line and the field.

A file that stops early (its last line cut mid-record, fewer requests or steps than its header
says) is a *truncated recording*, told apart from a malformed one and from a replay that
diverges: a copy that stopped is fixed by copying it again, not by changing the scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridserve.cache_replay.trace import TraceError, read_text_lines
from hybridserve.core.errors import HybridServeError


class RecordingError(HybridServeError, ValueError):
    """The recording is malformed, or a rebuilt prompt does not match its digest."""


# Header fields the replay reads (FORMAT.md 2), as "table.field".
ENGINE_FIELDS = (
    "max_num_seqs",
    "max_num_scheduled_tokens",
    "max_model_len",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "policy",
    "scheduler_reserve_full_isl",
    "num_blocks",
    "hash_block_size",
)
# The prompt generator's parameters (FORMAT.md, workload.formulas); the moduli must be > 0.
PARAM_FIELDS = (
    "n_agents",
    "growth",
    "base_min",
    "base_mul",
    "base_mod",
    "agent_tag_base",
    "agent_tok_base",
    "agent_a_mul",
    "agent_p_mul",
    "agent_tok_mod",
    "suffix_tag_base",
    "suffix_tok_base",
    "suffix_i_mul",
    "suffix_j_mul",
    "suffix_tok_mod",
    "suffix_min",
    "suffix_len_mul",
    "suffix_len_mod",
)
_MODULI = ("n_agents", "base_mod", "agent_tok_mod", "suffix_tok_mod", "suffix_len_mod")
# Request-line fields: name -> (type, least value or None).
REQUEST_FIELDS: dict[str, tuple[type, int | None]] = {
    "req_id": (str, None),
    "idx": (int, 0),
    "arrival_step": (int, 0),
    "arrival_time": (float, None),
    "priority": (int, None),
    "prompt_len": (int, 1),
    "prompt_sha256": (str, None),
    "max_tokens": (int, 1),
    "sampler": (dict, None),
}
_SAMPLER_FIELDS = ("base", "offset", "mod")
_DRAFT_SAMPLER_FIELDS = ("i_mul", "s_mul", "off", "mod")


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(1-based line number, JSON object) of every non-blank line. A last line cut mid-record
    is a truncated recording; any other line that is not a JSON object is malformed."""
    try:
        lines = list(
            read_text_lines(path, what="recording", hint="give the path of a .jsonl recording")
        )
    except TraceError as exc:
        raise RecordingError(str(exc)) from None
    rows: list[tuple[int, dict[str, Any]]] = []
    for lineno, text in lines:
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                raise RecordingError(
                    f"truncated recording: {path}:{lineno}, the last line, is cut off mid-record "
                    f"({exc.msg} at column {exc.colno}); the file ends before the recording "
                    "does: copy or record it again"
                ) from None
            raise RecordingError(
                f"{path}:{lineno}: not JSON ({exc.msg} at column {exc.colno}); each line is one "
                "JSON object"
            ) from None
        if not isinstance(row, dict):
            raise RecordingError(f"{path}:{lineno}: expected a JSON object, got {row!r:.60}")
        rows.append((lineno, row))
    if not rows:
        raise RecordingError(f"{path} is empty; line 1 must be a recording header")
    return rows


def field(row: dict[str, Any], name: str, kind: type, where: str, least: int | None = None) -> Any:
    """`row[name]`, checked to be a `kind` (at least `least`). Raises RecordingError naming
    `where` (file:line), the field and the value."""
    if name not in row:
        raise RecordingError(f"{where}: field {name!r} is missing; the recorder writes it")
    value = row[name]
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if ok and least is not None and value < least:
        ok = False
    if not ok:
        wanted = {int: "an integer", float: "a number", str: "a string", dict: "an object"}
        need = wanted.get(kind, kind.__name__) + ("" if least is None else f" >= {least}")
        raise RecordingError(f"{where}: {name}={value!r:.80}; use {need}")
    return value


def check_header(path: Path, header: dict[str, Any]) -> None:
    """The header fields the replay reads, each present and of its type (line 1)."""
    where = f"{path}:1"
    engine = field(header, "engine", dict, where)
    for name in ENGINE_FIELDS:
        if name not in engine:
            raise RecordingError(
                f"{where}: engine.{name} is missing; the recorder writes every engine setting "
                "the replay uses"
            )
    cache = field(header, "cache", dict, where)
    groups = cache.get("groups")
    if not isinstance(groups, list) or not groups:
        raise RecordingError(f"{where}: cache.groups={groups!r:.80}; use a list of cache groups")
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise RecordingError(f"{where}: cache.groups[{g}]={group!r:.80}; use an object")
        field(group, "kind", str, f"{where}: cache.groups[{g}]")
        field(group, "block_size", int, f"{where}: cache.groups[{g}]", 1)
    workload = field(header, "workload", dict, where)
    field(workload, "n_requests", int, f"{where}: workload", 0)
    params = field(workload, "params", dict, f"{where}: workload")
    for name in PARAM_FIELDS:
        field(params, name, int, f"{where}: workload.params", 1 if name in _MODULI else None)
    _check_prompt_map(where, workload.get("prompt_map"))
    sampler = workload.get("spec_sampler")
    if sampler:
        for name in _DRAFT_SAMPLER_FIELDS:
            field(sampler, name, int, f"{where}: workload.spec_sampler", 1 if name == "mod" else 0)
    speculative = engine.get("speculative")
    if speculative:
        field(speculative, "method", str, f"{where}: engine.speculative")
        field(speculative, "num_speculative_tokens", int, f"{where}: engine.speculative", 0)


def _check_prompt_map(where: str, prompt_map: Any) -> None:
    if not prompt_map:
        return
    if not isinstance(prompt_map, dict):
        raise RecordingError(f"{where}: workload.prompt_map={prompt_map!r:.80}; use an object")
    period = field(prompt_map, "period", int, f"{where}: workload.prompt_map", 1)
    for name in ("ctx_back", "sfx_back"):
        back = prompt_map.get(name)
        if (
            not isinstance(back, list)
            or len(back) != period
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in back)
        ):
            raise RecordingError(
                f"{where}: workload.prompt_map.{name}={back!r:.80}; use {period} integers >= 0 "
                "(one per position in the period)"
            )


def check_request(where: str, row: dict[str, Any]) -> None:
    """The fields of one request line, each present and of its type."""
    for name, (kind, least) in REQUEST_FIELDS.items():
        field(row, name, kind, where, least)
    for name in _SAMPLER_FIELDS:
        field(row["sampler"], name, int, f"{where}: sampler", 1 if name == "mod" else None)


def check_complete(
    path: Path, header: dict[str, Any], *, num_requests: int, num_steps: int, last_line: int
) -> None:
    """A file with fewer requests or steps than its header says ends early: truncated."""
    wanted = header["workload"]["n_requests"]
    if num_requests < wanted and num_steps == 0:
        raise RecordingError(
            f"truncated recording: {path} ends at line {last_line} after {num_requests} of the "
            f"{wanted} request lines its header (workload.n_requests) announces, before any "
            "step: copy or record it again"
        )
    if num_requests != wanted:
        raise RecordingError(
            f"{path}: {num_requests} request lines, header (workload.n_requests) says {wanted}"
        )
    totals = header.get("totals")
    steps = totals.get("steps") if isinstance(totals, dict) else None
    if isinstance(steps, int) and num_steps < steps:
        raise RecordingError(
            f"truncated recording: {path} ends at line {last_line} after {num_steps} of the "
            f"{steps} steps its header (totals.steps) announces: copy or record it again"
        )
    if isinstance(steps, int) and num_steps > steps:
        raise RecordingError(
            f"{path}: {num_steps} step lines, header (totals.steps) says {steps}; the file holds "
            "more than one recording or was edited"
        )
