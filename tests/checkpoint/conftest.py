"""Fixtures of the checkpoint tests' own."""

from __future__ import annotations

import pytest
from hf_testlib import save_hf


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random Llamas saved by ``transformers``' ``save_pretrained``, by kind."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_hf(str(root / kind), kind) for kind in ("llama3", "llama31", "llama32")}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random Qwen2, Qwen3, Mistral, Mixtral and Qwen3-MoE models (with a tokenizer) by name."""
    from hf_testlib import FAMILIES, save_family

    root = tmp_path_factory.mktemp("families")
    return {name: save_family(str(root / name), name) for name in FAMILIES}
