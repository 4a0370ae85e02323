"""Text tokenizers for generation: `tokenizer.json` of a checkpoint folder, or one rebuilt with
`tokenizers` from a GGUF's vocabulary (byte-level BPE with merges, or sentencepiece-style BPE
whose merges are recovered from the vocabulary order)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError, HybridServeError
from hybridserve.executor.torch.gguf_file import GGUFFile

_CONTROL, _USER_DEFINED = 3, 4
# The variables the renderer itself gives a chat template (extra options cannot replace them).
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


@dataclass
class TextTokenizer:
    backend: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.backend.decode(token_ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens spelled out (for log-probability listings)."""
        return str(self.backend.decode([token_id], skip_special_tokens=False))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> str:
        """`messages` through the chat template, followed by an open assistant turn, rendered
        as transformers' `apply_chat_template` renders it: `tools` (OpenAI tool definitions)
        as the template's `tools`, `options` as further template variables (Qwen3's
        `enable_thinking`). Raises ChatTemplateError when the model has no template or the
        template rejects the conversation."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template.jinja or chat_template in "
                "tokenizer_config.json beside it); use /v1/completions with your own prompt"
            )
        import jinja2

        try:
            template = _compiled_template(self.chat_template)
            return str(
                template.render(
                    **{k: v for k, v in (options or {}).items() if k not in TEMPLATE_VARIABLES},
                    messages=[dict(m) for m in messages],
                    tools=[dict(t) for t in tools] if tools else None,
                    documents=None,
                    add_generation_prompt=True,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                )
            )
        except _TemplateRefusal as exc:
            raise ChatTemplateError(f"the chat template rejects it: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed on it: {exc}") from None

    def chat_prompt(self, user_text: str) -> str:
        """`user_text` as one user turn through the chat template, ready for the reply."""
        try:
            return self.render_chat([{"role": "user", "content": user_text}])
        except ChatTemplateError as exc:
            raise ConfigError("chat_template", None, str(exc)) from None

    def encode_prompt(self, text: str, *, chat: bool) -> list[int]:
        """One prompt's token ids: as a user turn through the chat template when `chat` and
        the model has one (no second BOS when the template writes it), else the text as is."""
        if chat and self.chat_template:
            rendered = self.chat_prompt(text)
            bos = self.bos_token
            return self.encode(rendered, add_special_tokens=not (bos and rendered.startswith(bos)))
        return self.encode(text)


class ChatTemplateError(HybridServeError):
    """A conversation cannot be rendered: no template, or the template refuses it."""


class _TemplateRefusal(Exception):
    """`raise_exception(message)` called by a chat template."""


def _refuse(message: str) -> None:
    raise _TemplateRefusal(message)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    """The template compiled in the environment transformers renders chat templates in
    (`_cached_compile_jinja_template` in transformers/utils/chat_template_utils.py): sandboxed,
    `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text,
    `raise_exception` and `strftime_now`, and `{% generation %}` blocks rendered as they are."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a mutable set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            return str(caller())

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlocks, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _refuse
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def load_tokenizer(path: Path) -> TextTokenizer | None:
    """The tokenizer of a checkpoint folder or GGUF file, or None when it has none."""
    if path.is_file():
        return gguf_tokenizer(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return TextTokenizer(
        Tokenizer.from_file(str(file)),
        checkpoint_chat_template(path, config),
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")),
    )


def checkpoint_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """A checkpoint folder's chat template, where transformers looks for it: the
    `chat_template.jinja` file (the current layout), then `tokenizer_config.json`'s
    `chat_template` (a string, or a list of named templates: the "default" one), then a
    processor's `chat_template.json`."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (path / "chat_template.json").is_file():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return str(token.get("content"))
    return token if isinstance(token, str) else None


def gguf_tokenizer(path: Path, file: GGUFFile | None = None) -> TextTokenizer:
    fields = (file or GGUFFile(path)).fields

    def value(key: str) -> Any:
        return fields.get(key)

    kind = value("tokenizer.ggml.model")
    tokens: list[str] = value("tokenizer.ggml.tokens")
    types: list[int] = value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level(tokens, value("tokenizer.ggml.merges"))
    elif kind == "llama":
        backend = _sentencepiece(tokens, bool(value("tokenizer.ggml.add_space_prefix")))
    else:
        raise ConfigError("gguf tokenizer.ggml.model", kind, "use a gpt2 or llama tokenizer")
    from tokenizers import AddedToken

    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _CONTROL
    ]
    # Space-only pieces stay with the model (the sentencepiece vocabulary spells them "▁").
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _USER_DEFINED and t.strip(" ")
    ]
    backend.add_special_tokens(specials)
    backend.add_tokens(user)
    bos_id, eos_id = value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    add_bos = value("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama"
    if add_bos and bos is not None:
        from tokenizers.processors import TemplateProcessing

        backend.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    eos = tokens[eos_id] if eos_id is not None else None
    return TextTokenizer(backend, value("tokenizer.chat_template"), bos, eos)


def _byte_level(tokens: list[str], merges: list[str] | None) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges or ())]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], add_prefix: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    # Tokens made only of spaces are stored with real spaces; the model sees "▁".
    spelled = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    backend = Tokenizer(
        models.BPE(vocab, _merges_by_rank(vocab), unk_token=None, byte_fallback=True)
    )
    steps: list[Any] = [normalizers.Replace(" ", "▁")]
    if add_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _merges_by_rank(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by the vocabulary: each token that splits into two tokens, ranked by the
    merged token's position (earlier = merged first), then by its parts' positions."""
    ranked = []
    for token, rank in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]
