"""Hugging Face model directories and the project's models: config.json and tensor names.

Torch-free at import. It runs on the driver when a spec is validated (``model.init_from``: only
``config.json`` is read, before Ray starts), on every rank that loads Hugging Face weights
(``elastic/checkpoint/hf_import.py``) and in ``elastic ckpt export --format hf``
(``elastic/checkpoint/export.py``).

A model that can travel to and from Hugging Face describes itself with an ``HFAdapter``
(``ModelSpec.hf``): the ``config.json`` it exports, the Hugging Face name of each of its
tensors, and which tensors hold rotary query/key rows. The project's Llama rotates
interleaved pairs ``(x[2i], x[2i+1])`` of each head (Meta's layout); ``transformers`` rotates
the two halves ``(x[i], x[i + d/2])``. The same model in both layouts differs only by a
permutation of the rows of ``wq`` and ``wk`` inside each head, applied on load and reversed
on export.

Both config.json styles are read: ``rope_parameters`` (transformers 5) and the older
top-level ``rope_theta`` with ``rope_scaling``; an export writes both, so transformers 4 and
5 read it alike.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Protocol

from elastic.errors import SpecError
from elastic.protocols.hf_adapter import HFAdapter

if TYPE_CHECKING:
    from elastic.models.rope_scaling import RopeScaling
    from elastic.protocols.model_spec import ModelSpec


# What this module reads (and, reading config.json, sets) of a model config: the configs
# (``elastic/models/config.py``) call it to check ``model.init_from``, so it names their
# shape here rather than importing them back.
class LlamaShape(Protocol):
    """A Llama's config (``elastic.models.config.LlamaConfig``)."""

    init_from: str | None
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    norm_eps: float
    tie_embeddings: bool
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_seq_len: int | None

    @property
    def model_fields_set(self) -> set[str]: ...  # the fields the spec gave (pydantic)

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def hidden_dim(self) -> int: ...


class FactoryShape(Protocol):
    """A user's model config (``elastic.models.config.CustomConfig``)."""

    init_from: str | None
    factory: str


CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FIELD = "model.init_from"


# ----- reading a directory ------------------------------------------------------------------


def resolve(uri: str) -> str:
    """A local path made absolute (workers may start elsewhere); URIs unchanged."""
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def open_fs(uri: str) -> tuple[Any, str]:
    """The fsspec file system and path of ``uri`` (S3 credentials from the AWS variables)."""
    from fsspec.core import url_to_fs

    return url_to_fs(uri)


def read_json(uri: str) -> Any:
    fs, path = open_fs(uri)
    with fs.open(path, "rb") as f:
        return json.loads(f.read())


def read_hf_config(uri: str) -> dict[str, Any]:
    """``config.json`` of the directory ``uri``; any failure is bad input naming ``model.init_from``."""
    try:
        doc = read_json(join(uri, CONFIG))
    except FileNotFoundError:
        raise SpecError(FIELD, f"no {CONFIG} in {_shown(uri)}") from None
    except (OSError, ValueError) as exc:
        raise SpecError(FIELD, f"cannot read {CONFIG} in {_shown(uri)}: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise SpecError(FIELD, f"{CONFIG} in {_shown(uri)} is not a JSON object")
    _check_weights_listed(uri)
    return doc


def _check_weights_listed(uri: str) -> None:
    """The directory lists safetensors weights (a listing, nothing is read)."""
    try:
        fs, path = open_fs(uri)
        found = fs.exists(join(path, INDEX)) or fs.exists(join(path, SINGLE)) or fs.glob(join(path, "*.safetensors"))
    except OSError as exc:
        raise SpecError(FIELD, f"cannot list {_shown(uri)}: {type(exc).__name__}: {exc}") from None
    if not found:
        raise SpecError(FIELD, f"no *.safetensors weights in {_shown(uri)} (.bin weights are not read)")


def _shown(uri: str) -> str:
    from storage import redact_uri

    return redact_uri(uri)


# ----- Llama: config.json <-> LlamaConfig ---------------------------------------------------------

_SHAPE = {  # LlamaConfig field -> config.json key
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama_fields_from_hf(doc: dict[str, Any]) -> dict[str, Any]:
    """LlamaConfig fields from a Hugging Face Llama ``config.json``; refuses what the model lacks."""
    kind = doc.get("model_type", "llama")
    if kind != "llama":
        raise SpecError(FIELD, f"config.json model_type is {kind!r}; only Hugging Face Llama models load")
    if doc.get("hidden_act", "silu") != "silu":
        raise SpecError(FIELD, f"config.json hidden_act is {doc['hidden_act']!r}; the Llama here uses silu")
    for key in ("attention_bias", "mlp_bias"):
        if doc.get(key):
            raise SpecError(FIELD, f"config.json sets {key}: the Llama here has no biases")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise SpecError(FIELD, f"config.json lacks {', '.join(missing)}")
    fields: dict[str, Any] = {name: doc[key] for name, key in _SHAPE.items() if key in doc}
    fields.setdefault("norm_eps", 1e-6)  # transformers' LlamaConfig default
    fields.setdefault("tie_embeddings", False)
    head_dim = doc.get("head_dim")
    if head_dim is not None and head_dim * doc["num_attention_heads"] != doc["hidden_size"]:
        raise SpecError(FIELD, f"config.json head_dim {head_dim} is not hidden_size / num_attention_heads")
    fields["n_kv_heads"] = doc.get("num_key_value_heads") or doc["num_attention_heads"]
    fields["ffn_dim"] = doc["intermediate_size"]
    fields["max_seq_len"] = doc.get("max_position_embeddings")
    fields["rope_theta"], fields["rope_scaling"] = _rope_from_hf(doc)
    return fields


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
    for key in _LLAMA3_KEYS:
        value = params.get(key, doc.get("max_position_embeddings") if key == _LLAMA3_KEYS[-1] else None)
        if value is None:
            raise SpecError(FIELD, f"config.json llama3 RoPE scaling lacks {key}")
        scaling[key] = value
    return theta, scaling


def apply_hf_config(cfg: LlamaShape) -> None:
    """Fill ``cfg``'s shape from ``cfg.init_from``'s config.json; a key the spec gives that
    disagrees is bad input naming that key. Reads ``config.json`` only (and lists the weights)."""
    cfg.init_from = resolve(_init_from(cfg))
    hf = llama_fields_from_hf(read_hf_config(cfg.init_from))
    given = cfg.model_fields_set
    for name in ("n_layers", "d_model", "n_heads", "vocab_size", "norm_eps", "tie_embeddings", "rope_theta"):
        if name in given and getattr(cfg, name) != hf[name]:
            raise SpecError(f"model.{name}", f"{getattr(cfg, name)} differs from {_shown(cfg.init_from)}: {hf[name]}")
    if "n_kv_heads" in given and cfg.kv_heads != hf["n_kv_heads"]:
        raise SpecError("model.n_kv_heads", f"{cfg.kv_heads} differs from config.json's {hf['n_kv_heads']}")
    if given & {"ffn_dim", "multiple_of", "ffn_dim_multiplier"} and cfg.hidden_dim != hf["ffn_dim"]:
        raise SpecError(
            "model.ffn_dim",
            f"the spec's SwiGLU hidden size {cfg.hidden_dim} differs from config.json's "
            f"intermediate_size {hf['ffn_dim']}",
        )
    if "rope_scaling" in given:
        _check_rope_scaling(cfg, hf["rope_scaling"])
    from elastic.models.rope_scaling import RopeScaling

    for name, value in hf.items():
        if name == "max_seq_len" and (value is None or "max_seq_len" in given):
            continue  # metadata, not shape: the spec's own value stands
        setattr(cfg, name, RopeScaling(**value) if name == "rope_scaling" and value else value)


def _check_rope_scaling(cfg: LlamaShape, hf: dict[str, Any] | None) -> None:
    mine = cfg.rope_scaling.model_dump() if cfg.rope_scaling is not None else None
    if mine is None or hf is None:
        if (mine is None) != (hf is None):
            raise SpecError("model.rope_scaling", f"{mine} differs from config.json's {hf}")
        return
    for key in _LLAMA3_KEYS:
        if mine[key] != hf[key]:
            raise SpecError(f"model.rope_scaling.{key}", f"{mine[key]} differs from config.json's {hf[key]}")


def llama_hf_config(cfg: LlamaShape) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a project Llama (``transformers`` ``LlamaConfig``)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **{k: getattr(cfg.rope_scaling, k) for k in _LLAMA3_KEYS}}
        rope = {**scaling, "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len or cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # The tokenizer is not part of the model: copy its files (and generation_config.json)
        # from where the weights came from; null keeps transformers' Llama 2 defaults out.
        "bos_token_id": None,
        "eos_token_id": None,
    }


def llama_adapter(cfg: LlamaShape) -> HFAdapter:
    names = {
        "tok_emb.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight",
    }
    rotary = {}
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for mine, hf in (
            ("attn_norm", "input_layernorm"),
            ("mlp_norm", "post_attention_layernorm"),
            ("attn.wq", "self_attn.q_proj"),
            ("attn.wk", "self_attn.k_proj"),
            ("attn.wv", "self_attn.v_proj"),
            ("attn.wo", "self_attn.o_proj"),
            ("mlp.w1", "mlp.gate_proj"),
            ("mlp.w3", "mlp.up_proj"),
            ("mlp.w2", "mlp.down_proj"),
        ):
            names[f"{ours}{mine}.weight"] = f"{theirs}{hf}.weight"
        rotary[f"{ours}attn.wq.weight"] = rotary[f"{ours}attn.wk.weight"] = cfg.head_dim
    optional = frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()
    return HFAdapter(config=llama_hf_config(cfg), names=names, rotary=rotary, optional=optional)


# ----- a user's model with its own adapter --------------------------------------------------------

# Keys of an adapter's config.json that say nothing of the weights' shapes or meaning (or
# that transformers 4 and 5 spell differently: rope_scaling), so they are not compared.
_NOT_SHAPE = {
    "torch_dtype",
    "dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "architectures",
    "max_position_embeddings",
    "rope_scaling",
    "use_cache",
    "initializer_range",
    "attention_dropout",
}


def _init_from(cfg: LlamaShape | FactoryShape) -> str:
    """``cfg.init_from``, which the config's ``check()`` only hands here when it is set."""
    if cfg.init_from is None:
        raise RuntimeError("model.init_from is not set: there is no Hugging Face checkpoint to read")
    return cfg.init_from


def check_custom_init_from(cfg: FactoryShape, spec: ModelSpec) -> None:
    """``kind: custom`` with ``init_from``: the factory's adapter must agree with config.json."""
    if spec.hf is None:
        raise SpecError(FIELD, f"{cfg.factory} gives no Hugging Face adapter (ModelSpec.hf), so it cannot load one")
    cfg.init_from = resolve(_init_from(cfg))
    doc = read_hf_config(cfg.init_from)
    for key, value in spec.hf.config.items():
        if key in doc and key not in _NOT_SHAPE and doc[key] != value:
            raise SpecError(FIELD, f"config.json has {key}={doc[key]!r}, the factory's model {value!r}")
