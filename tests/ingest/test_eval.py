"""Eval (``data.eval_source``, ``train.eval_every``): the mean loss over the whole eval corpus,
sharded over the data shards with no gradient, equals a one-process computation at any DP
degree; the spec and the preflight refuse what cannot be evaluated before anything starts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from cli_testlib import run_cli
from eval_workers import MODEL, SEED, eval_losses

from elastic.errors import SpecError
from elastic.ingest.eval_rows import share
from elastic.ingest.sft_rows import SftRows
from elastic.models.spec import model_spec
from elastic.testing.ranks import run_ranks
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)

ROWS = 11  # not a multiple of dp x micro_batch: shares and micro-batches are padded


def corpus(path, rows: int = ROWS, width: int = MODEL.seq_len + 1, sft: bool = True) -> tuple[str, SftRows]:
    """Parquet rows of random tokens; with ``sft`` packed documents and a loss mask (a row
    that counts nothing among them)."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, MODEL.vocab_size, (rows, width))
    mask = (rng.random((rows, width)) < 0.6).astype(np.int8)
    mask[3] = 0
    docs = np.cumsum(rng.random((rows, width)) < 0.15, axis=1).astype(np.int32)

    def col(a, t):
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), type=t), width)

    cols = {"tokens": col(tokens, pa.int32())}
    if sft:
        cols |= {"loss_mask": col(mask, pa.int8()), "document_ids": col(docs, pa.int32())}
    path.mkdir()
    pq.write_table(pa.table(cols), path / "part-0.parquet", row_group_size=4)
    return str(path), SftRows(tokens, mask, docs) if sft else SftRows(tokens)


def one_process_mean(rows: SftRows) -> float:
    """The whole corpus in one forward: the sum of the counted targets' losses over their number."""
    model = model_spec(MODEL).build_full(SEED)
    docs = None if rows.document_ids is None else torch.from_numpy(rows.document_ids[:, :-1]).long()
    with torch.no_grad():
        logits = model(torch.from_numpy(rows.tokens[:, :-1]), document_ids=docs)
    targets = torch.from_numpy(rows.targets())
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="mean"))


def test_the_shares_cover_every_row_once():
    for n, shards in ((11, 2), (11, 4), (3, 4), (8, 8), (1, 3)):
        got = [share(n, shards, s) for s in range(shards)]
        covered = np.concatenate([np.arange(a, b) for a, b, _ in got])
        assert covered.tolist() == list(range(n)) and {p for *_, p in got} == {-(-n // shards)}


@pytest.mark.cluster  # spawns gloo ranks
@pytest.mark.parametrize(("world", "zero", "micro"), [(1, 0, 2), (2, 3, 4)], ids=["dp1", "zero3-dp2"])
def test_eval_loss_is_the_whole_corpus_mean_at_any_dp(tmp_path, world, zero, micro):
    """SFT rows (masked, packed) and plain token rows; at DP 2 under ZeRO-3 each forward gathers
    the parameters with the peer, so the shares' padding to equal micro-batches matters."""
    made = [corpus(tmp_path / "sft"), corpus(tmp_path / "tokens", sft=False)]
    want = [one_process_mean(rows) for _, rows in made]
    got = run_ranks(world, eval_losses, ([uri for uri, _ in made], zero, micro), tmp_path / "ranks")
    for losses in got:
        assert losses == [pytest.approx(w, abs=1e-5) for w in want], (got, want)


def spec_dict(**over) -> dict:
    raw = {
        "model": {"kind": "llama", "n_layers": 2, "d_model": 16, "n_heads": 2, "seq_len": 16, "vocab_size": 64},
        "train": {"steps": 2, "global_batch": 4},
    }
    for key, value in over.items():
        section, name = key.split("__")
        raw.setdefault(section, {})[name] = value
    return raw


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"train__eval_every": 2}, "train.eval_every", "set data.eval_source"),
        ({"data__eval_source": "EVAL"}, "train.eval_every", "give the steps between evals"),
        ({"data__eval_source": "EVAL", "train__eval_every": 1, "parallel__pp": 2}, "train.eval_every", "pp=2"),
        ({"data__eval_source": "/no/such/corpus", "train__eval_every": 1}, "data.eval_source", "does not exist"),
    ],
)
def test_the_spec_refuses_an_eval_it_cannot_run(tmp_path, over, field, words):
    uri, _ = corpus(tmp_path / "eval")
    over = {k: (uri if v == "EVAL" else v) for k, v in over.items()}
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict(spec_dict(**over))
    assert err.value.field == field and words in err.value.message, str(err.value)


def test_an_eval_corpus_of_another_row_width_is_refused_before_anything_starts(tmp_path, capsys, no_ray):
    import ray

    train, _ = corpus(tmp_path / "train", rows=16)
    wide, _ = corpus(tmp_path / "eval", width=MODEL.seq_len + 5)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {{kind: llama, n_layers: 1, d_model: 16, n_heads: 2}}\nrun_dir: {tmp_path / 'run'}\n")
    got = run_cli(
        capsys, "run", str(spec), "--set", f"model.seq_len={MODEL.seq_len}", "--set",
        f"model.vocab_size={MODEL.vocab_size}", "--set", f"data.source={train}", "--set", f"data.eval_source={wide}",
        "--set", "train.eval_every=1", "--set", "data.loader=native",
    )  # fmt: skip
    assert got.returncode == 2, got
    assert got.stderr.startswith("error: data.eval_source: ") and "rows of 21 ids" in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert not ray.is_initialized()
