"""What an export ships beside the weights: ``generation_config.json`` and the tokenizer.

A Hugging Face model is used with its tokenizer and its generation defaults, neither of which
the project trains. ``elastic ckpt export --format hf`` takes them from the directory the run
began from (``model.init_from``, as its checkpoint records it): that directory's
``generation_config.json`` (its sampling defaults and stop ids), with ``bos_token_id`` and
``eos_token_id`` filled in from the exported ``config.json`` where it has none, and every
tokenizer file it holds, copied byte for byte. A run without ``init_from`` (or whose
directory is gone) gets a ``generation_config.json`` with the config's ids (null when it has
none) and no tokenizer. Works on any fsspec URI, both sides.
"""

from __future__ import annotations

import json
from typing import Any

from elastic.models.hf import join, open_fs

GENERATION = "generation_config.json"
# Every file a transformers tokenizer of the families here may be saved as.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def ship_beside(fs: Any, root: str, init_from: str | None, config: dict[str, Any]) -> list[str]:
    """Write ``generation_config.json`` and copy ``init_from``'s tokenizer files into ``root``
    (on ``fs``); returns the names written."""
    source = _source(init_from)
    generation: dict[str, Any] = {}
    if source is not None and source[0].exists(join(source[1], GENERATION)):
        generation = json.loads(source[0].cat_file(join(source[1], GENERATION)))
    for key in ("bos_token_id", "eos_token_id"):
        if generation.get(key) is None:
            generation[key] = config.get(key)
    with fs.open(join(root, GENERATION), "wb") as f:
        f.write((json.dumps(generation, indent=2) + "\n").encode())
    written = [GENERATION]
    if source is None:
        return written
    src_fs, src_root = source
    for name in TOKENIZER_FILES:
        path = join(src_root, name)
        if src_fs.exists(path):
            with fs.open(join(root, name), "wb") as f:
                f.write(src_fs.cat_file(path))
            written.append(name)
    return written


def _source(init_from: str | None) -> tuple[Any, str] | None:
    """The file system and path of ``init_from``, if it is still a directory."""
    if not init_from:
        return None
    try:
        src_fs, path = open_fs(init_from)
        return (src_fs, path) if src_fs.isdir(path) else None
    except (OSError, ValueError):
        return None
