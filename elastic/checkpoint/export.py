"""``elastic ckpt export URI [--step N] --format hf --out DIR``: a checkpoint as a Hugging Face model.

Runs in the CLI process: no Ray, no process group. It reads one committed checkpoint of the
project (any layout: DCP's planner consolidates each tensor from the boxes every rank saved,
checking each box's CRC-32) and writes ``config.json`` plus ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` above
``--max-shard-size``) that ``transformers`` loads with ``AutoModelForCausalLM.from_pretrained``,
as the model's own family (``elastic.models.hf_families``), with ``generation_config.json`` and
the tokenizer files of the ``model.init_from`` directory (``hf_ship.py``).
Tensors are streamed one at a time, so the export holds one tensor in memory, not the model.

The model is rebuilt from the config each commit records in its manifest (``extra.model``),
for the built-in kinds only: nothing a checkpoint records is imported or called, so a
``kind: custom`` model (a factory) comes from the user's own job spec (``--spec``), never
from the manifest (an edited manifest naming ``subprocess:getoutput`` is refused, exit 2).
Its ``ModelSpec.hf`` adapter gives the names, the config.json and the RoPE rows to permute
back to halves. What cannot be exported is refused with exit 2 and the reason: a model
without an adapter (``kind: gpt``, a custom factory without ``ModelSpec.hf``), a missing or
uncommitted step, a checkpoint that does not record its model, an ``--out`` that already
holds a model. A damaged file exits 1 naming it, as ``elastic ckpt verify`` does.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from elastic.checkpoint.cli import EXIT_BAD_INPUT, EXIT_DAMAGED, EXIT_OK, _BadInput, _open, _redact
from elastic.checkpoint.hf_import import pairs_to_halves
from elastic.checkpoint.hf_ship import ship_beside
from elastic.checkpoint.safetensors_io import write_file
from elastic.errors import SpecError
from elastic.models.hf import CONFIG, INDEX, SINGLE, HFAdapter, join, open_fs

MODEL = "app/model/"  # where the model's tensors sit in a checkpoint (the trainer's state layout)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SHARD = "5GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Exported:
    step: int
    files: list[str]
    bytes: int
    tensors: int
    shipped: list[str]  # generation_config.json and the tokenizer files beside the weights


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``64KB`` (decimal units, as transformers' ``max_shard_size``) or bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise _BadInput(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 1000000")
    unit = match.group(2).upper().rstrip("B")
    return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[unit])


def ckpt_export(
    uri: str,
    step: int | None,
    fmt: str,
    out: str,
    dtype: str = "fp32",
    max_shard_size: str = DEFAULT_SHARD,
    model: Any = None,
) -> int:
    """The CLI command; returns the exit code. ``model``: the model of the user's ``--spec``, if given."""
    from storage.errors import ChecksumMismatch

    try:
        if fmt != "hf":
            raise _BadInput(f"--format {fmt!r}: only hf is supported")
        if dtype not in DTYPES:
            raise _BadInput(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        done = export_hf(uri, step, out, DTYPES[dtype], parse_size(max_shard_size), model)
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ChecksumMismatch as exc:
        print(f"error: damaged checkpoint: {_redact(str(exc))}", file=sys.stderr)
        return EXIT_DAMAGED
    tokenizer = len(done.shipped) - 1
    where = f"{len(done.files)} file(s) in {_redact(out)}, with generation_config.json"
    where += f" and {tokenizer} tokenizer file(s) from model.init_from" if tokenizer else " (no tokenizer files)"
    print(f"exported step {done.step}: {done.tensors} tensors, {done.bytes:,} bytes, {where}")
    return EXIT_OK


def export_hf(
    uri: str, step: int | None, out: str, dtype: torch.dtype, max_shard_bytes: int, model: Any = None
) -> Exported:
    """Write checkpoint ``step`` (default: the newest committed) under ``uri`` to ``out``.

    ``model``: the user's own model config (``--spec``'s ``model``), the only source of a custom one.
    """
    reader = _open_reader(uri, step)
    adapter, cfg = _adapter_of(reader, model)
    fs, root = open_fs(out)
    if fs.exists(root) and (fs.glob(join(root, "*.safetensors")) or fs.exists(join(root, INDEX))):
        raise _BadInput(f"--out {_redact(out)} already holds a model; export into an empty directory")
    made = not fs.exists(root)
    fs.makedirs(root, exist_ok=True)
    written: list[str] = []  # each file this export creates under --out, before it is opened
    try:
        return _write_hf(reader, adapter, cfg, fs, root, dtype, max_shard_bytes, written)
    except BaseException:
        # A half-written export (a header-only model.safetensors) made the next one refuse
        # --out as "already holds a model": what this one wrote goes, and --out if it made it.
        for path in written:
            with contextlib.suppress(OSError):
                fs.rm(path)
        if made:
            with contextlib.suppress(OSError):
                fs.rmdir(root)
        raise


def _write_hf(
    reader: Any, adapter: Any, cfg: Any, fs: Any, root: str, dtype: torch.dtype, max_shard_bytes: int, written: list
) -> Exported:
    sources = _sources(reader, adapter)
    shapes = {name: _shape(reader, fqn, expert) for name, (fqn, expert) in sources.items()}
    shards = _shard(list(sources), shapes, dtype, max_shard_bytes)
    last: dict[str, torch.Tensor] = {}  # the expert tensor the previous names came from

    def produce(name: str) -> torch.Tensor:
        fqn, expert = sources[name]
        if expert is None:
            return _consolidated(reader, fqn, adapter)
        if fqn not in last:
            last.clear()
            last[fqn] = _consolidated(reader, fqn, adapter)
        return last[fqn][expert].t()

    files, total = [], 0
    for i, names in enumerate(shards, start=1):
        file = SINGLE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        entries = [(name, dtype, shapes[name]) for name in names]
        written.append(join(root, file))
        total += write_file(fs, join(root, file), entries, produce, {"format": "pt"})
        files.append(file)
    if len(shards) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        tensor_bytes = sum(_nbytes(shapes[n], dtype) for n in sources)
        written.append(join(root, INDEX))
        _write_json(fs, join(root, INDEX), {"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map})
    dtype_name = str(dtype).removeprefix("torch.")
    config = {**adapter.config, "dtype": dtype_name, "torch_dtype": dtype_name}  # transformers 5 and 4
    written.append(join(root, CONFIG))
    _write_json(fs, join(root, CONFIG), config)
    copied = ship_beside(fs, root, getattr(cfg, "init_from", None), config)
    return Exported(reader.step, files, total, len(sources), copied)


def _open_reader(uri: str, step: int | None) -> Any:
    from storage import CheckpointReader
    from storage.errors import CheckpointNotFound

    store, step = _open(uri, step)
    if step is None:
        latest = store.latest()
        if latest is None:
            raise _BadInput(f"no committed checkpoint under {_redact(uri)}")
        step = latest.step
    try:
        return CheckpointReader(store, step)
    except CheckpointNotFound:
        raise _BadInput(f"step {step} under {_redact(uri)} is missing or not committed: nothing to export") from None


def _adapter_of(reader: Any, user_model: Any = None) -> tuple[HFAdapter, Any]:
    from pydantic import TypeAdapter, ValidationError

    from elastic.models.config import AnyModelConfig
    from elastic.models.spec import model_spec

    doc = reader.manifest.extra.get("model")
    if doc is None and user_model is None:
        raise _BadInput(f"step {reader.step} does not record its model (written before exports existed)")
    recorded_kind = doc.get("kind", "gpt") if isinstance(doc, dict) else None
    if user_model is None and recorded_kind not in ("gpt", "llama"):
        raise _BadInput(
            f"step {reader.step} records model.kind {recorded_kind}: a checkpoint's factory is never imported;"
            " pass --spec with the job spec that defines the model"
        )
    try:
        cfg: Any = user_model if user_model is not None else TypeAdapter(AnyModelConfig).validate_python(doc)
        spec = model_spec(cfg)  # a custom factory only from the user's own spec
    except (ValidationError, SpecError) as exc:
        raise _BadInput(f"the model recorded in step {reader.step} cannot be rebuilt: {exc}") from None
    if spec.hf is None and cfg.kind == "llama":  # no Hugging Face family computes this model: say why
        from elastic.models.hf_families import family_of

        try:
            family_of(cfg)
        except SpecError as exc:
            raise _BadInput(f"no Hugging Face family computes this model: {exc}") from None
    if spec.hf is None:
        what = f"model.kind {cfg.kind}" + (f" ({cfg.factory})" if cfg.kind == "custom" else "")
        raise _BadInput(f"{what} has no Hugging Face adapter (ModelSpec.hf): nothing maps it to a Hugging Face model")
    return spec.hf, cfg


def _sources(reader: Any, adapter: HFAdapter) -> dict[str, tuple[str, int | None]]:
    """Hugging Face name -> the project FQN it is written from (the first, for tied weights)
    and, for an expert's linear, the expert's index in that FQN's ``[E, in, out]`` tensor."""
    saved = reader.metadata.state_dict_metadata
    sources: dict[str, tuple[str, int | None]] = {}
    for fqn in [*adapter.names, *adapter.experts]:
        if MODEL + fqn not in saved:
            raise _BadInput(f"step {reader.step} lacks {fqn}: not a checkpoint of this model")
    for fqn, name in adapter.names.items():
        sources.setdefault(name, (fqn, None))
    for fqn, names in adapter.experts.items():
        sources.update({name: (fqn, e) for e, name in enumerate(names)})
    return sources


def _shape(reader: Any, fqn: str, expert: int | None) -> tuple[int, ...]:
    size = tuple(reader.metadata.state_dict_metadata[MODEL + fqn].size)
    return size if expert is None else tuple(reversed(size[1:]))  # one expert's [out, in]


def _shard(names: list[str], shapes: dict[str, tuple], dtype: torch.dtype, limit: int) -> list[list[str]]:
    """Consecutive tensors into files of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(shapes[name], dtype)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def _consolidated(reader: Any, fqn: str, adapter: HFAdapter) -> torch.Tensor:
    """One whole tensor from every rank's boxes, in Hugging Face's row layout."""
    from storage import load_into

    md = reader.metadata.state_dict_metadata[MODEL + fqn]
    target = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    load_into(reader, {MODEL + fqn: target})
    head_dim = adapter.rotary.get(fqn)
    return pairs_to_halves(target, head_dim) if head_dim else target


def _write_json(fs: Any, path: str, doc: dict) -> None:
    with fs.open(path, "wb") as f:
        f.write((json.dumps(doc, indent=2) + "\n").encode())
