"""``ModelSpec``: everything the engine needs to know about a model, in one small object.

It lives below ``elastic/models/`` (which builds specs) and ``elastic/parallel/`` (which
applies them), as torchtitan's ``protocols/``: neither package imports the other for it.

In the manner of torchtitan's ``TrainSpec``: the engine never looks inside a model, it
calls the spec. A spec is bound to one model config (``elastic.models.spec.model_spec(cfg)``, the
registry); a user's factory (``model.kind: custom``) returns one directly. See docs/models.md.

The contract the engine relies on:

* ``build()`` returns the full model; the engine calls it under ``torch.device("meta")``,
  so it must allocate nothing real. ``init_weights(model, seed)`` then fills the
  materialised (possibly pipeline-cut, possibly TP-sharded) model. ``seeded_init`` gives
  every parameter its own generator seeded by ``(seed, FQN)`` and writes the full value
  into whatever shard a rank holds: the weights depend on the seed only, never on the
  layout, which is what makes every layout (and every elastic resize) train the same model.
* ``blocks(model)`` lists the repeated units: the grain of FSDP, activation checkpointing
  and ``torch.compile``.
* ``tp_plan(model, tp_mesh)`` shards it in place (``None``: no tensor parallelism).
* ``ep_plan(model, dims)`` shards its experts over ``dims.expert_shard_mesh`` and returns
  the expert modules (``None``: no experts); ``cp_plan(model, cp_mesh)`` makes its
  attention context-parallel (``None``: no context parallelism). See docs/parallelism.md.
* ``set_loss_scale(model, scale)`` tells a model with auxiliary losses injected in backward
  (the MoE balance loss) the factor the engine applies to each micro-batch's loss.
* ``split_stage(model, pp, pp_rank)`` keeps only stage ``pp_rank``, without renaming any
  parameter (``None``: no pipeline parallelism). Checkpoints are keyed by FQN.
* ``loss_fn(outputs, targets)`` is the mean loss of a micro-batch over its targets other
  than -100 (SFT rows mark the targets that do not count so; ``lm_loss`` skips them); it
  runs inside ``loss_context(tp)`` (e.g. torch's ``loss_parallel``).
* ``documents``: the model's forward takes ``document_ids=`` (``[b, s]``, rows packed from
  several documents: ``elastic/models/documents.py``); a corpus with that column needs it.
* ``flops_per_token`` (training, forward + backward) feeds MFU; ``memory`` the memory model.
* ``check_layout(tp, pp)`` refuses what the model cannot do, naming the spec field.
* ``hf`` maps the model to and from a Hugging Face model (``model.init_from``, ``elastic
  ckpt export --format hf``): its ``config.json``, tensor names and RoPE row layout
  (``HFAdapter``, below; ``None``: neither is possible).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from elastic.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from elastic.protocols.hf_adapter import HFAdapter
    from elastic.protocols.memory import MemoryInputs


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the micro-batch's targets (those of -100 skipped)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """``model.blocks`` (a ModuleDict or ModuleList) if the model has one, else no blocks."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return []


def _no_context(tp: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# The model class a spec builds: every hook below takes the model that ``build`` returned.
M = TypeVar("M", bound=nn.Module)


@dataclass
class ModelSpec(Generic[M]):
    name: str
    build: Callable[[], M]
    init_weights: Callable[[M, int], None]
    vocab_size: int
    seq_len: int
    flops_per_token: float = 0.0
    blocks: Callable[[M], list[nn.Module]] = default_blocks
    tp_plan: Callable[[M, DeviceMesh], Any] | None = None
    split_stage: Callable[[M, int, int], nn.Module] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    loss_context: Callable[[int], contextlib.AbstractContextManager] = _no_context
    validate_layout: Callable[..., None] | None = None
    memory: MemoryInputs | None = None
    hf: HFAdapter | None = None
    ep_plan: Callable[[M, Any], list[nn.Module]] | None = None
    cp_plan: Callable[[M, DeviceMesh], Any] | None = None
    set_loss_scale: Callable[[M, float], None] | None = None
    documents: bool = False  # its forward takes ``document_ids=`` (packed rows: elastic/models/documents.py)
    extra: dict[str, Any] = field(default_factory=dict)

    def check_layout(self, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
        """Refuse a layout the model cannot run, with the spec field at fault.

        ``validate_layout`` is called as ``(tp, pp)``, and with ``ep=``/``cp=`` keywords only
        when one of them is above 1 (a model with an ``ep_plan`` or ``cp_plan`` takes them).
        """
        if tp > 1 and self.tp_plan is None:
            raise SpecError("parallel.tp", f"model {self.name!r} has no TP plan; it needs parallel.tp=1 (got {tp})")
        if pp > 1 and self.split_stage is None:
            raise SpecError("parallel.pp", f"model {self.name!r} has no stage split; it needs parallel.pp=1 (got {pp})")
        if ep > 1 and self.ep_plan is None:
            raise SpecError("parallel.ep", f"model {self.name!r} has no experts to shard; it needs parallel.ep=1")
        if cp > 1 and self.cp_plan is None:
            raise SpecError(
                "parallel.cp", f"model {self.name!r} has no context-parallel attention; it needs parallel.cp=1"
            )
        if self.validate_layout is not None:
            if ep == 1 and cp == 1:
                self.validate_layout(tp, pp)
            else:
                self.validate_layout(tp, pp, ep=ep, cp=cp)

    def build_full(self, seed: int, device: str | torch.device = "cpu") -> nn.Module:
        """The whole model, materialised on ``device`` and initialised (a reference run)."""
        with torch.device("meta"):
            model = self.build()
        model.to_empty(device=device)
        self.init_weights(model, seed)
        return model
