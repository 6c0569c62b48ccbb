"""Helpers of the Hugging Face round-trip tests: tiny random ``transformers`` Llamas saved with
``save_pretrained``, the reference (single-process) project model loaded from them, and
deterministic batches. Importable by spawned ranks (``hf_workers.py``)."""

from __future__ import annotations

import json
from typing import Any

import torch

from elastic.models.config import LlamaConfig

SEQ, VOCAB, GLOBAL, STEPS, SEED = 16, 64, 8, 2, 3
EXACT = 1e-5  # logits of the same weights: the same arithmetic up to fp32 rounding
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # below the probe length: the scaled and the interpolated bands are both exercised
    "original_max_position_embeddings": 16,
}
# name -> (transformers config keys, save_pretrained max_shard_size)
KINDS: dict[str, tuple[dict[str, Any], str]] = {
    "llama3": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}}, "20KB"),  # sharded + index
    "llama31": ({"rope_parameters": LLAMA31_ROPE}, "50GB"),  # one model.safetensors
    "llama32": ({"rope_parameters": LLAMA31_ROPE, "tie_word_embeddings": True}, "50GB"),
}


def save_hf(path: str, kind: str) -> str:
    """A random tiny ``LlamaForCausalLM`` (GQA: 4 heads, 2 KV heads) saved by ``transformers``.

    Every weight is random, norms included (all-ones norms would hide a swapped name), and
    large enough (std 0.1) that the logits move visibly with any misplaced row.
    """
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    extra, shard = KINDS[kind]
    cfg = HFConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        **extra,
    )
    torch.manual_seed({"llama3": 1, "llama31": 2, "llama32": 3}[kind])
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size=shard)
    return path


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the model at ``path`` as ``transformers`` loads it (``AutoModelForCausalLM``:
    the family its config.json names)."""
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))


def hf_probe_logits(path: str) -> torch.Tensor:
    """``transformers``' logits of the model saved at ``path`` on the ``probe`` tokens."""
    return hf_logits(path, probe())


def our_logits(model: torch.nn.Module) -> torch.Tensor:
    """The project model's logits on the ``probe`` tokens."""
    with torch.no_grad():
        return model(probe())


def s3_env(monkeypatch: Any, moto_s3: Any) -> None:
    """S3 through the standard AWS variables (how ``init_from`` and ``--out`` reach it)."""
    from s3fs import S3FileSystem
    from storage_testlib import FAKE_KEY, FAKE_SECRET

    for name, value in {
        "AWS_ENDPOINT_URL": moto_s3.endpoint,
        "AWS_ACCESS_KEY_ID": FAKE_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    S3FileSystem.clear_instance_cache()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def micro_batches(step: int, dp: int, dp_rank: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, targets = batch(step)
    per = GLOBAL // dp
    lo = dp_rank * per
    return [(inputs[i : i + micro], targets[i : i + micro]) for i in range(lo, lo + per, micro)]


def model_raw(hf_dir: str) -> dict[str, Any]:
    return {"kind": "llama", "init_from": hf_dir, "seq_len": SEQ}


def spec_raw(hf_dir: str, uri: str, parallel: dict[str, Any] | None = None, waves: int = 1) -> dict[str, Any]:
    return {
        "seed": SEED,
        "model": model_raw(hf_dir),
        "parallel": {"micro_batch": 2, **(parallel or {})},
        "data": {"waves": waves},
        "elastic": {"min_dp": 1, "max_dp": 4},
        "train": {"steps": 20, "global_batch": GLOBAL, "lr": 1e-2, "warmup_steps": 1},
        "checkpoint": {"uri": uri, "every_steps": 1, "async": False},
    }


def load_reference(cfg: LlamaConfig) -> torch.nn.Module:
    """The whole project model, in one process, loaded through the rank-side reader."""
    from elastic.checkpoint.hf_import import HFReader
    from elastic.models.spec import model_spec
    from storage import load_into

    spec = model_spec(cfg)
    model = spec.build_full(SEED)
    state = model.state_dict()
    load_into(HFReader(cfg.init_from, spec.hf, sorted(state)), state)
    return model


def train_reference(model: torch.nn.Module, train_cfg: Any) -> list[float]:
    """``STEPS`` steps over the whole global batch in one forward (torch's own clipping)."""
    from elastic.models.spec import lm_loss
    from elastic.optim import build_optimizer

    opt, sched = build_optimizer(model, train_cfg)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def llama_factory(**shape: Any):
    """A ``kind: custom`` factory whose model is the project's Llama: its ``ModelSpec`` carries
    the Llama's Hugging Face adapter, as a user's model with its own adapter would."""
    from elastic.models.spec import model_spec

    return model_spec(LlamaConfig(**shape))


# ----- the other Hugging Face families -------------------------------------------------------------

# model_type -> the transformers config keys beyond the common tiny shape
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": True},  # small Qwen2s tie their head
    "qwen3": {"head_dim": 16},  # not hidden_size / heads (8): as Qwen3-0.6B's 128 for 1024 / 16
    "mistral": {"head_dim": 8, "sliding_window": 4096},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True},
    "qwen3_moe_unnormed": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 12},
}
BOS, EOS = 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_family(path: str, name: str) -> str:
    """A random tiny model of a Hugging Face family saved by ``transformers``, with a tokenizer
    (a word-level ``tokenizers`` vocabulary of ``VOCAB`` entries: nothing downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = name.removesuffix("_unnormed")
    cfg = AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **FAMILIES[name],
    )
    torch.manual_seed(sorted(FAMILIES).index(name) + 10)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="20KB" if family == "qwen3" else "50GB")
    save_tokenizer(path)
    return path


def save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_first_loss(path: str) -> float:
    """``transformers``' loss on step 0's global batch, as ``lm_loss`` takes it."""
    from elastic.models.spec import lm_loss

    inputs, targets = batch(0)
    with torch.no_grad():
        return float(lm_loss(hf_model(path)(inputs).logits, targets))


def header_only(path: str, names: list[str] | set[str]) -> None:
    """A ``model.safetensors`` that is a header naming ``names`` and no tensor data: the spec
    check (which reads the names only) passes, and any read of the weights fails."""
    doc = {name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for name in sorted(names)}
    raw = json.dumps(doc).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
