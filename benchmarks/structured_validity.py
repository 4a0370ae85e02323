"""Structured outputs and forced tool calls, validated: N generated requests through the HTTP
API (the real `openai` client, 8 at a time) against a `hybridserve serve --executor torch
--model smollm2` process,
each response parsed and validated with `jsonschema` against the schema it was asked for.

Requests cycle through three kinds over a set of schemas and prompts, with seeds:
`response_format` json_schema (strict), `tool_choice: "required"` (parallel calls allowed:
every call must name an offered tool and its arguments validate), and a named function. The
schemas are ordinary (objects, arrays, enums, integers, nested objects, strings with and
without bounds; `--bound-strings N` gives every unbounded string `maxLength: N`). A response
counts as valid when it finished by itself (`stop` / `tool_calls`) and validates; one cut at
`max_tokens` counts as invalid (`finish_reasons` tells them apart).
Prints one JSON object.

    .venv/bin/python benchmarks/structured_validity.py [--requests 200] [--max-tokens 256]
        [--threads 2] [--out docs/structured_validity.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import ServerProcess, free_port

MODEL = "smollm2"

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "weather",
        "What is the weather in Paris?",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "calculator",
        "What is 17 times 23?",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 40}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    ),
    (
        "read_file",
        "Open the file notes/todo.txt and show it.",
        {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "max_lines": {"type": "integer", "minimum": 1, "maximum": 1000},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
    ),
    (
        "create_event",
        "Book a meeting with Ana and Bo tomorrow at 10.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 1,
                    "maxItems": 5,
                },
                "start": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                "all_day": {"type": "boolean"},
            },
            "required": ["title", "attendees", "start"],
            "additionalProperties": False,
        },
    ),
    (
        "search",
        "Find recent papers on state space models.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {
                        "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
                        "kind": {"type": "string", "enum": ["paper", "code", "any"]},
                    },
                    "required": ["kind"],
                    "additionalProperties": False,
                },
            },
            "required": ["query", "filters"],
            "additionalProperties": False,
        },
    ),
]
KINDS = ("json_schema", "required", "named")


def bounded(schema: Any, limit: int) -> Any:
    """`schema` with `maxLength: limit` on every string that has no bound."""
    if isinstance(schema, list):
        return [bounded(item, limit) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded(value, limit) for key, value in schema.items()}
    if out.get("type") == "string" and "maxLength" not in out and "enum" not in out:
        out["maxLength"] = limit
    return out


def tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def one_request(client: OpenAI, i: int, max_tokens: int) -> dict[str, Any]:
    """Request i: its kind, schema and prompt by position; (kind, valid, why)."""
    kind = KINDS[i % len(KINDS)]
    name, prompt, schema = SCHEMAS[(i // len(KINDS)) % len(SCHEMAS)]
    tools = [tool(n, s) for n, _, s in SCHEMAS]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
    }
    if kind == "json_schema":
        fmt = {"name": name, "schema": schema, "strict": True}
        kwargs["response_format"] = {"type": "json_schema", "json_schema": fmt}
    elif kind == "required":
        kwargs |= {"tools": tools, "tool_choice": "required"}
    else:
        kwargs |= {"tools": tools, "tool_choice": {"type": "function", "function": {"name": name}}}
    started = time.perf_counter()
    choice = client.chat.completions.create(**kwargs).choices[0]
    out = {"kind": kind, "finish": choice.finish_reason, "s": time.perf_counter() - started}
    out["text"] = (choice.message.content or "")[:300]
    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
        else:
            calls = choice.message.tool_calls or []
            if not calls:
                raise ValueError("no tool call")
            schemas = {n: s for n, _, s in SCHEMAS}
            for call in calls:
                if kind == "named" and call.function.name != name:
                    raise ValueError(f"called {call.function.name}, not {name}")
                jsonschema.validate(
                    json.loads(call.function.arguments), schemas[call.function.name]
                )
            out["calls"] = len(calls)
        out["valid"] = choice.finish_reason in ("stop", "tool_calls")
        out["why"] = None if out["valid"] else f"finished by {choice.finish_reason}"
    except (ValueError, jsonschema.ValidationError) as exc:
        out["valid"] = False
        out["why"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return out


def summary(
    results: list[dict[str, Any]], args: argparse.Namespace, *, wall_s: float
) -> dict[str, Any]:
    """The report: valid responses in all and by kind, finish reasons, the invalid ones."""
    by_kind = {
        kind: {
            "requests": sum(r["kind"] == kind for r in results),
            "valid": sum(r["kind"] == kind and r["valid"] for r in results),
        }
        for kind in KINDS
    }
    report = {
        "model": MODEL,
        "requests": len(results),
        "valid": sum(r["valid"] for r in results),
        "valid_fraction": sum(r["valid"] for r in results) / max(len(results), 1),
        "by_kind": by_kind,
        "finish_reasons": dict(Counter(r["finish"] for r in results)),
        "calls_per_required_turn": dict(
            Counter(r.get("calls", 0) for r in results if r["kind"] == "required")
        ),
        "invalid": [
            {"i": i, "kind": r["kind"], "finish": r["finish"], "why": r["why"], "text": r["text"]}
            for i, r in enumerate(results)
            if not r["valid"]
        ][:40],
        "max_tokens": args.max_tokens,
        "bound_strings": args.bound_strings or None,
        "threads": args.threads,
        "wall_s": round(wall_s, 1),
        "command": " ".join(sys.argv),
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--first", type=int, default=0, help="index of the first request")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--bound-strings",
        type=int,
        default=0,
        help="give every string without a bound this maxLength (0: leave them unbounded)",
    )
    args = parser.parse_args()
    if args.bound_strings:
        SCHEMAS[:] = [(n, p, bounded(s, args.bound_strings)) for n, p, s in SCHEMAS]
    port = free_port()
    command = [
        sys.executable, "-c", "from hybridserve.cli import main; main()", "serve",
        "--executor", "torch", "--model", MODEL, "--device", "cpu", "--threads",
        str(args.threads), "--max-model-len", "2048", "--port", str(port),
        "--shutdown-timeout", "5",
    ]  # fmt: skip
    server = ServerProcess("hybridserve", command, Path("runs/structured_validity.log"), port)
    server.start(timeout_s=300)
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: one_request(client, i, args.max_tokens),
                                    range(args.first, args.first + args.requests)))  # fmt: skip
    finally:
        server.stop()
    report = summary(results, args, wall_s=time.perf_counter() - started)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
