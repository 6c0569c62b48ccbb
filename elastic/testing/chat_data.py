"""Chat data made locally for the tests and benchmarks of ``elastic prepare --format chat``: a
tiny Hugging Face tokenizer directory with a ChatML chat template (nothing downloaded), and
conversations of chosen lengths. Runs in the test or benchmark process.

The tokenizer is byte-level with no merges (one token per byte of text, ids 0-255) plus the
special tokens ``<|endoftext|>`` (256, padding), ``<|im_start|>`` (257) and ``<|im_end|>`` (258,
end of a turn), so a rendering decodes back to exactly its text. Its template is ChatML,
Qwen2's format, and raises on a role other than ``system``, ``user`` and ``assistant``;
``generation=True`` wraps each assistant turn in ``{% generation %}`` blocks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from elastic.ingest import tokenizer as toks

SPECIALS = ("<|im_start|>", "<|im_end|>")
VOCAB = 259

_TURN = "'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'"
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ " + _TURN + " }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ " + _TURN + " }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_chat_tokenizer(directory: str, generation: bool = False, template: str | None = "") -> str:
    """The tokenizer (module docstring) saved with ``save_pretrained`` in ``directory``;
    ``template=None`` saves it without a chat template."""
    from transformers import PreTrainedTokenizerFast

    backend = toks.byte_tokenizer()
    backend.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token=toks.EOT)
    if template is not None:
        tok.chat_template = template or (CHATML_GENERATION if generation else CHATML)
    tok.save_pretrained(directory)
    return directory


def conversation(rng: np.random.Generator, turns: int, lengths: list[int], system: bool = False) -> dict[str, Any]:
    """``{"messages": [...]}``: an optional system turn, then ``turns`` user/assistant pairs;
    message ``i``'s content is ``lengths[i]`` printable ASCII characters (one token each)."""
    roles = (["system"] if system else []) + ["user", "assistant"] * turns
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz .,?!0123456789", dtype=np.uint8)
    messages = []
    for role, n in zip(roles, lengths):
        messages.append({"role": role, "content": rng.choice(letters, size=max(1, int(n))).tobytes().decode()})
    return {"messages": messages}


def write_chat_jsonl(path: str, records: list[dict[str, Any]]) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
