"""Offline batch generation: run an Engine until every request finishes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridserve.core.request import Request
from hybridserve.engine.engine import Engine

Progress = Callable[[int, int, int], None]  # (finished requests, total, generated tokens)


def run_to_completion(
    engine: Engine,
    requests: Sequence[Request],
    *,
    on_add: Callable[[Request], None] | None = None,
    progress: Progress | None = None,
    max_steps: int = 1_000_000,
) -> dict[str, list[int]]:
    """Add `requests`, step until none is left, return each request's output token ids.

    `on_add` runs before each request is queued (sampling settings need no registering: the
    plan carries them to the executor). Raises RuntimeError if `max_steps` pass without
    finishing or a request fails, and StepFailed if the executor raises.
    """
    outputs: dict[str, list[int]] = {r.req_id: [] for r in requests}
    for request in requests:
        if on_add is not None:
            on_add(request)
        engine.add_request(request)
    finished = generated = 0
    for _ in range(max_steps):
        if not engine.has_requests():
            return outputs
        step = engine.step()
        if step.failed:
            req_id, reason = step.failed[0]
            raise RuntimeError(f"request {req_id!r} failed: {reason}")
        for out in step.outputs:
            outputs[out.req_id].extend(out.new_token_ids)
            generated += len(out.new_token_ids)
            finished += out.finished
        if progress is not None and step.outputs:
            progress(finished, len(requests), generated)
    raise RuntimeError(f"generation did not finish within max_steps={max_steps}")
