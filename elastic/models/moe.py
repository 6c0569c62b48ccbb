"""``model.kind: llama`` with ``model.moe``: the Llama decoder with a routed mixture of experts.

Every block's SwiGLU MLP becomes a mixture of ``n_experts`` SwiGLU experts, each token
sent to the ``top_k`` experts with the highest router scores (softmax or sigmoid of a
linear router, as Mixtral / Qwen-MoE and DeepSeek-V3 respectively), their outputs summed
with the scores as weights (rescaled to sum to 1 with ``norm_topk_prob``), plus an
optional shared expert that every token uses (DeepSeek-MoE, Dai et al. 2024).

Choices that keep the model one function under every layout (docs/models.md):

* **dropless**: no capacity factor, no token dropped or padded: a token's output depends
  on that token only, never on which others share its micro-batch or its rank;
* **per-sequence balance loss**: the load-balancing loss (Switch's ``E * sum_e f_e P_e``,
  Fedus et al. 2021) is taken per sequence, as DeepSeek-V3's sequence-wise balance loss,
  and averaged over sequences, so it is the same for any micro-batching; under CP the
  per-sequence counts and probabilities are summed over the CP group first;
* the balance loss enters through the gradient only (Megatron's "aux loss auto-scaler"):
  each MoE layer adds ``aux_loss_coef * scale`` to its loss's gradient in backward, where
  ``scale`` is the factor the engine applies to a micro-batch's loss (``set_loss_scale``).
  That works on every pipeline stage, where no stage but the last sees the loss. The
  reported loss is the language-model cross entropy.

Parameters (FQNs under ``blocks.<i>.mlp``): ``router.weight`` ``[E, d]``, ``experts.w1`` and
``experts.w3`` ``[E, d, h]``, ``experts.w2`` ``[E, h, d]`` (one tensor per kind, the expert
dimension first, so expert parallelism shards dimension 0), ``shared.w1/w2/w3.weight``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from elastic.models.config import LlamaConfig
from elastic.models.documents import Documents
from elastic.models.hf_families import hf_adapter
from elastic.models.llama import NORMS, Attention, Llama, RMSNorm, attention_plan, build_stage
from elastic.models.spec import ModelSpec, lm_loss, register_variant, seeded_init
from elastic.parallel import ep as ep_comm

if TYPE_CHECKING:
    from elastic.parallel.cp import ContextParallel


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts as three ``[E, ...]`` tensors (this rank's slice under EP/TP)."""

    TP_DIMS = {"w1": 2, "w3": 2, "w2": 1}  # the hidden dimension, split by expert TP

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    def forward(self, x: torch.Tensor, counts: list[int], ctx: ep_comm.ExpertParallel | None) -> torch.Tensor:
        """``x`` sorted by (local) expert, ``counts[e]`` rows each -> the experts' outputs, same order."""
        factor = 1.0 / ctx.size if ctx is not None else 1.0
        w1, w2, w3 = (ep_comm.scale_grad(_local(w), factor) for w in (self.w1, self.w2, self.w3))
        tp_group = ctx.tp_group if ctx is not None else None
        x = ep_comm.copy_to_tp(x, tp_group)
        outs = [
            (F.silu(xe @ w1[e].to(xe.dtype)) * (xe @ w3[e].to(xe.dtype))) @ w2[e].to(xe.dtype)
            for e, xe in enumerate(x.split(counts))
        ]
        return ep_comm.reduce_from_tp(torch.cat(outs), tp_group)


class _AddAuxGrad(torch.autograd.Function):
    """Identity on the layer output; in backward, gives the balance loss the gradient ``weight``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


def balance_loss(probs: torch.Tensor, top_i: torch.Tensor, cp: Any) -> torch.Tensor:
    """Per-sequence ``E * sum_e f_e P_e``, averaged over the sequences of the micro-batch.

    ``probs`` ``[b, s, E]`` (each token's scores, summing to 1), ``top_i`` ``[b, s, k]``. ``f_e``:
    the share of the sequence's ``s * k`` assignments that went to ``e``; ``P_e``: the mean
    probability of ``e``. Under CP both are summed over the sequence's chunks first. (For
    the gradient one sum would do: ``f`` carries none, and the all-reduce's backward sums
    every chunk's ``f``; both make the value the whole sequence's on every chunk.)
    """
    b, s, n_experts = probs.shape
    k = top_i.shape[-1]
    chosen = torch.zeros(b, n_experts, device=probs.device, dtype=probs.dtype)
    chosen.scatter_add_(1, top_i.reshape(b, -1), torch.ones(b, s * k, device=probs.device, dtype=probs.dtype))
    prob_sum = probs.sum(1)
    tokens = s
    if cp is not None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        dist.all_reduce(chosen, group=cp.group)
        prob_sum = funcol.all_reduce(prob_sum, "sum", cp.group)  # backward: the sum of every chunk's gradient
        tokens *= cp.size
    return n_experts * ((chosen / (tokens * k)) * (prob_sum / tokens)).sum(-1).mean()


class MoE(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        moe = cfg.moe_config()
        self.n_experts, self.top_k, self.router_kind = moe.n_experts, moe.top_k, moe.router
        self.norm_topk_prob, self.aux_loss_coef = moe.norm_topk_prob, moe.aux_loss_coef
        self.router = nn.Linear(cfg.d_model, moe.n_experts, bias=False)
        self.experts = GroupedExperts(moe.n_experts, cfg.d_model, cfg.expert_hidden)
        self.shared = SwiGLU(cfg.d_model, cfg.expert_hidden) if moe.shared_expert else None
        self.ep: ep_comm.ExpertParallel | None = None  # set by ``apply_ep``
        self.cp: ContextParallel | None = None  # set by ``apply_cp``: the balance loss sums over the chunks
        self.loss_scale = 1.0  # the engine's factor on a micro-batch's loss (``set_loss_scale``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        scores = self.router(flat).float()
        scores = scores.softmax(-1) if self.router_kind == "softmax" else scores.sigmoid()
        top_w, top_i = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = self._routed(flat, top_i, top_w).view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = balance_loss(probs.view(b, s, -1), top_i.view(b, s, -1), self.cp)
            out = _AddAuxGrad.apply(out, aux, self.aux_loss_coef * self.loss_scale)
        return out

    def _routed(self, flat: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Each token through its ``top_k`` experts (wherever they live), weighted and summed."""
        n, k = top_i.shape
        expert_of_copy = top_i.reshape(-1)
        order = torch.argsort(expert_of_copy, stable=True)  # token copies grouped by expert
        copies = flat[order // k]
        counts = torch.bincount(expert_of_copy, minlength=self.n_experts)
        ctx = self.ep
        if ctx is not None and ctx.size > 1:
            local, local_counts, plan = ep_comm.dispatch(copies, counts, ctx)
            outputs = ep_comm.combine(self.experts(local, local_counts, ctx), plan, ctx)
        else:
            outputs = self.experts(copies, counts.tolist(), ctx)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        per_copy = outputs[back].view(n, k, -1)
        return (per_copy * top_w.unsqueeze(-1).to(per_copy.dtype)).sum(1)


class MoEBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), docs)
        return x + self.mlp(self.mlp_norm(x))


def moe_layers(model: Llama) -> list[MoE]:
    """Every block's MoE layer (a MoE Llama is built of ``MoEBlock``s only)."""
    return [cast(MoEBlock, block).mlp for block in model.blocks.values()]


def init_rule(n_layers: int):
    """Ones for norms, N(0, 0.02) else, N(0, 0.02 / sqrt(2 L)) into the residual stream."""
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    residual = ("wo.weight", "w2.weight", "experts.w2")

    def value(fqn: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        if fqn.endswith(NORMS):
            return torch.ones(shape)
        if fqn.endswith("bias"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=gen) * (residual_std if fqn.endswith(residual) else 0.02)

    return value


def apply_tp(model: Llama, tp_mesh) -> Llama:
    """Attention and the shared expert as in the dense Llama; routed experts are split by ``apply_ep``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from elastic.parallel.tp import apply_block_plan, apply_vocab_parallel

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = attention_plan(model.cfg.qk_norm)
    if model.cfg.moe_config().shared_expert:
        plan.update({"mlp.shared.w1": col, "mlp.shared.w3": col, "mlp.shared.w2": row})
    apply_block_plan(list(model.blocks.values()), tp_mesh, plan)
    if model.cfg.vocab_size % tp_mesh.size() == 0:
        apply_vocab_parallel(model.tok_emb, model.head, tp_mesh)
    return model


def apply_ep(model: Llama, dims: Any) -> list[nn.Module]:
    """Shard every layer's experts over EP (and their hidden dimension over TP); returns them."""
    ctx = ep_comm.expert_context(dims, model.cfg.moe_config().n_experts)
    experts: list[nn.Module] = []
    for layer in moe_layers(model):
        if dims.expert_shard_mesh is not None:
            ep_comm.distribute_experts(layer.experts, dims, GroupedExperts.TP_DIMS)
        layer.ep = ctx
        experts.append(layer.experts)
    return experts


def apply_moe_cp(model: Llama, cp_mesh) -> Llama:
    """Context-parallel attention, and balance losses summed over each sequence's chunks."""
    from elastic.parallel.cp import apply_cp

    ctx = apply_cp(model.attentions(), cp_mesh)
    for layer in moe_layers(model):
        layer.cp = ctx
    return model


def set_loss_scale(model: Llama, scale: float) -> None:
    for layer in moe_layers(model):
        layer.loss_scale = scale


def moe_spec(cfg: LlamaConfig) -> ModelSpec:
    from elastic.parallel.tp import loss_context

    return ModelSpec(
        name="llama-moe",
        build=lambda: Llama(cfg, block=MoEBlock),
        init_weights=lambda model, seed: seeded_init(model, seed, init_rule(cfg.n_layers)),
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        flops_per_token=cfg.flops_per_token(),
        tp_plan=apply_tp,
        split_stage=build_stage,
        loss_fn=lm_loss,
        loss_context=lambda tp: loss_context(tp > 1 and cfg.vocab_size % tp == 0),
        validate_layout=cfg.validate_layout,
        memory=cfg.memory_inputs(),
        ep_plan=apply_ep,
        cp_plan=apply_moe_cp,
        documents=True,
        set_loss_scale=set_loss_scale,
        hf=hf_adapter(cfg),
    )


register_variant("llama", lambda cfg: getattr(cfg, "moe", None) is not None, moe_spec)  # model.moe
