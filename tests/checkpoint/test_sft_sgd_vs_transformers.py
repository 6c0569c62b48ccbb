"""The SFT goal (issue 47): one plain SGD step on a masked, packed corpus equals the same step
taken in ``transformers`` on the documents run apart (weights within 1e-5), at DP 1 and 2.

The corpus is parquet with ``tokens``, ``loss_mask`` and ``document_ids``, read by the real
reader (``RankStream``); the model a tiny random ``LlamaForCausalLM`` saved locally and
loaded through ``model.init_from``; the reference is ``transformers`` itself, each document
a forward of its own, the loss the sum over the counted targets of all documents divided by
their number, and ``p -= lr * grad`` by hand."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from hf_testlib import SEQ, VOCAB, save_hf
from sft_sgd_workers import sgd_step

from elastic.testing.ranks import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]  # spawns gloo ranks

ROWS, LR = 4, 0.5


def packed_corpus(path) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
    """ROWS rows of SEQ + 1 ids, each packed from documents of random lengths, with a mask
    that counts about 60% of the targets; returns the corpus and its documents (tokens, mask)."""
    rng = np.random.default_rng(5)
    width = SEQ + 1
    tokens, masks, docs, documents = [], [], [], []
    for _ in range(ROWS):
        cuts = sorted(rng.choice(np.arange(2, width - 1), size=rng.integers(1, 4), replace=False).tolist())
        bounds = [0, *cuts, width]
        row_t = rng.integers(0, VOCAB, width)
        row_m = (rng.random(width) < 0.6).astype(np.int8)
        row_d = np.zeros(width, dtype=np.int32)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            row_d[lo:hi] = i
            documents.append((row_t[lo:hi], row_m[lo:hi]))
        tokens.append(row_t)
        masks.append(row_m)
        docs.append(row_d)

    def col(rows, t):
        return pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(rows), type=t), width)

    table = pa.table(
        {"tokens": col(tokens, pa.int32()), "loss_mask": col(masks, pa.int8()), "document_ids": col(docs, pa.int32())}
    )
    path.mkdir()
    pq.write_table(table, path / "part-0.parquet")
    return str(path), documents


def transformers_step(hf_dir: str, documents) -> tuple[float, dict[str, torch.Tensor]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    total, count = torch.zeros(()), 0
    for tokens, mask in documents:
        ids = torch.from_numpy(tokens.astype(np.int64))[None]
        logits = model(ids).logits[0, :-1]
        counted = torch.from_numpy(mask[1:] == 1)
        if counted.any():
            total = total + F.cross_entropy(logits[counted], ids[0, 1:][counted], reduction="sum")
        count += int(counted.sum())
    loss = total / count
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return float(loss.detach()), {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [1, 2])
def test_one_sgd_step_on_packed_masked_rows_equals_transformers_on_the_documents_apart(tmp_path, world):
    hf_dir = save_hf(str(tmp_path / "hf"), "llama3")
    source, documents = packed_corpus(tmp_path / "corpus")
    raw = {
        "seed": 0,
        "model": {"kind": "llama", "init_from": hf_dir, "seq_len": SEQ},
        "parallel": {"micro_batch": 1},
        "data": {"source": source, "loader": "native"},
        "train": {"steps": 1, "global_batch": ROWS, "lr": LR, "warmup_steps": 0, "grad_clip": 0,
                  "optimizer": {"name": "sgd"}, "schedule": "constant"},
    }  # fmt: skip
    want_loss, want = transformers_step(hf_dir, documents)
    for got in run_ranks(world, sgd_step, (raw,), tmp_path / "ranks"):
        assert got["loss"] == pytest.approx(want_loss, abs=1e-5)
        assert set(got["weights"]) <= set(want)
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
