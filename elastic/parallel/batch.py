"""The batch rule, shared by the controller, the workers and the data stream.

Documented choice: DP is restricted to degrees that divide ``global_batch / micro_batch``,
as DeepSpeed's elasticity does. Every rank then gets the same number of whole
micro-batches, ``grad_accum = global_batch / (micro_batch * dp)``, and the loss needs no
per-rank weighting: the global batch and the loss scale are exact at every DP degree.
Pure functions, tested without Ray.
"""

from __future__ import annotations

from elastic.errors import SpecError


def allowed_dps(global_batch: int, micro_batch: int, min_dp: int, max_dp: int, ep: int = 1) -> list[int]:
    """DP degrees in ``[min_dp, max_dp]`` that keep ``global_batch`` exact.

    Each replica reads ``ep`` data shards (its expert-parallel ranks train on different
    micro-batches), so the batch is split ``dp * ep`` ways.
    """
    if global_batch % micro_batch:
        return []
    micro = global_batch // micro_batch
    return [dp for dp in range(min_dp, max_dp + 1) if micro % (dp * ep) == 0]


def grad_accum(global_batch: int, micro_batch: int, dp: int, ep: int = 1) -> int:
    """Micro-batches per data shard (``dp * ep`` of them) per optimizer step; the global batch must be exact."""
    per = micro_batch * dp * ep
    if global_batch % per:
        shards = f"dp*micro_batch = {dp}*{micro_batch}" if ep == 1 else f"dp*ep*micro_batch = {dp}*{ep}*{micro_batch}"
        raise SpecError("train.global_batch", f"global_batch={global_batch} is not a multiple of {shards}")
    return global_batch // per
