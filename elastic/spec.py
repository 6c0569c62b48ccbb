"""The job spec: one pydantic model composed from the config of each owner (public name:
``jobs.JobSpec``).

``JobSpec`` fields are the spec keys of ``docs/spec.md``, exactly. Every check that spans several
owners (``tp`` divides ``n_heads``, a reachable ``global_batch``...) lives here, and every
error names the dotted field at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastic.checkpoint.config import CheckpointConfig
from elastic.control.config import ElasticConfig
from elastic.errors import SpecError
from elastic.ingest.corpus import DataConfig
from elastic.models.config import MODEL_KINDS, AnyModelConfig, GPTConfig
from elastic.optim import TrainConfig
from elastic.parallel import batch
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import validate_layout
from elastic.placement.slots import ResourcesConfig
from elastic.spec_limits import check_finite, check_no_bool_numbers, check_sizes
from elastic.yaml_io import DuplicateKey, load_yaml, read_yaml

MAX_NAME_LEN = 128  # the name is part of the default run directory's name (255 bytes at most)


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("job", min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[A-Za-z0-9._-]+$")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    run_dir: str | None = Field(None, min_length=1, description="null: ./runs/<name>-<UTC timestamp>")
    model: AnyModelConfig = Field(default_factory=GPTConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> JobSpec:
        check_finite(raw)  # before pydantic, whose range checks would word a NaN as out of range
        try:
            spec = cls.model_validate(raw)
        except ValidationError as exc:
            raise _first_error(exc) from None
        check_finite(spec)  # strings such as "inf" become floats in validation
        check_no_bool_numbers(raw, spec)
        spec.check()
        return spec

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> JobSpec:
        raw = read_yaml(path, "config")
        if raw is None:  # empty, or only comments and blank lines: a truncated file or a wrong path
            raise SpecError(
                "config",
                f"{path} is empty (no keys, only whitespace or comments); "
                "write at least `name: ...` to run with the defaults",
            )
        if not isinstance(raw, dict):
            raise SpecError("config", f"{path} must hold a mapping at the top level")
        apply_overrides(raw, overrides or [])
        return cls.from_dict(raw)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        m, p, e, t = self.model, self.parallel, self.elastic, self.train
        m.check()  # per kind; a custom model's factory is imported and called here
        validate_layout(m, p.tp, p.pp, p.ep, p.cp)
        self.data.check_source_exists()
        check_sizes(self)
        if e.min_dp > e.max_dp:
            raise SpecError("elastic.min_dp", f"{e.min_dp} is larger than elastic.max_dp ({e.max_dp})")
        if e.sdc_check_every and p.zero:
            raise SpecError(
                "elastic.sdc_check_every",
                f"needs replicated parameters (parallel.zero: 0); with zero={p.zero} no two ranks hold the same shard",
            )
        if p.shard_group is not None:
            self._check_shard_group(p.shard_group)
        self._check_eval()
        if self.resources.device == "cuda" and self.resources.gpus_per_worker <= 0:
            raise SpecError("resources.gpus_per_worker", "must be > 0 when resources.device is cuda")
        if not self.allowed_dps():
            raise SpecError(
                "train.global_batch",
                f"{t.global_batch} is not reachable: no DP degree in [{e.min_dp}, {e.max_dp}] divides "
                f"global_batch / parallel.micro_batch ({t.global_batch} / {p.micro_batch})"
                + (f" in dp x parallel.ep ({p.ep}) data shards" if p.ep > 1 else ""),
            )

    def _check_eval(self) -> None:
        """``data.eval_source`` and ``train.eval_every`` come together, on a layout whose
        eval is built (no pipeline or context parallelism)."""
        source, every = self.data.eval_source, self.train.eval_every
        if source is not None and source == "synthetic":
            raise SpecError("data.eval_source", "must be a corpus (a path or parquet URI), not synthetic")
        if every and source is None:
            raise SpecError("train.eval_every", f"is {every}: set data.eval_source, the corpus to evaluate")
        if source is not None and not every:
            raise SpecError("train.eval_every", "data.eval_source is set: give the steps between evals (> 0)")
        if every and self.parallel.pp > 1:
            raise SpecError("train.eval_every", f"eval under parallel.pp={self.parallel.pp} is not built (pp: 1)")
        if every and self.parallel.cp > 1:
            raise SpecError("train.eval_every", f"eval under parallel.cp={self.parallel.cp} is not built (cp: 1)")

    def _check_shard_group(self, group: int) -> None:
        p, e = self.parallel, self.elastic
        if p.zero < 1:
            raise SpecError("parallel.shard_group", "needs FSDP (parallel.zero >= 1): with zero 0 nothing is sharded")
        if p.ep > 1 or p.cp > 1 or getattr(self.model, "moe", None) is not None:
            other = "parallel.ep above 1" if p.ep > 1 else "parallel.cp above 1" if p.cp > 1 else "model.moe"
            raise SpecError("parallel.shard_group", f"HSDP does not combine with {other} (unset one of them)")
        if group > e.max_dp:
            raise SpecError(
                "parallel.shard_group", f"{p.shard_group} is larger than elastic.max_dp ({e.max_dp}): no group fits"
            )
        plain = batch.allowed_dps(self.train.global_batch, p.micro_batch, e.min_dp, e.max_dp, p.ep)
        if plain and not self.allowed_dps():  # (no DP degree at all is train.global_batch's error)
            raise SpecError(
                "parallel.shard_group",
                f"no DP degree in [{e.min_dp}, {e.max_dp}] is a multiple of {p.shard_group} that also divides "
                f"global_batch / micro_batch ({self.train.global_batch} / {p.micro_batch})",
            )

    def allowed_dps(self) -> list[int]:
        """DP degrees that keep ``global_batch`` exact (``elastic.parallel.batch.allowed_dps``),
        in whole HSDP shard groups when ``parallel.shard_group`` is set."""
        p, e = self.parallel, self.elastic
        return batch.allowed_dps(
            self.train.global_batch, p.micro_batch, e.min_dp, e.max_dp, p.ep, multiple_of=p.shard_group or 1
        )

    def grad_accum(self, dp: int) -> int:
        return batch.grad_accum(self.train.global_batch, self.parallel.micro_batch, dp, self.parallel.ep)

    # ------------------------------------------------------------------ schema
    @classmethod
    def json_schema(cls) -> str:
        return json.dumps(cls.model_json_schema(by_alias=True), indent=2, sort_keys=True)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    """Apply dotted ``key=value`` overrides; values are parsed as YAML."""
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            value = load_yaml(text)
        except DuplicateKey as exc:
            raise SpecError(f"{key}.{exc.path}", "given twice in the --set value; keep one") from None
        except yaml.YAMLError as exc:
            raise SpecError(key, f"value {text!r} is not valid YAML: {_one_line(exc)}") from None
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(".".join(parts[: i + 1]), "is not a mapping, cannot set a sub-key")
            node = child
        node[parts[-1]] = value


def _first_error(exc: ValidationError) -> SpecError:
    err = exc.errors()[0]
    loc = list(err["loc"])
    if loc[:1] == ["model"] and len(loc) > 1 and loc[1] in MODEL_KINDS:
        del loc[1]  # the union's tag (model.llama.n_kv_heads -> model.n_kv_heads)
    if loc[:2] == ["train", "optimizer"] and len(loc) > 2 and loc[2] in ("adamw", "sgd"):
        del loc[2]  # the same for train.optimizer (train.optimizer.sgd.momentum)
    if err["type"] == "model_kind":
        loc = ["model", "kind"]
    field = ".".join(str(p) for p in loc) or "spec"
    if err["type"] == "extra_forbidden":
        return SpecError(field, "unknown key")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], (dict, list)):
        got = repr(err["input"])
        msg = f"{msg} (got {got if len(got) <= 60 else got[:57] + '...'})"
    return SpecError(field, msg)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
