"""Memory-model terms of mixture-of-experts models and of expert and context parallelism.

Pure arithmetic, called from ``elastic.parallel.memory_model.estimate_memory`` (one hook) when a
layout has ``ep`` or ``cp`` above 1 or the model has experts. The dense part of the
model goes through the same formulas as any model, with three changes, and the experts
are added on top:

* **CP**: every rank holds ``s / cp`` tokens of each sequence, so the dense estimate runs
  at sequence length ``s / cp`` (activations and the last stage's log-probabilities
  shrink by ``cp``); the attention's all-gathered keys and values are the whole
  sequence's and are kept for backward: ``2 * s * b * d / tp`` values per layer (after
  the grouped-query repeat; the rank's own chunk is already in the dense figure), so
  ``(1 - 1/cp)`` of that is added.
* **ZeRO over dp x ep x cp**: dense parameters, gradients and optimizer state are sharded
  (and their DP buffers reduced) over ``dp * ep * cp`` ranks (``ParallelDims.dense_mesh``).
* **Experts**: a rank holds ``n_experts / ep`` experts per layer, their hidden dimension
  split by TP: ``3 * d * h / tp`` parameters each, sharded by ZeRO over the ``dp * cp``
  ranks holding the same experts (``expert_mesh``). With ZeRO-3, one layer's experts are
  all-gathered at a time (a buffer of that size). Where the experts are data parallel
  (``dp * cp > 1``, or classic DDP) the wrapper's reduction input holds a copy of all of
  the rank's expert gradients at the peak: measured, not only one unit's as for the dense
  blocks (the expert units sit inside the blocks' units and are reduced with them).
* **Router and all-to-all activations** are per token and part of the model's
  ``MemoryInputs`` (``LlamaConfig.memory_inputs``): the router's scores (``n_experts``
  fp values per token, kept whole under TP), the ``top_k`` token copies sent to the
  experts and their outputs coming back (kept for the expert matmuls and the weighting,
  whole under TP: every TP rank holds the same tokens), and the experts' four SwiGLU
  intermediates per copy (split by TP). The all-to-all's send and receive buffers are
  transient (freed before backward starts, where the peak is) and so not counted; routing
  is assumed balanced (each rank's experts receive ``top_k`` copies per local token on
  average).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from elastic.parallel.memory_terms import STATE_BYTES, layers_per_stage
from elastic.protocols.memory import ExpertMemory


def estimate_moe_cp(estimate: Any, inputs: Any, *, tp: int, pp: int, dp: int, ep: int, cp: int, **kw: Any) -> Any:
    """``estimate`` (``estimate_memory``) for a layout with experts, ``ep`` or ``cp``.

    ``inputs`` is the model's ``MemoryInputs``; ``kw`` the other arguments of
    ``estimate_memory`` (zero, micro_batch, dtype_bytes, ...). Returns its ``MemoryEstimate``.
    """
    experts: ExpertMemory | None = inputs.experts
    per_layer_experts = experts.params if experts is not None else 0
    dense = replace(
        inputs, seq_len=inputs.seq_len // cp, block_split=inputs.block_split - per_layer_experts, experts=None
    )
    base = estimate(dense, tp=tp, pp=pp, dp=dp * ep * cp, ep=1, cp=1, **kw)
    zero, micro_batch = kw.get("zero", 0), kw.get("micro_batch", 1)
    dtype_bytes = kw.get("dtype_bytes", 4)
    act_bytes = kw.get("compute_dtype_bytes") or dtype_bytes
    layers = layers_per_stage(inputs.n_layers, pp)[base.stage]
    # The all-gathered keys and values of every stored layer, beyond the rank's own chunk.
    kv = 0
    if cp > 1 and base.activations:
        in_flight = _in_flight(base, kw, pp)
        kv = 2 * inputs.seq_len * micro_batch * (inputs.d_model // tp) * act_bytes * (cp - 1) // cp
        kv *= layers * in_flight
    classic_ddp = zero == 0 and dp > 1 and tp == pp == ep == cp == 1
    expert_dp = dp * cp
    ex = _expert_state(per_layer_experts, layers, tp, ep, expert_dp, zero, dtype_bytes, kw.get("optimizer", "adamw"))
    if classic_ddp or expert_dp > 1:  # the DP wrapper's copy of the experts' gradients (see the docstring)
        ex = (*ex[:3], ex[3] + layers * -(-per_layer_experts // (ep * tp)) * dtype_bytes)
    params, grads, opt, buffers = ex
    grads = grads if base.grads else 0  # experts' gradients are held where the dense ones are
    return replace(
        base,
        params=base.params + params,
        grads=base.grads + grads,
        optimizer=base.optimizer + opt,
        buffers=base.buffers + buffers,
        activations=base.activations + kv,
        total=base.total + params + grads + opt + buffers + kv,
    )


def _expert_state(
    per_layer: int, layers: int, tp: int, ep: int, expert_dp: int, zero: int, dtype_bytes: int, optimizer: str
) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, buffers) bytes of this rank's experts on one stage."""
    if not per_layer:
        return 0, 0, 0, 0
    local_layer = -(-per_layer // (ep * tp))
    n = layers * local_layer
    state_bytes = STATE_BYTES[optimizer] + (4 if dtype_bytes < 4 else 0)
    shard = expert_dp if expert_dp > 1 else 1
    params = -(-n * dtype_bytes // (shard if zero >= 3 else 1))
    grads = -(-n * dtype_bytes // (shard if zero >= 2 else 1))
    opt = -(-n * state_bytes // (shard if zero >= 1 else 1))
    buffers = local_layer * dtype_bytes if zero >= 3 and shard > 1 else 0  # one layer's experts gathered
    return params, grads, opt, buffers


def _in_flight(base: Any, kw: dict[str, Any], pp: int) -> int:
    micro = kw.get("num_microbatches") or pp
    return min(pp - base.stage, micro) if kw.get("pp_schedule", "1f1b") == "1f1b" else micro
