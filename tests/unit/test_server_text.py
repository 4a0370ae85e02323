"""The server's text path: byte tokenizer, incremental decoding, stop strings."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.server.generation import StopMatcher
from hybridserve.server.tokenizer import BYTE_EOS_ID, ByteTokenizer, ChatMessage, OffsetDecoder


def test_byte_decoder_holds_a_split_multibyte_character_until_complete() -> None:
    ids = ByteTokenizer().encode("né€")
    decoder = ByteTokenizer().new_decoder()
    pieces = [decoder.push([t]) for t in ids]
    assert pieces == ["n", "", "é", "", "", "€"]
    assert decoder.flush() == ""


def test_byte_decoder_replaces_invalid_bytes_and_skips_eos() -> None:
    decoder = ByteTokenizer().new_decoder()
    assert decoder.push([0xFF, ord("a"), BYTE_EOS_ID]) == "\ufffda"
    assert decoder.push([0xE2]) == ""
    assert decoder.flush() == "\ufffd"


def test_sim_chat_template_ends_with_an_open_assistant_turn() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.apply_chat_template([ChatMessage("user", "hi")])
    assert bytes(ids).decode() == "<|user|>\nhi\n<|assistant|>\n"


def test_stop_string_split_across_deliveries_is_never_released() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abcST", final=False) == ("ab", False)
    assert matcher.feed("O", final=False) == ("c", False)
    assert matcher.feed("Pxyz", final=False) == ("", True)


def test_held_back_text_is_released_at_the_end() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abcST", final=False) == ("ab", False)
    assert matcher.feed("", final=True) == ("cST", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    assert StopMatcher(["zz", "b"]).feed("abzz", final=True) == ("a", True)


def test_serve_with_torch_executor_fails_clearly_when_it_is_not_importable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "hybridserve.executor.torch", None)
    result = CliRunner().invoke(app, ["serve", "--executor", "torch"])
    assert result.exit_code == 2
    assert "hybridserve.executor.torch" in result.output
    assert "--executor sim" in result.output


def test_serve_rejects_an_unknown_model_profile() -> None:
    result = CliRunner().invoke(app, ["serve", "--model-profile", "no-such-model"])
    assert result.exit_code == 2
    assert "no-such-model" in result.output


def test_deliveries_waiting_behind_the_first_are_sent_as_one_up_to_the_last() -> None:
    import asyncio

    from hybridserve.server.async_engine import Delivery
    from hybridserve.server.generation import _coalesce

    queue: asyncio.Queue[Delivery] = asyncio.Queue()
    for delivery in (Delivery((2,), False), Delivery((3, 4), True, "length"), Delivery((9,), True)):
        queue.put_nowait(delivery)
    merged = _coalesce(Delivery((1,), False), queue)
    assert merged == Delivery((1, 2, 3, 4), True, "length")
    assert queue.qsize() == 1  # nothing after the finishing delivery is taken
    alone = Delivery((5,), False)
    assert _coalesce(alone, asyncio.Queue()) is alone


def test_offset_decoder_releases_what_each_token_adds_in_context() -> None:
    words = ["the", "cat", "sat", "\ufffd"]
    decoded: list[int] = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return " ".join(words[i] for i in ids)

    decoder = OffsetDecoder(decode)
    assert decoder.push([0]) == "the"
    assert decoder.push([1]) == " cat"  # the join sees its left neighbour
    assert decoder.push([3]) == ""  # ends in U+FFFD: held back
    assert decoder.push([2]) == " \ufffd sat"
    assert decoder.push([]) == ""
    assert decoder.flush() == ""
    assert max(decoded) <= 3  # a window, never the whole output


def test_offset_decoder_flushes_an_incomplete_character_at_the_end() -> None:
    decoder = OffsetDecoder(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert decoder.push([0x61, 0xE2, 0x82]) == ""
    assert decoder.flush() == "a\ufffd"


def _pieces_of(deliveries: list[Any], stops: list[str]) -> list[tuple[str, int]]:
    """(text, output tokens so far) of each piece `generate` yields for these deliveries."""
    import asyncio
    from types import SimpleNamespace

    from hybridserve.core.request import Request, SamplingParams
    from hybridserve.server.async_engine import RequestStream
    from hybridserve.server.generation import generate

    class Http:
        async def receive(self) -> dict[str, str]:
            await asyncio.Event().wait()  # the client never hangs up
            return {"type": "http.disconnect"}

    async def collect() -> list[tuple[str, int]]:
        stream = RequestStream("r")

        async def feed() -> None:  # one step's delivery at a time, as the engine posts them
            for delivery in deliveries:
                stream.queue.put_nowait(delivery)
                while not stream.queue.empty():
                    await asyncio.sleep(0.001)

        feeder = asyncio.create_task(feed())
        metrics = SimpleNamespace(
            on_first_token=lambda s: None, on_gap=lambda s: None, on_finished=lambda **k: None
        )
        engine = SimpleNamespace(now=lambda: 0.0, abort=lambda req_id: None)
        request = Request(req_id="r", prompt_token_ids=(1,), sampling=SamplingParams(max_tokens=9))
        pieces = generate(
            engine=engine, metrics=metrics, tokenizer=ByteTokenizer(), request=request,
            stream=stream, stops=stops, http=Http(),
        )  # type: ignore[arg-type]  # fmt: skip
        out = [(p.text, p.num_output_tokens) async for p in pieces]
        await feeder
        return out

    return asyncio.run(collect())


def test_every_delivered_token_gets_a_piece_even_when_its_text_is_held_back() -> None:
    """A client times each token from its own event (as vLLM streams: a chunk per step that
    produced a token, its text possibly empty). A token whose text the decoder holds (a split
    UTF-8 character) or the stop matcher holds (a stop string's possible start) still gets a
    piece, so a stream of byte tokens does not arrive every other step."""
    from hybridserve.server.async_engine import Delivery

    euro = [Delivery((b,), False) for b in "€".encode()]
    assert _pieces_of([*euro, Delivery((ord("a"),), True, "length")], []) == [
        ("", 1), ("", 2), ("€", 3), ("a", 4),
    ]  # fmt: skip
    held = [Delivery((ord(c),), False) for c in "xS"] + [Delivery((ord("T"),), True, "length")]
    assert _pieces_of(held, ["STOP"]) == [("", 1), ("", 2), ("xST", 3)]
    # No piece for a delivery without tokens or text (the admission's cached-token count).
    admitted = [Delivery((), False, num_cached_tokens=0), Delivery((ord("b"),), True, "length")]
    assert _pieces_of(admitted, []) == [("b", 1)]
