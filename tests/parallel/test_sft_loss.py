"""SFT rows (``loss_mask``, ``document_ids``): a packed row is its documents run apart, and
the loss is the mean over the global batch's counted targets at any DP degree, ZeRO stage
and gradient accumulation (elastic/engine.py, elastic/models/documents.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sft_workers import MODEL, SEED, TRAIN, sft_rows, sft_step

from elastic.ingest.sft_rows import IGNORE, SftRows
from elastic.models.spec import model_spec
from elastic.testing.ranks import run_ranks

pytestmark = pytest.mark.timeout(300)

spawned = pytest.mark.cluster  # spawns gloo ranks


def test_a_packed_row_gives_each_document_its_own_logits_and_loss():
    torch.manual_seed(0)
    model = model_spec(MODEL).build_full(SEED)
    lengths = [5, 7, 1, 4]  # one document of a single token: attends to itself only
    tokens = torch.randint(0, MODEL.vocab_size, (1, sum(lengths) + 1))
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.tensor([len(lengths)])])
    with torch.no_grad():
        packed = model(tokens[:, :-1], document_ids=doc_ids[None, :-1])
        at = 0
        for n in lengths:
            alone = model(tokens[:, at : at + n])
            torch.testing.assert_close(packed[:, at : at + n], alone, rtol=0, atol=1e-5)
            at += n
    # the loss: the mean over each document's own targets (none across a boundary)
    mask = torch.ones_like(tokens)
    rows = SftRows(tokens.numpy(), mask.numpy(), doc_ids[None].numpy())
    targets = torch.from_numpy(rows.targets())
    assert int((targets != IGNORE).sum()) == sum(n - 1 for n in lengths) + 0  # the last token starts a document
    with torch.no_grad():
        loss = F.cross_entropy(packed[0], targets[0])
        at, terms = 0, []
        for n in lengths:
            alone = model(tokens[:, at : at + n])[0]
            terms.append(F.cross_entropy(alone[:-1], tokens[0, at + 1 : at + n], reduction="sum"))
            at += n
    torch.testing.assert_close(loss, sum(terms) / sum(n - 1 for n in lengths), rtol=0, atol=1e-5)


@spawned
@pytest.mark.parametrize(
    ("world", "zero", "micro"),
    [(1, 0, 2), (1, 0, 8), (2, 0, 1), (2, 0, 4), (2, 3, 2)],
    ids=["dp1-accum4", "dp1-accum1", "dp2-accum4", "dp2-accum1", "zero3-dp2-accum2"],
)
def test_the_masked_loss_is_the_global_mean_at_any_dp_and_accumulation(tmp_path, world, zero, micro):
    """Against one forward of the whole batch in one process, torch's own SGD step."""
    model = model_spec(MODEL).build_full(SEED)
    rows = sft_rows(TRAIN.global_batch)
    targets = torch.from_numpy(rows.targets())
    logits = model(torch.from_numpy(rows.tokens)[:, :-1], document_ids=torch.from_numpy(rows.document_ids)[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= TRAIN.lr * p.grad
        logits = model(torch.from_numpy(rows.tokens)[:, :-1], document_ids=torch.from_numpy(rows.document_ids)[:, :-1])
        after = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    want = model.state_dict()
    results = run_ranks(world, sft_step, (world, zero, micro), tmp_path)
    for got in results:
        assert got["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
        assert got["eval_loss"] == pytest.approx(float(after), abs=1e-5)
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-5, msg=name)
