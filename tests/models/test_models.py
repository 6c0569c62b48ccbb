"""The model interface (docs/models.md): named Llama sizes, the memory model's inputs, and the
refusals of ``model.kind: custom`` and of layouts a model cannot run (exit 2, one line)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from elastic.errors import SpecError
from elastic.models.config import LlamaConfig
from elastic.models.spec import model_spec
from elastic.parallel.memory_model import estimate_memory, total_param_count
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CUSTOM = os.path.join(ROOT, "examples", "custom-model.yaml")


LLAMA_PUBLISHED = [  # size, parameters, SwiGLU hidden size (Hugging Face config.json: intermediate_size)
    ("llama3-8b", 8_030_261_248, 14_336),
    ("llama3-70b", 70_553_706_496, 28_672),
    ("llama3.1-8b", 8_030_261_248, 14_336),
    ("llama3.1-70b", 70_553_706_496, 28_672),
    ("llama3.1-405b", 405_853_388_800, 53_248),
    ("llama3.2-1b", 1_235_814_400, 8_192),  # tied embeddings: the head adds nothing
    ("llama3.2-3b", 3_212_749_824, 8_192),
]


@pytest.mark.parametrize("size,params,hidden", LLAMA_PUBLISHED)
def test_llama3_named_sizes_have_the_published_shapes(size, params, hidden):
    """8.03B, 70.6B, 405.9B, 1.24B and 3.21B parameters (Meta's model cards); the model built on
    the meta device agrees with the memory model's arithmetic, so `elastic plan` and the sweep
    reason about the real thing."""
    cfg = LlamaConfig(size=size)
    assert cfg.hidden_dim == hidden and cfg.vocab_size == 128_256 and cfg.rope_theta == 500_000
    assert (cfg.rope_scaling is not None) == (not size.startswith("llama3-"))
    assert cfg.tie_embeddings == size.startswith("llama3.2")
    with torch.device("meta"):
        model = model_spec(cfg).build()
    assert sum(p.numel() for p in model.parameters()) == total_param_count(cfg) == params


@pytest.mark.parametrize(
    "rope_scaling,field",
    [
        ({"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "model.rope_scaling.high_freq_factor"),
        ({"factor": 0.5}, "model.rope_scaling.factor"),
        ({"type": "yarn"}, "model.rope_scaling.type"),
        ({"original_max_position_embeddings": None}, "model.rope_scaling.original_max_position_embeddings"),
        ({"scale": 2}, "model.rope_scaling.scale"),
    ],
)
def test_rope_scaling_is_validated_naming_the_subfield(rope_scaling, field):
    full = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"model": {"kind": "llama", "size": "tiny", "rope_scaling": {**full, **rope_scaling}}})
    assert info.value.field == field, str(info.value)


def test_tied_llama_refuses_pipeline_stages():
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"model": {"kind": "llama", "size": "tiny", "tie_embeddings": True}, "parallel": {"pp": 2}})
    assert info.value.field == "model.tie_embeddings"


def test_tiny_sizes_built_and_counted_alike():
    for cfg in (LlamaConfig(size="tiny"), LlamaConfig(size="debug"), LlamaConfig(size="tiny", n_kv_heads=4)):
        assert sum(p.numel() for p in model_spec(cfg).build_full(0).parameters()) == total_param_count(cfg)


def test_memory_model_reads_the_model_and_the_precision():
    from elastic.parallel.memory_model import activation_bytes_per_layer

    cfg = LlamaConfig(size="llama3-8b", seq_len=4096)
    # 4 micro-batches: the gradients are held at the peak (the whole fp32 state counts)
    fp32 = estimate_memory(cfg, tp=8, dp=8, zero=3, micro_batch=1, num_microbatches=4)
    bf16 = estimate_memory(cfg, tp=8, dp=8, zero=3, micro_batch=1, num_microbatches=4, compute_dtype_bytes=2)
    # Per layer and token, bytes per d_model unit at tp 8 (hidden/d = 3.5): fp32 24 whole +
    # (20 + 16 * 3.5) / 8 split; bf16 (FSDP's bf16 policy) 20 + (10 + 8 * 3.5) / 8.
    assert activation_bytes_per_layer(cfg, 1, 8) == 4096 * 4096 * (24 + 76 / 8)
    assert activation_bytes_per_layer(cfg, 1, 8, precision="bf16") == 4096 * 4096 * (20 + 38 / 8)
    assert bf16.activations < fp32.activations
    assert (bf16.params, bf16.optimizer) == (fp32.params, fp32.optimizer)  # fp32 state
    assert bf16.buffers < fp32.buffers  # FSDP gathers bf16 blocks instead of fp32 ones
    # 8B with FSDP over 64 ranks (tp 8 x dp 8): fp32 params and AdamW of 8.03e9 params / 64
    assert (fp32.params + fp32.optimizer) == pytest.approx(12 * 8.03e9 / 64, rel=0.01)


def test_spec_dtype_defaults_by_device():
    spec = JobSpec.from_yaml(CUSTOM)
    assert spec.train.dtype == "fp32" and spec.model.vocab_size == 64  # filled in from the factory
    assert spec.train.resolved_dtype("cuda") == "fp32"
    base = JobSpec.from_dict({})
    assert base.train.dtype is None
    assert base.train.resolved_dtype("cuda") == "bf16" and base.train.resolved_dtype("cpu") == "fp32"


@pytest.mark.parametrize(
    "overrides,field,why",
    [
        (["model.factory=no_such_package.mod:build"], "model.factory", "cannot import"),
        (["model.factory=examples.my_transformer:nope"], "model.factory", "no function"),
        (["model.factory=builtins:dict"], "model.factory", "returned dict, expected"),
        (["model.factory=examples.my_transformer"], "model.factory", "package.module:function"),
        (["model.args.heads=3"], "model.factory", "raised ValueError"),
        (["parallel.tp=2"], "parallel.tp", "has no TP plan"),  # the example gives none
        (["parallel.pp=3"], "parallel.pp", "does not divide model.args.layers"),
        (["model.vocab_size=100"], "model.vocab_size", "differs from the factory"),
    ],
)
def test_custom_model_refusals_name_the_field(overrides, field, why):
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(CUSTOM, overrides=overrides)
    assert info.value.field == field and why in str(info.value), str(info.value)


def test_custom_model_without_stage_split_refuses_pp(tmp_path):
    (tmp_path / "flat_model.py").write_text(
        "import torch\n"
        "from elastic.models.spec import ModelSpec, seeded_init\n"
        "def build():\n"
        "    rule = lambda fqn, shape, gen: torch.randn(shape, generator=gen) * 0.02\n"
        "    return ModelSpec(name='flat', build=lambda: torch.nn.Sequential(torch.nn.Embedding(64, 8),"
        " torch.nn.Linear(8, 64)), init_weights=lambda m, s: seeded_init(m, s, rule), vocab_size=64, seq_len=16)\n"
    )
    raw = {"model": {"kind": "custom", "factory": "flat_model:build"}, "parallel": {"pp": 2}}
    proc = subprocess.run(
        [sys.executable, "-c", f"from jobs import JobSpec; JobSpec.from_dict({raw!r})"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "parallel.pp: model 'flat' has no stage split" in proc.stderr, proc.stderr


def test_cli_refuses_with_one_line_and_exit_2(tmp_path):
    for args, field in [
        (["--set", "model.factory=no_such_package.mod:build"], "model.factory"),
        (["--set", "parallel.tp=2"], "parallel.tp"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "jobs.cli", "run", CUSTOM, "--run-dir", str(tmp_path / "run"), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {field}: "), proc.stderr
    assert not (tmp_path / "run").exists()
