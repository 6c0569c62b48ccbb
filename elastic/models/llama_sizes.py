"""Named Llama shapes (``model.size``), torch-free: published shapes and tiny test sizes.

The published ones follow Meta's reference ``params.json`` and the Hugging Face
``config.json`` of each release (``multiple_of`` and ``ffn_dim_multiplier`` reproduce the
published SwiGLU hidden size: 14336 for 8B, 28672 for 70B, 53248 for 405B, 8192 for the
3.2 models). Llama 3.1 and 3.2 add the ``llama3`` RoPE frequency scaling and a 131072-token
context; 3.2 1B and 3B tie the output head to the embedding. ``seq_len`` is the training
sequence length (8192, the pre-training context), ``max_seq_len`` the published context.
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, seq_len=8192, max_seq_len=8192)
_LLAMA31 = dict(
    _LLAMA3,
    max_seq_len=131_072,
    rope_scaling=dict(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
)
_LLAMA32 = dict(_LLAMA31, rope_scaling=dict(_LLAMA31["rope_scaling"], factor=32.0), tie_embeddings=True)

_8B = dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024)
_70B = dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096)

LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(_8B, **_LLAMA3),
    "llama3-70b": dict(_70B, **_LLAMA3),
    "llama3.1-8b": dict(_8B, **_LLAMA31),
    "llama3.1-70b": dict(_70B, **_LLAMA31),
    "llama3.1-405b": dict(
        n_layers=126, d_model=16_384, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096, **_LLAMA31
    ),
    "llama3.2-1b": dict(
        n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256, **_LLAMA32
    ),
    "llama3.2-3b": dict(
        n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256, **_LLAMA32
    ),
    "debug": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=64, seq_len=128),
    "tiny": dict(n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, seq_len=16),
}
