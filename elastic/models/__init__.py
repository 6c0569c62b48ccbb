"""Models the engine trains, each described by a ``ModelSpec`` (see docs/models.md).

* ``spec.py``    ``ModelSpec``, the registry (``model_spec(cfg)``), seeded init helpers
* ``config.py``  the ``model`` section of a job spec per kind (torch-free), named sizes
* ``gpt.py``     ``kind: gpt``, the reference GPT
* ``llama.py``   ``kind: llama``, Llama 3 family (RMSNorm, RoPE, SwiGLU, GQA)
* ``moe.py``     ``model.moe`` on a Llama: routed mixture-of-experts blocks (a variant of the kind)
* ``llama_sizes.py`` the named Llama shapes (``model.size``)
* ``rope_scaling.py`` ``model.rope_scaling`` (Llama 3.1)
* ``hf.py``      Hugging Face ``config.json`` and tensor names (``model.init_from``, export)
* ``hf_families.py`` what each Hugging Face family (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe) means
* ``custom.py``  ``kind: custom``, a user's ``package.module:function`` factory

The model list is here, as in torchtitan's ``models/__init__.py``: each model module
registers its ``kind`` with ``spec.register_model`` when imported, and Python runs this file
before any module of the package, so ``model_spec`` always finds every kind while
``spec.py`` imports no model (no import circle). A new built-in model is one more line below.
"""

from elastic.models import custom, gpt, llama, moe  # noqa: F401  (each registers its kind or variant)
from elastic.models.config import AnyModelConfig, CustomConfig, GPTConfig, LlamaConfig
from elastic.models.spec import ModelSpec, model_spec

__all__ = ["AnyModelConfig", "CustomConfig", "GPTConfig", "LlamaConfig", "ModelSpec", "model_spec"]
