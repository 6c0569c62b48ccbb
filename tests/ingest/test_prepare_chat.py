"""``elastic prepare --format chat``: conversations through the tokenizer's own chat template,
packed whole into rows with ``document_ids``, ``loss_mask`` on the assistant's tokens alone;
bad input exits 2 with one line naming the field. The tokenizer is a tiny byte-level one saved
locally with a ChatML template (``elastic.testing.chat_data``)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from chat_workers import train_steps
from cli_testlib import run_cli
from transformers import AutoTokenizer

from elastic.errors import SpecError
from elastic.ingest.chat_template import ChatTemplate
from elastic.ingest.corpus import DataConfig
from elastic.ingest.index import read_index
from elastic.ingest.preflight import check_corpus, check_sft_layout
from elastic.ingest.prepare import PrepareConfig
from elastic.ingest.prepare_chat import prepare_chat
from elastic.ingest.row_packing import PAD_DOCUMENT, RowPacker
from elastic.testing.chat_data import VOCAB, conversation, save_chat_tokenizer, write_chat_jsonl
from elastic.testing.ranks import run_ranks
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)

SEQ = 127


def records(n: int = 40, seed: int = 0) -> list[dict]:
    """Conversations of 1 or 2 turns (some with a system turn), messages of 1 to 10 characters."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        turns = int(rng.integers(1, 3))
        system = i % 3 == 0
        out.append(conversation(rng, turns, rng.integers(1, 11, 2 * turns + system).tolist(), system=system))
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return save_chat_tokenizer(str(tmp_path_factory.mktemp("tok")))


def prep(tmp_path, recs, tok, **kw):
    src = write_chat_jsonl(str(tmp_path / "in" / "chat.jsonl"), recs)
    cfg = PrepareConfig(src, str(tmp_path / "out"), format="chat", tokenizer=tok, seq_len=SEQ, **kw)
    return prepare_chat(cfg), str(tmp_path / "out")


def columns(root: str) -> dict[str, np.ndarray]:
    index = read_index(root)
    tables = [pq.read_table(index.uri(s)) for s in index.shards]
    return {c: np.concatenate([np.asarray(t.column(c).to_pylist()) for t in tables]) for c in index.columns}


def documents(cols: dict[str, np.ndarray]) -> dict[int, list[tuple[int, np.ndarray, np.ndarray]]]:
    """Document id -> its pieces as (row, tokens, loss_mask), in row order."""
    out: dict[int, list] = {}
    for r, (t, m, d) in enumerate(zip(cols["tokens"], cols["loss_mask"], cols["document_ids"])):
        for doc in dict.fromkeys(d.tolist()):
            if doc != PAD_DOCUMENT:
                out.setdefault(doc, []).append((r, t[d == doc], m[d == doc]))
    return out


def test_rows_decode_to_the_templates_rendering_and_the_mask_is_the_assistants(tmp_path, tok_dir):
    recs = records()
    res, out = prep(tmp_path, recs, tok_dir, rows_per_shard=8, rows_per_group=4)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cols = columns(out)
    docs = documents(cols)
    assert sorted(docs) == list(range(len(recs)))  # every conversation, once
    for i, rec in enumerate(recs):
        (piece,) = docs[i]  # never split: each fits a row
        _, tokens, mask = piece
        assert tok.decode(tokens.tolist()) == tok.apply_chat_template(rec["messages"], tokenize=False)
        # the mask: exactly the tokens of each assistant message as the tokenizer renders it (its
        # content and the turn's end), in order, and nothing else
        want = [tok(m["content"] + "<|im_end|>\n", add_special_tokens=False)["input_ids"] for m in rec["messages"]
                if m["role"] == "assistant"]  # fmt: skip
        assert tokens[mask == 1].tolist() == [t for w in want for t in w]
        runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])) == 1)
        assert len(runs) == len(want)  # one run per assistant turn
    padding = cols["document_ids"] == PAD_DOCUMENT
    assert (cols["loss_mask"][padding] == 0).all() and (cols["tokens"][padding] == tok.pad_token_id).all()
    # the figures it prints: non-padding tokens and counted targets over the rows
    width = SEQ + 1
    assert res.stats.rows == len(cols["tokens"]) and res.stats.tokens == int((~padding).sum())
    assert res.stats.fill(width) == pytest.approx((~padding).mean())
    counted = (cols["loss_mask"][:, 1:] == 1) & (cols["document_ids"][:, 1:] == cols["document_ids"][:, :-1])
    assert res.stats.counted == int(counted.sum())
    index = json.load(open(f"{out}/index.json"))
    assert index["columns"] == ["tokens", "loss_mask", "document_ids"] and index["row_width"] == width
    assert index["tokenizer"]["vocab_size"] == VOCAB and [s["rows"] for s in index["shards"]][:-1] == [8] * (
        len(index["shards"]) - 1
    )


def test_prefix_rendering_finds_the_same_tokens_as_the_templates_generation_blocks(tmp_path):
    """On a template with {% generation %} blocks, the prefix-by-prefix spans (used for templates
    without them) give transformers' own assistant mask, token for token."""
    gen = ChatTemplate(save_chat_tokenizer(str(tmp_path / "gen"), generation=True))
    assert gen.marks_generation
    from elastic.ingest.chat_template import overlap_mask

    for rec in records(20, seed=3):
        m = rec["messages"]
        ref = gen.tok.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        text = gen.tok.apply_chat_template(m, tokenize=False)
        enc = gen.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == list(ref["input_ids"])
        mask = overlap_mask(enc["offset_mapping"], gen.prefix_spans(m, "x"))
        assert mask.tolist() == list(ref["assistant_masks"]) and mask.any()
        assert gen.render(m, "x").assistant.tolist() == list(ref["assistant_masks"])


def test_packing_keeps_documents_whole_unless_one_is_longer_than_a_row():
    rows: list[tuple] = []
    width = 10
    packer = RowPacker(width, pad_id=0, emit=lambda *c: rows.append(c))
    lengths = [4, 7, 3, 6, 2, 10, 1, 5]
    for i, n in enumerate(lengths):
        packer.add(np.full(n, i + 1, dtype=np.int32), np.ones(n, dtype=np.int8), f"doc {i}")
    packer.finish()
    seen = [d for _, _, docs in rows for d in dict.fromkeys(docs.tolist()) if d != PAD_DOCUMENT]
    assert sorted(seen) == list(range(len(lengths)))  # each document in one row, whole
    for tokens, _, docs in rows:
        for d in set(docs.tolist()) - {PAD_DOCUMENT}:
            assert (tokens[docs == d] == d + 1).all() and (docs == d).sum() == lengths[d]
    assert len(rows) == 5  # first fit: 38 tokens in 5 rows of 10 (one conversation a row would take 8)
    alone: list[tuple] = []
    padded = RowPacker(width, pad_id=0, emit=lambda *c: alone.append(c), pack=False)
    for i, n in enumerate(lengths):
        padded.add(np.full(n, i + 1, dtype=np.int32), np.ones(n, dtype=np.int8), f"doc {i}")
    padded.finish()
    assert [int((d == i).sum()) for i, (_, _, d) in enumerate(alone)] == lengths  # one a row, in order
    with pytest.raises(SpecError, match=r"--seq-len: doc x: a conversation of 12 tokens is longer than a row"):
        RowPacker(width, 0, lambda *c: None).add(np.ones(12, np.int32), np.ones(12, np.int8), "doc x")
    for mode, pieces in (("truncate", [10]), ("split", [10, 2])):
        out: list[tuple] = []
        p = RowPacker(width, 0, lambda *c, out=out: out.append(c), overlong=mode)
        p.add(np.arange(12, dtype=np.int32), np.ones(12, np.int8), "doc x")
        p.finish()
        assert [int((d == 0).sum()) for _, _, d in out] == pieces
        assert np.concatenate([t[d == 0] for t, _, d in out]).tolist() == list(range(sum(pieces)))
    assert (p.stats.split, p.stats.truncated) == (1, 0)


@pytest.mark.cluster  # spawns a gloo rank
def test_a_short_run_trains_on_the_prepared_rows(tmp_path, tok_dir):
    _, out = prep(tmp_path, records(80), tok_dir)
    raw = {
        "model": {"kind": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB,
                  "seq_len": SEQ, "multiple_of": 16},
        "parallel": {"micro_batch": 4},
        "data": {"source": out},
        "train": {"steps": 12, "global_batch": 8, "lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
    }  # fmt: skip
    spec = JobSpec.from_dict(raw)
    cols = check_corpus(spec.data, SEQ, VOCAB)
    assert cols == ("tokens", "loss_mask", "document_ids")
    check_sft_layout(cols, spec)  # data.loader auto: the rank's own reader, no refusal
    (got,) = run_ranks(1, train_steps, (raw,), tmp_path / "ranks")
    losses = got["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0]
    assert got["eval_after"] < losses[0]


def _bad_utf8(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    return str(p)


@pytest.mark.parametrize(
    ("case", "field", "words"),
    [
        ("no_template", "--tokenizer", "has no chat template"),
        ("not_object", "messages", "line 2 is not an object with 'messages'"),
        ("bad_message", "messages", "message 1 must be an object with a string 'role' and 'content'"),
        ("utf8", "INPUT", "line 1 is not valid UTF-8"),
        ("role", "messages", "the chat template rejects the conversation: unknown role robot"),
        ("overlong", "--seq-len", "line 1: a conversation of"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, tok_dir, capsys, case, field, words):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    tok = tok_dir
    lines = [good]
    if case == "no_template":
        tok = save_chat_tokenizer(str(tmp_path / "plain"), template=None)
    elif case == "not_object":
        lines = [good, {"text": "no messages"}]
    elif case == "bad_message":
        lines = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}]
    elif case == "role":
        lines = [{"messages": [{"role": "robot", "content": "beep"}]}]
    elif case == "overlong":
        lines = [{"messages": [{"role": "user", "content": "x" * 300}]}]
    src = _bad_utf8(tmp_path) if case == "utf8" else write_chat_jsonl(str(tmp_path / "in.jsonl"), lines)
    out = tmp_path / "out"
    r = run_cli(capsys, "prepare", src, str(out), "--format", "chat", "--tokenizer", tok, "--seq-len", str(SEQ))
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {field}: ") and words in r.stderr, r.stderr
    assert not out.exists() or not any(out.iterdir())  # nothing left behind


def test_one_conversation_a_row_has_no_document_ids(tmp_path, tok_dir):
    recs = records(12)
    res, out = prep(tmp_path, recs, tok_dir, pack=False)
    assert read_index(out).columns == ("tokens", "loss_mask") and res.stats.rows == len(recs)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    table = pq.read_table(read_index(out).uri(read_index(out).shards[0]))
    for rec, row in zip(recs, table.column("tokens").to_pylist()):
        text = tok.apply_chat_template(rec["messages"], tokenize=False)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        assert tok.decode(row[:n]) == text and set(row[n:]) <= {tok.pad_token_id}


def test_the_cli_prints_how_full_the_rows_are(tmp_path, tok_dir, capsys):
    src = write_chat_jsonl(str(tmp_path / "in.jsonl"), records(30))
    r = run_cli(capsys, "prepare", src, str(tmp_path / "out"), "--format", "chat", "--tokenizer", tok_dir,
                "--seq-len", str(SEQ))  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = read_index(str(tmp_path / "out"))
    assert res is not None and res.columns == ("tokens", "loss_mask", "document_ids")
    assert "prepared 30 conversations" in r.stdout and "% full" in r.stdout and "counted in the loss" in r.stdout
    assert check_corpus(DataConfig(source=str(tmp_path / "out")), SEQ, VOCAB)[1:] == ("loss_mask", "document_ids")
