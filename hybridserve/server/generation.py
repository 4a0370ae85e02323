"""One request's generation on the event loop: deliveries, detokenizing, stop strings, metrics.

Stop strings are matched on the detokenized text; the text is cut before the match (as OpenAI
does) and the request is aborted in the engine, which frees its blocks at once. While
streaming, the last `len(longest stop) - 1` characters are held back so a stop string split
across deliveries is never sent in part.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from starlette.requests import Request as HttpRequest

from hybridserve.core.plan import TokenLogprob
from hybridserve.core.request import Request
from hybridserve.server.async_engine import AsyncEngine, Delivery, RequestStream
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.protocol import ApiError
from hybridserve.server.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Piece:
    """Text released by one delivery; `finish_reason` is set on the last piece only."""

    text: str
    finish_reason: str | None
    num_output_tokens: int
    # On a last piece the server cut short (shutdown): a stream ends with `finish_reason`,
    # a whole response answers this error instead.
    error: ApiError | None = None
    # Log-probabilities that arrived since the last piece (requests that asked for them):
    # generated tokens (a stop token included, as its token counts in the usage) and prompt
    # tokens.
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # Prompt tokens the prefix cache served (known from the request's admission on).
    num_cached_tokens: int = 0
    # The token ids generated since the last piece (a stop token included, as in the usage).
    token_ids: tuple[int, ...] = ()


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str, *, final: bool) -> tuple[str, bool]:
        """(text safe to release, whether a stop string ended the output)."""
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out, False
        cut = min((i for s in self.stops if (i := self._pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, self._pending = self._pending[:cut], ""
            return out, True
        keep = 0 if final else self._hold
        split = max(len(self._pending) - keep, 0)
        out, self._pending = self._pending[:split], self._pending[split:]
        return out, False


def _coalesce(first: Delivery, queue: asyncio.Queue[Delivery]) -> Delivery:
    """`first` and every delivery already waiting behind it, as one. When the engine outpaces
    the event loop (many streams, fast steps), each stream then costs one event per turn of the
    loop instead of one per token, so the loop catches up and sees hang-ups promptly."""
    if first.finished or queue.empty():
        return first
    token_ids, last = list(first.token_ids), first
    logprobs, prompt_logprobs = list(first.logprobs), list(first.prompt_logprobs)
    cached = first.num_cached_tokens
    while not last.finished and not queue.empty():
        last = queue.get_nowait()
        token_ids.extend(last.token_ids)
        logprobs.extend(last.logprobs)
        prompt_logprobs.extend(last.prompt_logprobs)
        if cached is None:
            cached = last.num_cached_tokens
    return replace(
        last,
        token_ids=tuple(token_ids),
        logprobs=tuple(logprobs),
        prompt_logprobs=tuple(prompt_logprobs),
        num_cached_tokens=cached,
    )


async def _abort_on_disconnect(http: HttpRequest, engine: AsyncEngine, req_id: str) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            engine.abort(req_id)
            return


async def generate(
    *,
    engine: AsyncEngine,
    metrics: ServerMetrics,
    tokenizer: Tokenizer,
    request: Request,
    stream: RequestStream,
    stops: Sequence[str],
    http: HttpRequest,
) -> AsyncIterator[Piece]:
    """Yield the text of `request` (already submitted, delivering on `stream`) as it is
    generated. The request is aborted in the engine if the client disconnects or stops
    reading. A stop token counts as an output token but adds no text. Raises ApiError when
    the request fails."""
    watcher = asyncio.create_task(_abort_on_disconnect(http, engine, request.req_id))
    decoder, matcher = tokenizer.new_decoder(), StopMatcher(stops)
    stop_ids = frozenset(request.sampling.stop_token_ids)
    arrival, last = request.arrival_time, None
    num_tokens = num_cached = 0
    reason: str | None = None
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    try:
        while reason is None:
            delivery = _coalesce(await stream.queue.get(), stream.queue)
            if delivery.error is not None and not delivery.graceful:
                reason = "abort"
                raise delivery.error
            logprobs.extend(delivery.logprobs)
            prompt_logprobs.extend(delivery.prompt_logprobs)
            if delivery.num_cached_tokens is not None:
                num_cached = delivery.num_cached_tokens
            now = engine.now()
            if delivery.token_ids:
                num_tokens += len(delivery.token_ids)
                if last is None:
                    metrics.on_first_token(now - arrival)
                else:
                    metrics.on_gap(now - last)
                last = now
            token_ids = delivery.token_ids
            if delivery.finish_reason == "stop" and token_ids[-1:] and token_ids[-1] in stop_ids:
                token_ids = token_ids[:-1]
            text = decoder.push(token_ids)
            if delivery.finished:
                text += decoder.flush()
            out, stopped = matcher.feed(text, final=delivery.finished)
            cut_short = None
            if stopped:
                reason = "stop"
                engine.abort(request.req_id)
            elif delivery.finished:
                reason = delivery.finish_reason or "stop"
                cut_short = delivery.error
            # A piece for every delivery of tokens, even one whose text is held back (an
            # incomplete UTF-8 character, a possible stop string's start): a client times each
            # token from its event, as vLLM's streams allow (it skips only chunks with no new
            # token). Without the empty pieces a stream of byte tokens arrived as one event every
            # other step, and clients measured twice the inter-token latency.
            if out or reason is not None or delivery.token_ids:
                yield Piece(
                    out,
                    reason,
                    num_tokens,
                    cut_short,
                    tuple(logprobs),
                    tuple(prompt_logprobs),
                    num_cached,
                    delivery.token_ids,
                )
                logprobs.clear()
                prompt_logprobs.clear()
    finally:
        watcher.cancel()
        if reason is None:
            reason = "abort"
            engine.abort(request.req_id)
        metrics.on_finished(reason=reason, latency_s=engine.now() - arrival)
