"""The built-in character tokenizer: one token per character, fixed special ids."""

from __future__ import annotations

from typing import Literal

from grpod.base.oneline import one_line
from grpod.engine.errors import EngineError

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")

ARITH_CHARS = "0123456789+="
KV_CHARS = ARITH_CHARS + "abcdefghijklmnopqrstuvwxyz:;"
PRINTABLE_CHARS = "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    """`<pad>`=0, `<bos>`=1, `<eos>`=2, then one id per character of `chars`."""

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer characters must be unique")
        self.chars = chars
        self._ids = {ch: i + len(SPECIALS) for i, ch in enumerate(chars)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = PAD, BOS, EOS

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens; unknown characters are an error."""
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer") from None

    chat_template = None  # no chat template: prompt_format = "chat" needs a HF tokenizer

    def encode_prompt(self, text: str) -> list[int]:
        """`<bos>` then the prompt's ids (this tokenizer always adds its BOS)."""
        return [BOS, *self.encode(text)]

    def decode_prompt(self, ids: list[int]) -> str:
        """A prompt's text as the model saw it (`<bos>` dropped: it is always there)."""
        return self.decode([i for i in ids if i != BOS])

    def to_hf(self):
        """The same tokenizer as a `PreTrainedTokenizerFast` (WordLevel, one token per
        character, `<bos>` prepended), for `grpod export`."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {name: i for i, name in enumerate(SPECIALS)} | self._ids
        core = Tokenizer(models.WordLevel(vocab, unk_token=None))
        core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
        core.decoder = decoders.Fuse()
        core.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", BOS)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
        )

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, stopping at the first `<eos>` and skipping `<pad>`/`<bos>`."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)


class HFTokenizerAdapter:
    """A Hugging Face tokenizer behind the same four-method surface as `CharTokenizer`."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tok, "chat_template", None)

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids with the special tokens the tokenizer itself adds (its BOS, if any)."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode_prompt(self, ids: list[int]) -> str:
        """A prompt's text as the model saw it, special tokens (chat markup) included."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def to_hf(self):
        """The wrapped Hugging Face tokenizer (for `grpod export`)."""
        return self._tok

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """`messages` through the chat template, ending with the assistant's generation prompt."""
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # the template writes the BOS text itself where it wants one
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.eos_token_id is not None and self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self._tok.decode(ids, skip_special_tokens=True)


def encode_prompt(
    tokenizer: CharTokenizer | HFTokenizerAdapter,
    text: str,
    source: str,
    prompt_format: Literal["raw", "chat"] = "raw",
    system_prompt: str = "",
) -> list[int]:
    """A prompt's ids as the engine feeds them (and preflight measures them): `raw` = the text
    with the special tokens the tokenizer itself adds (its BOS, if any); `chat` =
    `[system?, {"role": "user", "content": text}]` through the tokenizer's `chat_template`
    with the assistant's generation prompt. An unencodable prompt is an EngineError naming
    its `source` ("task arith", "eval_task held.jsonl").

    >>> encode_prompt(CharTokenizer("0123456789+="), "1+2=", "task arith")
    [1, 4, 13, 5, 14]
    """
    require_chat_template(tokenizer, prompt_format)
    try:
        if prompt_format == "chat":
            system = [{"role": "system", "content": system_prompt}] if system_prompt else []
            return tokenizer.encode_chat([*system, {"role": "user", "content": text}])
        return tokenizer.encode_prompt(text)
    except Exception as exc:  # a chat template that raises (jinja2's TemplateError, ...)
        what = "chat_template" if prompt_format == "chat" else "tokenizer"
        raise EngineError(f"{source}: prompt {text[:40]!r}: {what}: {one_line(exc)}") from None


def require_chat_template(
    tokenizer: CharTokenizer | HFTokenizerAdapter, prompt_format: str
) -> None:
    """`prompt_format = "chat"` needs a tokenizer with a `chat_template` (an EngineError)."""
    if prompt_format == "chat" and not tokenizer.chat_template:
        raise EngineError("prompt_format chat: the tokenizer has no chat_template")
