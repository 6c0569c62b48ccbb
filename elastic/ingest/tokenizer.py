"""Tokenizers for ``elastic prepare``, all built with the Hugging Face ``tokenizers`` library.

- ``byte``: raw bytes (ids 0-255, byte-level, no merges) plus an end-of-text token (256);
- ``bpe:N``: a byte-level BPE of N tokens trained on the input (end-of-text included);
- a path to a ``tokenizer.json``: loaded as is; its end-of-text token is the first of
  ``END_OF_TEXT_NAMES`` it knows.

Nothing is downloaded. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from elastic.errors import SpecError

EOT = "<|endoftext|>"
END_OF_TEXT_NAMES = (EOT, "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "byte", "bpe" or "file"
    vocab_size: int = 0  # for bpe
    path: str = ""  # for file


def parse_tokenizer(text: str) -> TokenizerSpec:
    """``byte``, ``bpe:N`` or a path; bad input raises ``SpecError('--tokenizer', ...)``."""
    if text == "byte":
        return TokenizerSpec("byte")
    if text.startswith("bpe:"):
        try:
            n = int(text[4:])
        except ValueError:
            raise SpecError("--tokenizer", f"bpe:N needs an integer vocabulary size, got {text!r}") from None
        if n < 257 + 1:
            raise SpecError("--tokenizer", f"bpe:{n} is too small: a byte-level BPE needs at least 258 tokens")
        return TokenizerSpec("bpe", vocab_size=n)
    if not os.path.isfile(text):
        raise SpecError("--tokenizer", f"{text} is not 'byte', 'bpe:N' or a readable tokenizer.json file")
    return TokenizerSpec("file", path=text)


def _byte_level():
    from tokenizers import decoders, pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), decoders.ByteLevel()


def byte_tokenizer():
    """Raw bytes as a ``tokenizers.Tokenizer``: byte b -> id b, end-of-text -> 256."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; order the vocabulary by the byte value.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = _byte_level()
    tok.add_special_tokens([EOT])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table that byte-level BPE uses (GPT-2's)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on ``texts`` (in their order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = _byte_level()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_file(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is bad input
        raise SpecError(
            "--tokenizer", f"{path} is not a readable tokenizer.json: {str(exc).splitlines()[0][:200]}"
        ) from None


def eot_id(tok) -> int:
    for name in END_OF_TEXT_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise SpecError("--tokenizer", f"the tokenizer has no end-of-text token (one of {', '.join(END_OF_TEXT_NAMES)})")


def describe(tok, kind: str) -> dict:
    """What the corpus index records about the tokenizer."""
    text = tok.to_str()
    return {
        "kind": kind,
        "vocab_size": int(tok.get_vocab_size(with_added_tokens=True)),
        "eot_id": eot_id(tok),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
