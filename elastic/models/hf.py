"""Hugging Face model directories and the project's models: config.json and tensor names.

Torch-free at import. It runs on the driver when a spec is validated (``model.init_from``:
``config.json`` and the tensor names, from the index or the safetensors headers, are read
before Ray starts; what each family's config.json means is in ``hf_families.py``), on every
rank that loads Hugging Face weights (``elastic/checkpoint/hf_import.py``) and in ``elastic ckpt export --format hf``
(``elastic/checkpoint/export.py``).

A model that can travel to and from Hugging Face describes itself with an ``HFAdapter``
(``ModelSpec.hf``): the ``config.json`` it exports, the Hugging Face name of each of its
tensors, and which tensors hold rotary query/key rows. The project's Llama rotates
interleaved pairs ``(x[2i], x[2i+1])`` of each head (Meta's layout); ``transformers`` rotates
the two halves ``(x[i], x[i + d/2])``. The same model in both layouts differs only by a
permutation of the rows of ``wq`` and ``wk`` inside each head (and of their biases and
Qwen3's per-head q/k norm weights), applied on load and reversed on export.

Both config.json styles are read: ``rope_parameters`` (transformers 5) and the older
top-level ``rope_theta`` with ``rope_scaling``; an export writes both, so transformers 4 and
5 read it alike.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from elastic.errors import SpecError
from elastic.protocols.hf_adapter import HFAdapter

# The model configs (``elastic/models/config.py``) call this module to check
# ``model.init_from``, so it does not import them back (no import circle): their types are
# named here only.
LlamaConfig = Any  # elastic.models.config.LlamaConfig
CustomConfig = Any  # elastic.models.config.CustomConfig

if TYPE_CHECKING:
    from elastic.protocols.model_spec import ModelSpec

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


# ----- config.json -> the spec's model (families: elastic/models/hf_families.py) -------------------

# Given in the spec, these must equal what config.json says (the architecture); the
# metadata (max_seq_len, bos/eos ids) and moe.aux_loss_coef (training) the spec may set.
_AGREE = ("n_layers", "d_model", "n_heads", "vocab_size", "norm_eps", "tie_embeddings", "rope_theta")
_AGREE_FLAGS = ("qkv_bias", "qk_norm", "family", "sliding_window")
_MOE_AGREE = ("n_experts", "top_k", "expert_hidden", "shared_expert", "router", "norm_topk_prob")
_METADATA = ("max_seq_len", "bos_token_id", "eos_token_id")


def apply_hf_config(cfg: LlamaConfig, moe_class: Any) -> None:
    """Fill ``cfg``'s architecture from ``cfg.init_from``'s config.json; a key the spec gives that
    disagrees is bad input naming that key. Reads ``config.json`` and the safetensors headers
    (or the index): a tensor the architecture has no place for, or lacks, is refused here.
    ``moe_class``: the config's ``MoEConfig`` (passed in: this module does not import the configs)."""
    from elastic.models.hf_families import fields_from_hf, hf_adapter

    cfg.init_from = resolve(_init_from(cfg))
    hf = fields_from_hf(read_hf_config(cfg.init_from))
    given = cfg.model_fields_set
    for name in _AGREE + _AGREE_FLAGS:
        if name in given and getattr(cfg, name) != hf[name]:
            raise SpecError(f"model.{name}", f"{getattr(cfg, name)} differs from {_shown(cfg.init_from)}: {hf[name]}")
    heads = hf["head_dim"] or hf["d_model"] // hf["n_heads"]
    if "head_dim" in given and cfg.head_size != heads:
        raise SpecError("model.head_dim", f"{cfg.head_size} differs from config.json's {heads}")
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
    window = hf["sliding_window"]
    if window is not None and window < cfg.seq_len:
        raise SpecError(
            FIELD,
            f"config.json sliding_window {window} is shorter than model.seq_len {cfg.seq_len}: "
            "sliding-window attention is not implemented (train with seq_len <= the window)",
        )
    moe = _merged_moe(cfg, hf.pop("moe"), moe_class)
    from elastic.models.rope_scaling import RopeScaling

    for name, value in hf.items():
        if name in _METADATA and (value is None or name in given):
            continue  # metadata, not shape: the spec's own value stands
        setattr(cfg, name, RopeScaling(**value) if name == "rope_scaling" and value else value)
    cfg.moe = moe
    adapter = hf_adapter(cfg)
    if adapter is None:  # every family fields_from_hf returns has an adapter
        raise RuntimeError(f"model.init_from: no Hugging Face adapter for {cfg.family}")
    _check_tensor_names(cfg.init_from, adapter, cfg.family or "llama")


def _merged_moe(cfg: LlamaConfig, hf: dict[str, Any] | None, moe_class: Any) -> Any:
    """``model.moe`` from config.json; a spec's ``moe`` must agree (``aux_loss_coef`` is the spec's)."""
    mine = cfg.moe
    if hf is None:
        if mine is not None:
            raise SpecError("model.moe", f"set, but {_shown(_init_from(cfg))} is a dense model (no experts)")
        return None
    if mine is None:
        return moe_class(**hf)
    for key in _MOE_AGREE:
        if key in mine.model_fields_set and getattr(mine, key) != hf[key]:
            raise SpecError(f"model.moe.{key}", f"{getattr(mine, key)} differs from config.json's {hf[key]}")
    own = {k: getattr(mine, k) for k in ("aux_loss_coef",) if k in mine.model_fields_set}
    return moe_class(**{**hf, **own})


def _check_rope_scaling(cfg: LlamaConfig, hf: dict[str, Any] | None) -> None:
    from elastic.models.hf_families import LLAMA3_KEYS

    mine = cfg.rope_scaling.model_dump() if cfg.rope_scaling is not None else None
    if mine is None or hf is None:
        if (mine is None) != (hf is None):
            raise SpecError("model.rope_scaling", f"{mine} differs from config.json's {hf}")
        return
    for key in LLAMA3_KEYS:
        if mine[key] != hf[key]:
            raise SpecError(f"model.rope_scaling.{key}", f"{mine[key]} differs from config.json's {hf[key]}")


# ----- tensor names, from the index or the safetensors headers (never the weights) ---------------


def expected_names(adapter: HFAdapter) -> set[str]:
    """Every Hugging Face tensor name the adapter reads."""
    return set(adapter.names.values()) | {n for names in adapter.experts.values() for n in names}


def ignorable(name: str) -> bool:
    return name.endswith(".rotary_emb.inv_freq")  # a buffer old transformers versions saved


def tensor_names(uri: str) -> set[str]:
    """The tensor names of a Hugging Face directory: the index's ``weight_map``, else each
    safetensors file's header (8 bytes of length, then the JSON header; no tensor data)."""
    fs, root = open_fs(uri)
    if fs.exists(join(root, INDEX)):
        return set(read_json(join(uri, INDEX))["weight_map"])
    files = [join(root, SINGLE)] if fs.exists(join(root, SINGLE)) else sorted(fs.glob(join(root, "*.safetensors")))
    names: set[str] = set()
    for path in files:
        size = int.from_bytes(fs.cat_file(path, start=0, end=8), "little")
        if size <= 0 or size > 100_000_000:
            raise ValueError(f"{path.rsplit('/', 1)[-1]} has no safetensors header")
        names |= set(json.loads(fs.cat_file(path, start=8, end=8 + size))) - {"__metadata__"}
    return names


def _check_tensor_names(uri: str, adapter: HFAdapter, family: str) -> None:
    try:
        found = tensor_names(uri)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecError(FIELD, f"cannot read the tensor names in {_shown(uri)}: {type(exc).__name__}: {exc}") from None
    expected = expected_names(adapter)
    unexpected = sorted(n for n in found - expected - adapter.optional if not ignorable(n))
    missing = sorted(expected - found)
    for what, names in (("holds tensors", unexpected), ("lacks tensors", missing)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise SpecError(
                FIELD,
                f"{_shown(uri)} {what} that config.json's {family} architecture does not have: "
                f"{', '.join(names[:3])}{more}",
            )


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


def _init_from(cfg: LlamaConfig | CustomConfig) -> str:
    """``cfg.init_from``, which the config's ``check()`` only hands here when it is set."""
    if cfg.init_from is None:
        raise RuntimeError("model.init_from is not set: there is no Hugging Face checkpoint to read")
    return cfg.init_from


def check_custom_init_from(cfg: CustomConfig, spec: ModelSpec) -> None:
    """``kind: custom`` with ``init_from``: the factory's adapter must agree with config.json."""
    if spec.hf is None:
        raise SpecError(FIELD, f"{cfg.factory} gives no Hugging Face adapter (ModelSpec.hf), so it cannot load one")
    cfg.init_from = resolve(_init_from(cfg))
    doc = read_hf_config(cfg.init_from)
    for key, value in spec.hf.config.items():
        if key in doc and key not in _NOT_SHAPE and doc[key] != value:
            raise SpecError(FIELD, f"config.json has {key}={doc[key]!r}, the factory's model {value!r}")
    _check_tensor_names(cfg.init_from, spec.hf, f"{cfg.factory}")
