"""The Hugging Face families of ``kind: llama``: ``config.json`` <-> ``LlamaConfig`` and tensor names.

Torch-free (``elastic.models.hf`` reads directories; this module knows what each family's
``config.json`` and tensors mean). Every family here is the project's Llama with switches:

============  =====================================================================
``llama``     the Llama itself
``mistral``   the Llama; its ``sliding_window`` is kept only when it spans ``seq_len``
              (attention here always spans the whole sequence, so nothing differs)
``qwen2``     biases on the q, k and v projections (``qkv_bias``)
``qwen3``     RMSNorm over each head of q and k before RoPE (``qk_norm``)
``mixtral``   ``model.moe``: softmax router, top-k weights renormalised to sum to 1
``qwen3_moe`` ``model.moe`` with ``qk_norm``; ``norm_topk_prob`` from the file
============  =====================================================================

An export writes a model back as the family it came from (``model.family``) or, for a model
trained here from scratch, the family its architecture is: ``qk_norm`` is Qwen3, ``qkv_bias``
Qwen2, a mixture of experts Mixtral (``norm_topk_prob: true``) or Qwen3-MoE (with ``qk_norm``).
What no family computes (a sigmoid router, a shared expert, top-k weights not renormalised
without q/k norms) has no Hugging Face form: the export says which key. Expert weights live
here as one ``[E, in, out]`` tensor per projection; Hugging Face keeps one ``[out, in]``
linear per expert (``HFAdapter.experts``).
"""

from __future__ import annotations

from typing import Any

from elastic.errors import SpecError
from elastic.protocols.hf_adapter import HFAdapter

FIELD = "model.init_from"  # as elastic.models.hf.FIELD (which imports this module)
LlamaConfig = Any  # elastic.models.config.LlamaConfig, which calls here: not imported back (no circle)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
MOE = ("mixtral", "qwen3_moe")
_SHAPE = {  # LlamaConfig field -> config.json key
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ----- config.json -> LlamaConfig fields ----------------------------------------------------------


def fields_from_hf(doc: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig fields (``moe`` a dict or None) from a ``config.json``; refuses what the model lacks."""
    family = doc.get("model_type", "llama")
    if family not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise SpecError(FIELD, f"config.json model_type is {family!r}; the families that load are {known}")
    if doc.get("hidden_act", "silu") != "silu":
        raise SpecError(FIELD, f"config.json hidden_act is {doc['hidden_act']!r}; the Llama here uses silu")
    for key in ("attention_bias", "mlp_bias"):  # llama and qwen3: a bias on every projection, o_proj too
        if doc.get(key):
            raise SpecError(
                FIELD, f"config.json sets {key}: {family} with biases on every projection is not implemented"
            )
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise SpecError(FIELD, f"config.json lacks {', '.join(missing)}")
    fields: dict[str, Any] = {name: doc[key] for name, key in _SHAPE.items() if key in doc}
    fields.setdefault("norm_eps", 1e-6)  # transformers' default in every family here
    fields.setdefault("tie_embeddings", False)
    head_dim = doc.get("head_dim")  # Qwen3's is its own; elsewhere hidden_size / num_attention_heads
    fields["head_dim"] = head_dim if head_dim and head_dim * doc["num_attention_heads"] != doc["hidden_size"] else None
    fields["n_kv_heads"] = doc.get("num_key_value_heads") or doc["num_attention_heads"]
    fields["ffn_dim"] = doc["intermediate_size"]
    fields["max_seq_len"] = doc.get("max_position_embeddings")
    fields["rope_theta"], fields["rope_scaling"] = _rope_from_hf(doc)
    fields["family"] = family
    fields["qkv_bias"] = family == "qwen2"
    fields["qk_norm"] = family in ("qwen3", "qwen3_moe")
    fields["sliding_window"] = _window(doc, family)
    fields["moe"] = _moe_from_hf(doc, family) if family in MOE else None
    return fields


def _window(doc: dict[str, Any], family: str) -> int | None:
    """Mistral's (Mixtral's) window over every layer; Qwen's only matters with ``use_sliding_window``."""
    layer_types = doc.get("layer_types") or []
    if family.startswith("qwen") and (doc.get("use_sliding_window") or set(layer_types) - {"full_attention"}):
        raise SpecError(
            FIELD, "config.json uses sliding-window attention on some layers (use_sliding_window): not implemented"
        )
    window = doc.get("sliding_window") if family in ("mistral", "mixtral") else None
    return int(window) if window is not None else None


def _moe_from_hf(doc: dict[str, Any], family: str) -> dict[str, Any]:
    n_experts = doc.get("num_local_experts", doc.get("num_experts"))
    if n_experts is None or "num_experts_per_tok" not in doc:
        raise SpecError(FIELD, f"config.json of a {family} lacks num_local_experts or num_experts_per_tok")
    if doc.get("router_jitter_noise"):
        raise SpecError(FIELD, "config.json sets router_jitter_noise: router jitter is not implemented")
    moe: dict[str, Any] = {"n_experts": n_experts, "top_k": doc["num_experts_per_tok"]}
    moe.update(router="softmax", shared_expert=False)
    if family == "mixtral":  # Mixtral always renormalises the top-k weights
        moe.update(expert_hidden=doc["intermediate_size"], norm_topk_prob=True)
    else:
        if doc.get("mlp_only_layers") or doc.get("decoder_sparse_step", 1) != 1:
            raise SpecError(
                FIELD,
                "config.json has dense layers among the experts (mlp_only_layers, decoder_sparse_step): "
                "not implemented",
            )
        if "moe_intermediate_size" not in doc:
            raise SpecError(FIELD, "config.json of a qwen3_moe lacks moe_intermediate_size")
        moe.update(expert_hidden=doc["moe_intermediate_size"], norm_topk_prob=bool(doc.get("norm_topk_prob", False)))
    if "router_aux_loss_coef" in doc:
        moe["aux_loss_coef"] = doc["router_aux_loss_coef"]
    return moe


def _rope_from_hf(doc: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if not isinstance(params, dict) or ("rope_type" not in params and "type" not in params and params):
        raise SpecError(FIELD, "config.json rope_parameters per layer type are not supported")
    theta = float(params.get("rope_theta", doc.get("rope_theta", 10_000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise SpecError(FIELD, f"config.json RoPE type {rope_type!r}: only default and llama3 are supported")
    scaling = {"type": "llama3"}
    for key in LLAMA3_KEYS:
        value = params.get(key, doc.get("max_position_embeddings") if key == LLAMA3_KEYS[-1] else None)
        if value is None:
            raise SpecError(FIELD, f"config.json llama3 RoPE scaling lacks {key}")
        scaling[key] = value
    return theta, scaling


# ----- which family a model is -------------------------------------------------------------------


def family_of(cfg: LlamaConfig) -> str:
    """The family an export writes: ``model.family``, else the one the architecture matches.
    A model no family computes is a ``SpecError`` naming the key that rules each out."""
    family = cfg.family or _derived(cfg)
    problem = _mismatch(cfg, family)
    if problem:
        raise SpecError(*problem)
    return family


def _derived(cfg: LlamaConfig) -> str:
    if cfg.moe is not None:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _mismatch(cfg: LlamaConfig, family: str) -> tuple[str, str] | None:
    """``(field, why)`` if ``cfg`` is not a model of ``family``, else None."""
    moe = cfg.moe
    if (moe is not None) != (family in MOE):
        return (
            "model.moe",
            f"{'set' if moe else 'not set'}, but {family} is {'a mixture of experts' if family in MOE else 'dense'}",
        )
    wants_bias, wants_norm = family == "qwen2", family in ("qwen3", "qwen3_moe")
    if cfg.qkv_bias != wants_bias:
        return "model.qkv_bias", f"{cfg.qkv_bias}, but {family} has {'' if wants_bias else 'no '}q/k/v biases"
    if cfg.qk_norm != wants_norm:
        return "model.qk_norm", f"{cfg.qk_norm}, but {family} has {'' if wants_norm else 'no '}per-head q/k norms"
    if cfg.sliding_window is not None and family not in ("mistral", "mixtral"):
        return "model.sliding_window", f"{cfg.sliding_window}, but {family} has no sliding window on every layer"
    if moe is not None:
        if moe.router != "softmax":
            return "model.moe.router", f"{moe.router}: the Hugging Face families here route with a softmax"
        if moe.shared_expert:
            return "model.moe.shared_expert", f"true: {family} has no shared expert"
        if family == "mixtral" and not moe.norm_topk_prob:
            return (
                "model.moe.norm_topk_prob",
                "false: mixtral renormalises each token's top-k weights (qwen3_moe can leave them, with model.qk_norm)",
            )
    return None


# ----- LlamaConfig -> config.json and tensor names ----------------------------------------------------


def hf_config(cfg: LlamaConfig, family: str) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as a ``family`` model (``transformers``' config class)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **{k: getattr(cfg.rope_scaling, k) for k in LLAMA3_KEYS}}
        rope = {**scaling, "rope_theta": cfg.rope_theta}
    doc: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len or cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # The token ids the init_from config.json gave (null for a model trained from scratch:
        # transformers' own defaults belong to other tokenizers).
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if family in ("llama", "qwen3", "qwen3_moe"):
        doc.update(attention_bias=False)
    if family == "llama":
        doc.update(mlp_bias=False)
    if family in ("mistral", "mixtral"):
        doc.update(sliding_window=cfg.sliding_window)
    if family.startswith("qwen"):
        layers = ["full_attention"] * cfg.n_layers
        doc.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers, layer_types=layers)
    if cfg.moe is not None:
        moe = cfg.moe
        doc.update(
            num_local_experts=moe.n_experts,
            num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_coef,
            output_router_logits=False,
        )
        if family == "mixtral":
            doc.update(intermediate_size=cfg.expert_hidden, router_jitter_noise=0.0)
        else:  # transformers 4 spells num_local_experts num_experts
            doc.update(
                num_experts=moe.n_experts, moe_intermediate_size=cfg.expert_hidden, norm_topk_prob=moe.norm_topk_prob
            )
            doc.update(decoder_sparse_step=1, mlp_only_layers=[])
    return doc


_ATTN = (("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"), ("attn.wv", "self_attn.v_proj"))
_DENSE = (("mlp.w1", "mlp.gate_proj"), ("mlp.w3", "mlp.up_proj"), ("mlp.w2", "mlp.down_proj"))
_EXPERTS = {  # family -> (router, expert prefix, names of w1, w3, w2)
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
}


def hf_adapter(cfg: LlamaConfig) -> HFAdapter | None:
    """How ``cfg``'s model maps to its Hugging Face family; None when no family computes it."""
    try:
        family = family_of(cfg)
    except SpecError:
        return None
    names = {
        "tok_emb.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight",
    }
    rotary: dict[str, int] = {}
    experts: dict[str, tuple[str, ...]] = {}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        pairs = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"), *_ATTN]
        pairs.append(("attn.wo", "self_attn.o_proj"))
        if cfg.qk_norm:
            pairs += [("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")]
        if cfg.moe is None:
            pairs += list(_DENSE)
        for mine, hf in pairs:
            names[f"{ours}{mine}.weight"] = f"{theirs}{hf}.weight"
        if cfg.qkv_bias:
            for mine, hf in _ATTN:
                names[f"{ours}{mine}.bias"] = f"{theirs}{hf}.bias"
        # Rotary rows permuted per head: q and k (their biases; a q/k norm is one head's weight).
        for fqn in (
            "attn.wq.weight",
            "attn.wk.weight",
            "attn.wq.bias",
            "attn.wk.bias",
            "attn.q_norm.weight",
            "attn.k_norm.weight",
        ):
            if f"{ours}{fqn}" in names:
                rotary[f"{ours}{fqn}"] = cfg.head_size
        if cfg.moe is not None:
            router, prefix, (w1, w3, w2) = _EXPERTS[family]
            names[f"{ours}mlp.router.weight"] = f"{theirs}{router}.weight"
            for mine, hf in (("w1", w1), ("w3", w3), ("w2", w2)):
                per_expert = tuple(f"{theirs}{prefix}.{e}.{hf}.weight" for e in range(cfg.moe.n_experts))
                experts[f"{ours}mlp.experts.{mine}"] = per_expert
    optional = frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()
    return HFAdapter(config=hf_config(cfg, family), names=names, rotary=rotary, optional=optional, experts=experts)
