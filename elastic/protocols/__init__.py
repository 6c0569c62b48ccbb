"""The types ``elastic/models/`` and ``elastic/parallel/`` share, below both (as torchtitan's
``protocols/``): models build them, the engine and the memory model read them, and neither
package imports the other for them.

* ``model_spec.py`` ``ModelSpec``: everything the engine needs to know about a model, and ``lm_loss``
* ``hf_adapter.py`` ``HFAdapter``: a model's mapping to a Hugging Face directory (torch-free)
* ``memory.py``     the memory model's inputs: ``MemoryInputs``, ``LayerActivations``,
  ``ExtraTerms``, ``StageContext``, ``ExpertMemory`` (torch-free)

This file imports nothing: the driver reads the torch-free modules without torch.
"""
