"""The built-in character tokenizer: one token per character, fixed special ids."""

from __future__ import annotations

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

    def decode(self, ids: list[int]) -> str:
        if self.eos_token_id is not None and self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self._tok.decode(ids, skip_special_tokens=True)


def encode_prompt(tokenizer: CharTokenizer | HFTokenizerAdapter, text: str, task: str) -> list[int]:
    """A prompt's ids as the engine feeds them: the BOS id (when the tokenizer has one), then
    the text's tokens; an unencodable prompt is an EngineError naming the task."""
    from grpod.engine.errors import EngineError

    try:
        ids = tokenizer.encode(text)
    except ValueError as exc:
        raise EngineError(f"task {task}: prompt {text[:40]!r}: {exc}") from None
    bos = tokenizer.bos_token_id
    return ids if bos is None else [bos, *ids]
