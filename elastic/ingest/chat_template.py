"""A conversation through a tokenizer's own chat template: its token ids and which of them are
the assistant's (``elastic prepare --format chat``, docs/data.md "Chat data").

The tokenizer is a Hugging Face tokenizer directory (``transformers.AutoTokenizer``, loaded
from local files only: nothing is downloaded) whose ``chat_template`` renders the whole
conversation as text; the ids are that text tokenized without added special tokens, which
is what ``apply_chat_template(..., tokenize=True)`` returns.

The assistant's characters are found in one of two ways:

- a template with ``{% generation %}`` blocks marks them itself: ``transformers`` returns
  the tokens as ``assistant_masks`` (``apply_chat_template(return_assistant_tokens_mask=True)``);
- any other template is rendered prefix by prefix: assistant message ``k`` spans from the
  end of messages ``0..k-1`` rendered with the generation prompt (``add_generation_prompt``:
  the template's own header of an assistant turn) to the end of messages ``0..k`` rendered
  without it, so its content and what the template closes the turn with (an end-of-turn
  token, which the model must learn to emit). Each rendering must begin the next one; a
  template that renders a prefix differently (one that drops earlier turns' reasoning, say)
  is refused, naming ``--tokenizer``, rather than guessed at.

A token is the assistant's when its characters overlap an assistant span (the rule
``transformers`` applies to ``{% generation %}`` spans). Runs where ``elastic prepare`` runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic.errors import SpecError

GENERATION_TAG = "{% generation %}"


@dataclass(frozen=True)
class RenderedChat:
    """One conversation: ``ids`` (int32) and ``assistant`` (int8, 1 on the assistant's tokens)."""

    ids: np.ndarray
    assistant: np.ndarray
    text: str


class ChatTemplate:
    """A tokenizer directory's chat template, applied to one conversation at a time."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise SpecError("--tokenizer", f"{directory} is not a directory (--format chat takes a tokenizer's)")
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any load failure is bad input
            reason = " ".join(str(exc).split())[:200]
            raise SpecError("--tokenizer", f"{directory} is not a loadable tokenizer: {reason}") from None
        if not getattr(self.tok, "is_fast", False):
            raise SpecError("--tokenizer", f"{directory}: a fast tokenizer (tokenizer.json) is needed for offsets")
        template = getattr(self.tok, "chat_template", None)
        if not template:
            raise SpecError("--tokenizer", f"{directory} has no chat template (chat_template in tokenizer_config.json)")
        self.directory = directory
        self.template: str = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        self.marks_generation = GENERATION_TAG in self.template.replace("{%-", "{%").replace(" -%}", " %}")

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def render(self, messages: list[dict[str, Any]], where: str) -> RenderedChat:
        """``messages`` rendered and tokenized; ``SpecError`` naming ``messages`` when the
        template rejects them (a role it does not know, turns out of order)."""
        text = self._text(messages, False, where)
        if self.marks_generation:
            try:
                out: Any = self.tok.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
            except Exception as exc:  # noqa: BLE001 - the template's own refusal or a render error
                raise _rejected(exc, where) from None
            ids, mask = out["input_ids"], out["assistant_masks"]
            return RenderedChat(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8), text)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        return RenderedChat(ids, overlap_mask(enc["offset_mapping"], self.prefix_spans(messages, where)), text)

    def prefix_spans(self, messages: list[dict[str, Any]], where: str) -> list[tuple[int, int]]:
        """The assistant messages' character spans, from renderings of each prefix (module docstring)."""
        full = self._text(messages, False, where)
        spans = []
        for k, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            start_text = self._text(messages[:k], True, where) if k else ""
            end_text = self._text(messages[: k + 1], False, where)
            if not (full.startswith(end_text) and end_text.startswith(start_text)):
                raise SpecError(
                    "--tokenizer",
                    f"{where}: the chat template renders messages 0..{k} differently from the start of the whole "
                    "conversation, so the assistant's tokens cannot be told; use a template with "
                    "{% generation %} blocks",
                )
            spans.append((len(start_text), len(end_text)))
        return spans

    def _text(self, messages: list[dict[str, Any]], generation_prompt: bool, where: str) -> str:
        try:
            out = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - the template's own refusal (raise_exception) or a render error
            raise _rejected(exc, where) from None
        return str(out)


def _rejected(exc: BaseException, where: str) -> SpecError:
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    return SpecError("messages", f"{where}: the chat template rejects the conversation: {reason}")


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """int8 per token: 1 where its characters ``[start, end)`` overlap one of ``spans`` (both in order)."""
    mask = np.zeros(len(offsets), dtype=np.int8)
    s = 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[i] = 1
    return mask
