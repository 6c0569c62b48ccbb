"""Compatibility names: the reference GPT now lives in ``elastic/models/gpt.py``."""

from elastic.models.gpt import GPT, ModelConfig, build_model, flops_per_token, lm_loss

__all__ = ["GPT", "ModelConfig", "build_model", "flops_per_token", "lm_loss"]
