"""lm-evaluation-harness's loglikelihood (multiple-choice) requests against the torch server
give the scores transformers computes on the same checkpoint.

The client below sends exactly what lm-eval's `local-completions` model sends for a
loglikelihood request (`LocalCompletionsAPI._create_payload` with `generate=False`: batched
token-id prompts of context + continuation, `echo`, `logprobs: 1`, `max_tokens: 1`,
`temperature: 0`, `seed: 1234`) and reads the answer as its `parse_logprobs` does: the sum of
`token_logprobs[ctxlen:-1]` and whether each of those tokens is the most likely one. The
reference is the direct computation `--model hf` makes: log-softmax of the checkpoint's logits
over context + continuation in transformers. Runs on a tiny random Llama (always) and on the
built-in SmolLM2-135M GGUF (skipped when `models/smollm2` is absent).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch executor needs the torch extra")
pytest.importorskip("transformers", reason="the reference model comes from transformers")

from hybridserve.cli.serve_commands import build_app  # noqa: E402
from hybridserve.server.app import ServerSettings  # noqa: E402
from tests.e2e.conftest import LiveServer, serve_in_thread  # noqa: E402

Request = tuple[list[int], list[int]]  # (context tokens, continuation tokens)

# A small multiple-choice task: (context, choices, index of the right one).
TASK = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Two plus two equals", [" five", " four", " twenty-two"], 1),
    ("The opposite of hot is", [" loud", " blue", " cold"], 2),
    ("Bees make", [" honey", " milk", " silk"], 0),
    ("The sun rises in the", [" west", " east", " north"], 1),
    ("The largest planet in the solar system is", [" Mars", " Venus", " Jupiter"], 2),
    ("Ice is frozen", [" water", " sand", " light"], 0),
    ("A week has seven", [" years", " days", " metres"], 1),
]


def lm_eval_loglikelihood(
    server: LiveServer, model: str, requests: Sequence[Request], batch_size: int
) -> list[tuple[float, bool]]:
    """(loglikelihood of the continuation, is it the greedy continuation), as lm-eval's
    local-completions model computes them from the server's answers."""
    out: list[tuple[float, bool]] = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start : start + batch_size]
        payload = {
            "model": model,
            "prompt": [ctx + cont for ctx, cont in chunk],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        response = server.client.post(server.api_url + "/completions", json=payload, timeout=120)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=itemgetter("index"))
        for choice, (ctx, _) in zip(choices, chunk, strict=True):
            ctxlen = len(ctx)
            token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            greedy = all(
                lp == max(top.values())
                for lp, top in zip(token_logprobs, top_logprobs, strict=True)
            )
            out.append((sum(token_logprobs), greedy))
    return out


def transformers_loglikelihood(model: Any, requests: Sequence[Request]) -> list[tuple[float, bool]]:
    out = []
    with torch.no_grad():
        for ctx, cont in requests:
            tokens = ctx + cont
            ids = torch.tensor([tokens])
            positions = torch.arange(len(tokens))[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            rows = logprobs[len(ctx) - 1 : len(tokens) - 1]
            target = torch.tensor(cont)
            total = float(rows.gather(1, target[:, None]).sum())
            greedy = bool((rows.argmax(dim=-1) == target).all())
            out.append((total, greedy))
    return out


def task_requests(encode: Any) -> tuple[list[Request], list[tuple[int, int, int]]]:
    """lm-eval's split of each (context, choice): the context's tokens, and the tokens the
    choice adds to them; and per question (first request, number of choices, right one)."""
    requests, questions = [], []
    for context, choices, gold in TASK:
        questions.append((len(requests), len(choices), gold))
        ctx = encode(context)
        for choice in choices:
            whole = encode(context + choice)
            requests.append((ctx, whole[len(ctx) :]))
    return requests, questions


def accuracy(scores: Sequence[tuple[float, bool]], questions: Sequence[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    right = 0
    for first, count, gold in questions:
        lls = [scores[first + i][0] for i in range(count)]
        right += lls.index(max(lls)) == gold
    return right / len(questions)


def _check(server: LiveServer, reference: Any, encode: Any, batch_size: int) -> None:
    requests, questions = task_requests(encode)
    assert all(cont for _, cont in requests)
    want = transformers_loglikelihood(reference, requests)
    got = lm_eval_loglikelihood(server, server.state.model_name, requests, batch_size)
    for (ll, greedy), (want_ll, want_greedy) in zip(got, want, strict=True):
        assert ll == pytest.approx(want_ll, abs=2e-3)
        assert greedy == want_greedy
    assert accuracy(got, questions) == accuracy(want, questions)
    server.wait_idle()
    server.state.parts.cache.check_invariants()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any, Any]]:
    from hybridserve.server.torch_backend import TorchServingBackend
    from tests.e2e.test_torch_server import _write_checkpoint

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("loglikelihood-llama")
    reference, tok = _write_checkpoint(folder)
    backend = TorchServingBackend(str(folder), device="cpu", max_model_len=256)
    # Small steps: prompts are prefilled over several chunks, batched with each other.
    app = build_app(
        backend, ServerSettings(), preset_name="baseline", overrides={"max_num_batched_tokens": 8}
    )
    server = serve_in_thread(app)
    yield server, reference, tok
    server.stop()


def _tiny_encode(tok: Any) -> Any:
    """The tiny tokenizer knows a few words: each word of the task stands for one of them, in
    order of first use (so a question's choices differ)."""
    from tests.e2e.test_torch_server import WORDS

    order: dict[str, str] = {}
    for context, choices, _ in TASK:
        for word in " ".join([context, *choices]).split():
            order.setdefault(word, WORDS[len(order) % len(WORDS)])

    def encode(text: str) -> list[int]:
        return list(tok.encode(" ".join(order[w] for w in text.split())).ids)

    return encode


@pytest.mark.parametrize("batch_size", [1, 4])
def test_tiny_llama_loglikelihood_scores_equal_transformers(
    tiny: tuple[LiveServer, Any, Any], batch_size: int
) -> None:
    server, reference, tok = tiny
    _check(server, reference, _tiny_encode(tok), batch_size)


def test_repeated_contexts_are_scored_from_their_own_forward_pass(
    tiny: tuple[LiveServer, Any, Any],
) -> None:
    server, reference, tok = tiny
    ctx = list(tok.encode("the cat sat on the mat and then the dog ran to the park").ids)
    requests = [(ctx, [5, 6]), (ctx, [7, 8]), (ctx, [5, 6])]
    # The context is cached after the first; a cache hit would leave prompt positions unscored.
    first = lm_eval_loglikelihood(server, server.state.model_name, requests[:1], 1)
    rest = lm_eval_loglikelihood(server, server.state.model_name, requests[1:], 2)
    want = transformers_loglikelihood(reference, requests)
    for (ll, _), (want_ll, _) in zip([*first, *rest], want, strict=True):
        assert ll == pytest.approx(want_ll, abs=2e-3)


def test_echo_with_max_tokens_zero_scores_the_prompt_only(
    tiny: tuple[LiveServer, Any, Any],
) -> None:
    server, reference, tok = tiny
    ids = list(tok.encode("the dog ran to the park").ids)
    body = {
        "model": server.state.model_name,
        "prompt": ids,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 2,
    }
    result = server.client.post(server.api_url + "/completions", json=body, timeout=60).json()
    choice = result["choices"][0]
    logprobs = choice["logprobs"]
    assert result["usage"]["completion_tokens"] == 0
    assert len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ((want_ll, _),) = transformers_loglikelihood(reference, [(ids[:1], ids[1:])])
    assert sum(logprobs["token_logprobs"][1:]) == pytest.approx(want_ll, abs=2e-3)
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True)


def _smollm2() -> Path:
    from hybridserve.executor.torch.checkpoints import builtin_path

    path = builtin_path("smollm2")
    if not path.is_file():
        pytest.skip(f"{path} is absent (`make models` fetches the built-in SmolLM2 GGUF)")
    return path


@pytest.mark.timeout(900)
def test_smollm2_multiple_choice_scores_equal_transformers() -> None:
    path = _smollm2()
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    pytest.importorskip("gguf", reason="transformers reads GGUF with the gguf package")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridserve.server.torch_backend import TorchServingBackend

    torch.set_num_threads(1)
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    from hybridserve.executor.torch.checkpoints import resolve_model

    backend = TorchServingBackend(
        resolve_model("smollm2"), name="smollm2", device="cpu", max_model_len=512
    )
    server = serve_in_thread(build_app(backend, ServerSettings(), preset_name="baseline"))
    try:

        def encode(text: str) -> list[int]:
            return list(hf_tokenizer(text, add_special_tokens=False)["input_ids"])

        _check(server, reference, encode, batch_size=6)
        requests, questions = task_requests(encode)
        scores = lm_eval_loglikelihood(server, "smollm2", requests, 6)
        assert accuracy(scores, questions) >= 0.75  # a real model gets most of them right
    finally:
        server.stop()
