"""What constrained decoding costs on the torch executor: decode steps at batch 8 with every
request held to a JSON schema, against the same requests unconstrained.

SmolLM2-135M (the built-in `smollm2`, `make models`) serves 8 chat prompts at once through the
Engine, `--new` tokens each. Unconstrained, the requests ignore EOS; constrained, each follows
a JSON schema (an array of at least 40 small objects) that cannot complete within `--new`
tokens, so both runs decode the same number of steps at batch 8. A step counts when all 8
requests decode (one token each). Rounds alternate the two runs (`--rounds`, paired), and the
report gives each round's median decode-step time for both, their ratio, the mean ratio with
its spread, and the time the rules took inside the step (mask, bias, commit) measured
directly: on a shared machine step times swing by 10% from run to run, so the rules' own
share of the step is the steadier figure. Prints one JSON object.

    .venv/bin/python benchmarks/constrained_decoding.py [--new 48] [--rounds 5] [--threads 2]
        [--out docs/constrained_decoding.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.core.request import Request, SamplingParams, StructuredOutput
from hybridserve.engine.settings import SettingsSources
from hybridserve.executor.grammar import Grammars
from hybridserve.executor.torch.checkpoints import builtin_path
from hybridserve.executor.torch.constraints import Constraints
from hybridserve.offline.runtime import TorchRuntime, build_runtime

BATCH = 8
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
TOPICS = ["groceries", "tools", "books", "toys", "plants", "tea", "paint", "shoes"]


class TimedConstraints(Constraints):
    """The executor's rules, with the seconds they take inside each step."""

    def __init__(self, grammars: Grammars | None) -> None:
        super().__init__(grammars)
        self.seconds = 0.0

    def apply(self, scores: torch.Tensor, requests: Any) -> torch.Tensor:
        began = time.perf_counter()
        try:
            return super().apply(scores, requests)
        finally:
            self.seconds += time.perf_counter() - began

    def commit(self, req_id: str, emitted: Any) -> bool:
        began = time.perf_counter()
        try:
            return super().commit(req_id, emitted)
        finally:
            self.seconds += time.perf_counter() - began


def run(runtime: TorchRuntime, prompts: list[list[int]], new: int, *, constrained: bool,
        tag: str) -> dict[str, Any]:  # fmt: skip
    """One batch of 8 through the Engine; the decode steps' times and the rules' time."""
    rules = runtime.executor.constraints
    assert isinstance(rules, TimedConstraints)
    rules.seconds = 0.0
    structured = StructuredOutput("json", json.dumps(SCHEMA)) if constrained else None
    stop = tuple(runtime.stop_token_ids)
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(
            max_tokens=new, structured=structured, stop_token_ids=stop, ignore_eos=not constrained
        )
        runtime.engine.add_request(Request(req_id=f"{tag}-{i}", prompt_token_ids=tuple(prompt),
                                           sampling=sampling))  # fmt: skip
    decode_s: list[float] = []
    generated = 0
    while runtime.engine.has_requests():
        step = runtime.engine.step()
        chunks = step.scheduled.plan.chunks
        if len(chunks) == BATCH and all(c.num_tokens == 1 for c in chunks):
            decode_s.append(step.result.duration_s)
        generated += sum(len(o.new_token_ids) for o in step.outputs)
    return {
        "decode_steps": len(decode_s),
        "median_step_ms": 1000 * statistics.median(decode_s),
        "rules_ms_per_step": 1000 * rules.seconds / max(len(decode_s), 1),
        "generated": generated,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = builtin_path("smollm2")
    if not path.exists():
        raise SystemExit(f"{path} is absent: run `make models`")
    runtime = build_runtime(path, num_blocks=512, settings=SettingsSources(
        flags=(("max_num_seqs", BATCH),)))  # fmt: skip
    tokenizer = runtime.tokenizer
    assert tokenizer is not None
    vocab = max(int(runtime.executor.model.vocab_size), tokenizer.backend.get_vocab_size())
    grammars = Grammars(tokenizer.backend.to_str(), vocab_size=vocab,
                        eos_token_ids=runtime.stop_token_ids)  # fmt: skip
    runtime.executor.constraints = TimedConstraints(grammars)
    prompts = [
        tokenizer.encode_prompt(f"List {topic} with quantities as JSON.", chat=True)
        for topic in TOPICS
    ]
    rounds = []
    run(runtime, prompts, 8, constrained=True, tag="warm")  # compile the grammar, warm caches
    for r in range(args.rounds):
        free = run(runtime, prompts, args.new, constrained=False, tag=f"free{r}")
        held = run(runtime, prompts, args.new, constrained=True, tag=f"json{r}")
        ratio = held["median_step_ms"] / free["median_step_ms"]
        rounds.append({"unconstrained": free, "constrained": held, "ratio": ratio})
    ratios = [r["ratio"] for r in rounds]
    report = {
        "model": "smollm2 (SmolLM2-135M-Instruct Q4_1)",
        "batch": BATCH,
        "new_tokens": args.new,
        "threads": args.threads,
        "rounds": rounds,
        "ratio_mean": statistics.fmean(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rules_share_of_step": statistics.fmean(
            r["constrained"]["rules_ms_per_step"] / r["constrained"]["median_step_ms"]
            for r in rounds
        ),
        "goal": "constrained decode step at most 1.10x the unconstrained one",
        "command": " ".join(sys.argv),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
