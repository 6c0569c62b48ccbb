"""The terms of the memory model, one function each, for one pipeline stage (pure arithmetic).

``memory_model.estimate_memory`` builds a ``StageContext`` per stage and calls
``stage_estimate``; ``memory_moe.py`` (experts, EP, CP) shares ``STATE_BYTES`` and
``layers_per_stage``. The account of every term, and how each was measured, is in
docs/sweep.md ("How the memory model counts"). Runs wherever a spec is checked.

A stage's bytes are ``state + buffers + pipeline + the largest of three moments``:

* **state**: parameters, gradients and optimizer state as the engine keeps them
  (``parallelize.py``: classic DDP, ``replicate`` or FSDP2 at the ZeRO level);
* **buffers**: the copies kept through the step: DDP's buckets, ``replicate``'s and FSDP2's
  unsharded parameters, autocast's 16-bit weights; when backward ends, one unit's
  reduction buffers too;
* **pipeline**: ``PipelineStage``'s receive buffers, one per micro-batch of the step for
  activations (every stage but the first) and for their gradients (every stage but the
  last), allocated once and kept, plus the stage outputs kept for backward;
* the moments: backward starts (every micro-batch in flight stored, the loss's
  gradients), a layer's backward (its weight gradients, the gradients of its
  activations, a recomputed layer), backward ends (every gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.protocols.memory import LayerActivations, MemoryInputs, StageContext

# Optimizer state bytes per fp32 parameter: AdamW's two moments, SGD's momentum buffer,
# plain SGD (momentum 0) none.
STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "sgd_plain": 0}
# The loss on the last stage, bytes per token and vocabulary entry (all fp32: the loss
# upcasts): the log-probabilities cross_entropy keeps for backward; when backward starts,
# their gradient and the logits' gradient (torch's loss_parallel fuses the two: one).
LOGP_BYTES, LOSS_GRAD_BYTES, LOSS_PARALLEL_GRAD_BYTES = 4, 8, 4


@dataclass(frozen=True)
class StageTerms:
    """The bytes of one stage, as ``MemoryEstimate`` reports them."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    pipeline: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.pipeline + self.activations + self.logits


def layers_per_stage(n_layers: int, pp: int) -> list[int]:
    """Layers of each pipeline stage; the first ``n_layers % pp`` stages get one more."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def ceil_div(num: float, den: int) -> int:
    return -(-int(round(num)) // den)


def vocab_split(m: MemoryInputs, tp: int) -> int:
    """How many ways the embedding, head and logits are split: ``tp`` where the TP plan
    shards them by vocabulary (``vocab_parallel`` and an even split), else 1."""
    if not m.vocab_parallel:
        return 1
    return tp if m.vocab_size % tp == 0 else 1


def root_split(m: MemoryInputs, tp: int) -> int:
    """The TP split of the ``first_split``/``last_split`` parameters."""
    return vocab_split(m, tp) if m.vocab_parallel else tp


def stage_params(m: MemoryInputs, ctx: StageContext) -> tuple[int, int, int]:
    """(parameters on this rank, of one block, autocast-cast ones) for the stage at its TP split."""
    block = ceil_div(m.block_split, ctx.tp) + m.block_whole
    n = ctx.layers * block
    split = root_split(m, ctx.tp)
    cast = ctx.layers * ceil_div(m.block_split, ctx.tp)  # the blocks' linear weights
    if ctx.stage == 0:
        n += ceil_div(m.first_split, split) + m.first_whole
    if ctx.stage == ctx.pp - 1:
        n += ceil_div(m.last_split, split) + m.last_whole
        cast += ceil_div(m.last_split if m.head_params is None else m.head_params, split)
    return n + ctx.extra.param_count, block, cast


def embedding_grad(m: MemoryInputs, ctx: StageContext) -> tuple[int, int]:
    """(parameters of the embedding's gradient beyond its shard, of the whole gradient) on
    this rank: torch's DTensor embedding backward returns a replicated, full-size gradient
    even where the table is split by vocabulary (``embedding_grad_whole``)."""
    if ctx.stage != 0:
        return 0, 0
    split = root_split(m, ctx.tp)
    if not m.embedding_grad_whole or split == 1:
        return 0, ceil_div(m.first_split, split)
    return m.first_split - ceil_div(m.first_split, split), m.first_split


@dataclass(frozen=True)
class StateTerms:
    params: int  # stored parameters (FSDP: this rank's shards)
    grads: int  # every gradient, at the end of backward
    held: int  # gradients kept between micro-batches (accumulation)
    optimizer: int
    buffers: int  # kept through forward and backward: unsharded or 16-bit weight copies, DDP's buckets
    reduce: int  # allocated in backward while gradients are reduced: one unit's flat copy


def state_terms(m: MemoryInputs, ctx: StageContext) -> StateTerms:
    """Parameters, gradients, optimizer state and their copies, as the engine's DP wrapper
    at this ZeRO level keeps them (``parallelize.py``)."""
    n, block, cast = stage_params(m, ctx)
    k, c = ctx.param_bytes, ctx.compute_bytes
    state = STATE_BYTES[ctx.optimizer] + (4 if k < 4 else 0)  # + an fp32 master copy under 16-bit params
    extra = ctx.extra.buffer_bytes
    whole_emb = embedding_grad(m, ctx)[0] * k
    if ctx.fsdp:
        shard = min(ctx.dp, ctx.shard_group or ctx.dp)  # HSDP: sharded inside a group, replicated across
        params, opt = ceil_div(n * k, shard), ceil_div(n * state, shard)
        root = n - ctx.layers * block
        if ctx.zero == 3:  # one block gathered, the next prefetched, the root kept (reshard_after_forward=False)
            unsharded = (2 * block + root) * c
        else:  # every unit gathered once, kept until the last backward
            unsharded = n * c
        if ctx.zero == 1:  # unsharded gradients accumulate (in fp32), reduce-scattered once
            grads, reduce = n * k + whole_emb, block * k
        else:  # reduce-scattered each micro-batch into fp32 shards: a unit's grads in c, then fp32
            grads, reduce = ceil_div(n * k, shard), block * (c + k)
        return StateTerms(params, grads, grads, opt, unsharded + extra, reduce)
    params, grads, opt, buffers, reduce = n * k, n * k + whole_emb, n * state, extra, 0
    if ctx.dp > 1 and ctx.tp == 1 and ctx.pp == 1:
        buffers += n * k  # classic DDP: the reducer's buckets copy every gradient
    elif ctx.dp > 1:  # replicate (FSDP2's machinery): an unsharded copy of every parameter, one unit reduced at a time
        buffers, reduce = buffers + n * k, block * k
    if ctx.precision == "autocast":
        buffers += cast * c  # autocast caches a 16-bit copy of every linear weight for the whole step
    return StateTerms(params, grads, grads, opt, buffers, reduce)


def layer_bytes(acts: LayerActivations, m: MemoryInputs, ctx: StageContext) -> int:
    """All stored activations of one layer for one micro-batch on one rank (no recompute)."""
    tokens = ctx.tokens
    scores = m.act_scores * m.n_heads * m.seq_len * tokens * ctx.compute_bytes / 2  # a s^2 b, 16-bit coefficient
    return ceil_div(tokens * m.d_model * (acts.whole + acts.split / ctx.tp) + scores / ctx.tp, 1)


def stored_per_micro_batch(acts: LayerActivations, m: MemoryInputs, ctx: StageContext) -> tuple[int, int]:
    """(bytes a micro-batch keeps on this stage between its forward and backward, one layer
    rebuilt or consumed at a time in backward)."""
    residual = ceil_div(ctx.tokens * m.d_model * acts.residual, 1)
    layer = layer_bytes(acts, m, ctx)
    stored = ctx.layers * (residual if ctx.recompute else layer)
    if ctx.stage > 0:  # the first block's input is the receive buffer (counted in ``pipeline``)
        stored -= residual
    if ctx.stage == ctx.pp - 1:
        stored += ceil_div(ctx.tokens * m.d_model * acts.head, 1)  # final norm and head input
    return stored + ctx.extra.activation_bytes, layer


def loss_bytes(m: MemoryInputs, ctx: StageContext) -> tuple[int, int]:
    """(kept per micro-batch in flight, transient when backward starts) on the last stage."""
    if ctx.stage != ctx.pp - 1:
        return 0, 0
    split = vocab_split(m, ctx.tp)
    per_token = ctx.tokens * ceil_div(m.vocab_size, split)
    # Under PP the schedule keeps the stage output (the logits, in compute precision) for
    # backward; the engine drops its own reference before backward otherwise.
    kept = LOGP_BYTES + (ctx.compute_bytes if ctx.pp > 1 else 0)
    return per_token * kept, per_token * (LOSS_PARALLEL_GRAD_BYTES if split > 1 else LOSS_GRAD_BYTES)


def pipeline_bytes(m: MemoryInputs, ctx: StageContext, acts: LayerActivations) -> int:
    """``PipelineStage``'s buffers: activations received (all stages but the first) and their
    gradients (all but the last), one per micro-batch of the step; and the outputs of the
    micro-batches in flight, kept for backward (all but the last stage)."""
    if ctx.pp == 1:
        return 0
    one = ctx.tokens * m.d_model * acts.residual  # stage I/O is the residual stream, whole under TP
    received = (ctx.stage > 0) + (ctx.stage < ctx.pp - 1)
    outputs = ctx.in_flight if ctx.stage < ctx.pp - 1 else 0
    return ceil_div(one * (received * ctx.microbatches + outputs), 1)


def stage_estimate(m: MemoryInputs, ctx: StageContext, acts: LayerActivations) -> StageTerms:
    """The stage's bytes at its peak moment (see the module docstring)."""
    st = state_terms(m, ctx)
    stored, layer = stored_per_micro_batch(acts, m, ctx)
    kept, transient = loss_bytes(m, ctx)
    pipe = pipeline_bytes(m, ctx, acts)
    held = st.held if ctx.microbatches > 1 else 0  # earlier micro-batches' gradients
    rebuilt = layer if ctx.recompute else 0
    # While a layer's backward runs: its weight gradients (new, or a temporary to add to the
    # held ones) and the gradients of its activations (the MLP's hidden states).
    _, block, _ = stage_params(m, ctx)
    weights = block * ctx.param_bytes
    grad_acts = ceil_div(ctx.tokens * m.d_model * acts.backward / ctx.tp, 1)
    # When backward ends, the last weight gradient computed (the embedding's on the first
    # stage), new or a temporary added to the held one.
    last = max(block, embedding_grad(m, ctx)[1]) * ctx.param_bytes
    flight = ctx.in_flight
    phases = [  # (grads, buffers, activations, loss) at the candidate peaks
        (held, 0, flight * stored, flight * kept + transient),  # backward starts: the loss's gradients
        (held + weights, 0, flight * stored + rebuilt + grad_acts, (flight - 1) * kept),  # a layer's backward
        (st.grads + last, st.reduce, (flight - 1) * stored + layer, (flight - 1) * kept),  # backward ends
    ]
    g, reduce, a, loss = max(phases, key=sum)
    return StageTerms(st.params, g, st.optimizer, st.buffers + reduce, pipe, a, loss)
