"""Models the engine trains, each described by a ``ModelSpec`` (see docs/models.md).

* ``spec.py``    ``ModelSpec``, the registry (``model_spec(cfg)``), seeded init helpers
* ``config.py``  the ``model`` section of a job spec per kind (torch-free), named sizes
* ``gpt.py``     ``kind: gpt``, the reference GPT
* ``llama.py``   ``kind: llama``, Llama 3 family (RMSNorm, RoPE, SwiGLU, GQA)
* ``llama_sizes.py`` the named Llama shapes (``model.size``)
* ``hf.py``      Hugging Face ``config.json`` and tensor names (``model.init_from``, export)
* ``custom.py``  ``kind: custom``, a user's ``package.module:function`` factory
"""

from elastic.models.config import AnyModelConfig, CustomConfig, GPTConfig, LlamaConfig

__all__ = ["AnyModelConfig", "CustomConfig", "GPTConfig", "LlamaConfig"]
