"""Project checkpoint -> Hugging Face: ``elastic ckpt export --format hf`` against real
``transformers`` (docs/checkpoints.md). Exports of tiny random Llamas (tied embeddings,
sharded files, bf16, through S3, a custom model with an adapter) are loaded back by
``transformers`` and compared with the project's own logits or tensors; what cannot be
exported is refused with one line. The import side: ``test_hf_roundtrip.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_testlib import EXACT, SEED, hf_probe_logits, load_reference, model_raw, our_logits, s3_env

from elastic.checkpoint.export import ckpt_export
from elastic.errors import SpecError
from elastic.models.spec import model_spec
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----- project checkpoint -> HF ---------------------------------------------------------------------


def _checkpoint(root: str, model_doc: dict, state: dict[str, torch.Tensor], step: int = 2, commit: bool = True):
    """A one-rank project checkpoint of ``state`` (the model's FQNs), as the storage tier lays it out."""
    from storage import CheckpointStore, commit_checkpoint, cpu_snapshot, write_rank_shard

    store = CheckpointStore(root)
    snapshot, owned = cpu_snapshot({f"app/model/{k}": v for k, v in state.items()}, 0)
    result = write_rank_shard(store, step, snapshot, 0, owns=owned.__contains__)
    if commit:
        commit_checkpoint(store, step, [result], extra={"model": model_doc})


def test_export_tied_and_sharded_loads_in_transformers(hf_dirs, tmp_path):
    """Llama 3.2-style tied embeddings, exported in several files with an index."""
    cfg = JobSpec.from_dict({"model": model_raw(hf_dirs["llama32"])}).model
    model = load_reference(cfg)
    _checkpoint(str(tmp_path / "ckpt"), cfg.model_dump(mode="json"), model.state_dict())
    out = str(tmp_path / "hf")
    assert ckpt_export(str(tmp_path / "ckpt"), None, "hf", out, max_shard_size="30KB") == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    diff = float((hf_probe_logits(out) - our_logits(model)).abs().max())
    print(f"tied, sharded export: max |logit difference| {diff:.2e}")
    assert diff < EXACT


def test_init_from_and_export_through_s3(hf_dirs, tmp_path, moto_s3, s3_bucket, monkeypatch):
    """``init_from: s3://...`` and ``--out s3://...``, credentials from the AWS variables."""
    from s3fs import S3FileSystem

    s3_env(monkeypatch, moto_s3)
    fs = S3FileSystem()
    fs.put(hf_dirs["llama3"], f"{s3_bucket}/in", recursive=True)
    cfg = JobSpec.from_dict({"model": model_raw(f"s3://{s3_bucket}/in")}).model
    model = load_reference(cfg)
    assert float((our_logits(model) - hf_probe_logits(hf_dirs["llama3"])).abs().max()) < EXACT
    _checkpoint(str(tmp_path / "ckpt"), cfg.model_dump(mode="json"), model.state_dict())
    assert ckpt_export(str(tmp_path / "ckpt"), 2, "hf", f"s3://{s3_bucket}/out", max_shard_size="40KB") == 0
    fs.get(f"{s3_bucket}/out", str(tmp_path / "back"), recursive=True)
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 1
    assert float((hf_probe_logits(str(tmp_path / "back")) - our_logits(model)).abs().max()) < EXACT


def test_export_bf16_gives_back_the_original_tensors_rounded(hf_dirs, tmp_path):
    """Hugging Face -> project -> Hugging Face, untrained: every tensor under its original name,
    in its original row layout, equal to the original rounded to bf16."""
    from transformers import LlamaForCausalLM

    cfg = JobSpec.from_dict({"model": model_raw(hf_dirs["llama3"])}).model
    _checkpoint(str(tmp_path / "ckpt"), cfg.model_dump(mode="json"), load_reference(cfg).state_dict())
    assert ckpt_export(str(tmp_path / "ckpt"), 2, "hf", str(tmp_path / "hf"), dtype="bf16") == 0
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert back.dtype == torch.bfloat16
    original = LlamaForCausalLM.from_pretrained(hf_dirs["llama3"], dtype=torch.float32).state_dict()
    exported = back.state_dict()
    assert exported.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name


def test_export_refuses_what_it_cannot_export(hf_dirs, tmp_path, capsys):
    """Exit 2 and one line saying why, for each thing that cannot become a Hugging Face model."""
    from elastic.models.config import GPTConfig

    llama = JobSpec.from_dict({"model": model_raw(hf_dirs["llama3"])}).model
    state = load_reference(llama).state_dict()
    root = str(tmp_path / "ckpt")
    _checkpoint(root, llama.model_dump(mode="json"), state, step=2)
    _checkpoint(root, llama.model_dump(mode="json"), state, step=4, commit=False)
    gpt = GPTConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
    _checkpoint(str(tmp_path / "gpt"), gpt.model_dump(mode="json"), model_spec(gpt).build_full(0).state_dict())
    custom = {"kind": "custom", "factory": "examples.my_transformer:build", "args": {}}
    custom_state = model_spec(JobSpec.from_yaml(os.path.join(ROOT, "examples", "custom-model.yaml")).model)
    _checkpoint(str(tmp_path / "custom"), custom, custom_state.build_full(0).state_dict())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"")
    cases = [
        (str(tmp_path / "nothing"), None, "out1", "no checkpoint directory"),
        (root, 3, "out2", "step 3"),
        (root, 4, "out3", "not committed"),
        (str(tmp_path / "gpt"), None, "out4", "model.kind gpt has no Hugging Face adapter"),
        (str(tmp_path / "custom"), None, "out5", "records model.kind custom: a checkpoint's factory is never imported"),
        (root, 2, "full", "already holds a model"),
    ]
    for uri, step, out, why in cases:
        assert ckpt_export(uri, step, "hf", str(tmp_path / out)) == 2, why
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], (why, err)
    assert not (tmp_path / "out4").exists()
    # the user's own spec names the custom model: its factory runs, and has no adapter
    custom_model = JobSpec.from_yaml(os.path.join(ROOT, "examples", "custom-model.yaml")).model
    assert ckpt_export(str(tmp_path / "custom"), None, "hf", str(tmp_path / "out6"), model=custom_model) == 2
    assert "examples.my_transformer:build) has no Hugging Face adapter" in capsys.readouterr().err


def test_export_never_calls_a_factory_a_checkpoint_names(tmp_path, capsys):
    """An edited manifest naming ``subprocess:getoutput`` is refused (exit 2) and nothing runs."""
    from elastic.models.config import GPTConfig

    gpt = GPTConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
    marker = tmp_path / "ran"
    evil = {"kind": "custom", "factory": "subprocess:getoutput", "args": {"cmd": f"touch {marker}"}}
    _checkpoint(str(tmp_path / "ckpt"), evil, model_spec(gpt).build_full(0).state_dict())
    assert ckpt_export(str(tmp_path / "ckpt"), None, "hf", str(tmp_path / "out")) == 2
    assert "never imported" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_custom_model_with_an_adapter_loads_and_exports(hf_dirs, tmp_path):
    """``kind: custom`` goes both ways when its ``ModelSpec`` has ``hf``; its config must agree."""
    shape = {"n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "ffn_dim": 48}
    shape.update(seq_len=16, norm_eps=1e-5)
    raw = {"kind": "custom", "factory": "hf_testlib:llama_factory", "args": shape, "init_from": hf_dirs["llama3"]}
    cfg = JobSpec.from_dict({"model": raw}).model
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"model": {**raw, "args": {**shape, "n_heads": 8, "n_kv_heads": 8}}})
    assert info.value.field == "model.init_from" and "num_attention_heads" in str(info.value)
    spec = model_spec(cfg)
    model = spec.build_full(SEED)
    from elastic.checkpoint.hf_import import HFReader
    from storage import load_into

    state = model.state_dict()
    load_into(HFReader(cfg.init_from, spec.hf, sorted(state)), state)
    assert float((our_logits(model) - hf_probe_logits(hf_dirs["llama3"])).abs().max()) < EXACT
    _checkpoint(str(tmp_path / "ckpt"), cfg.model_dump(mode="json"), state)
    assert ckpt_export(str(tmp_path / "ckpt"), 2, "hf", str(tmp_path / "hf")) == 2  # a custom model: --spec
    assert ckpt_export(str(tmp_path / "ckpt"), 2, "hf", str(tmp_path / "hf"), model=cfg) == 0
    assert float((hf_probe_logits(str(tmp_path / "hf")) - our_logits(model)).abs().max()) < EXACT


def test_a_failed_export_leaves_nothing_that_blocks_the_next(tmp_path, capsys):
    """A checkpoint whose weights fail their checksum mid-export: the export fails (exit 1,
    naming the file) and leaves no header-only ``model.safetensors`` behind (it made the next
    export, from a good checkpoint, refuse ``--out`` as "already holds a model")."""
    from elastic.models.config import LlamaConfig

    llama = LlamaConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, seq_len=8, multiple_of=8)
    doc = llama.model_dump()
    state = model_spec(llama).build_full(0).state_dict()
    _checkpoint(str(tmp_path / "good"), doc, state)
    _checkpoint(str(tmp_path / "bad"), doc, state)
    step_dir = tmp_path / "bad" / "step_00000002"
    data = max((p for p in step_dir.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # the last tensor: its header is written first
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    assert ckpt_export(str(tmp_path / "bad"), None, "hf", str(out)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "crc32" in err, err
    assert not out.exists() or not any(out.iterdir()), sorted(os.listdir(out))
    assert ckpt_export(str(tmp_path / "good"), None, "hf", str(out)) == 0
