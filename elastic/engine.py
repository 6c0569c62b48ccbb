"""``TrainEngine``: the one object a worker trains with, whatever the parallel layout.

A worker hands it the micro-batches of its DP rank; the engine decides what each rank
does with them (the first pipeline stage reads the inputs, the last the targets), and
returns the loss as the mean over the whole global batch on every rank. After a resize,
construct a new engine with the new ``ParallelDims`` (after re-initialising the process
group) and load the resharded state into it; nothing here outlives the engine.

Loss and gradient scaling. Every micro-batch loss is the mean over its tokens and all
micro-batches have ``micro_batch * seq_len`` tokens, so the global mean is the mean of
micro-batch means. Each micro-batch contributes ``grad(loss) / grad_accum`` (the
pipeline schedule does the same division itself), and DDP/FSDP average over the DP
degree: the accumulated gradient is that of the global mean. With EP and CP the data
shards are ``dp x ep`` and each CP rank sees an equal chunk of its shard's sequences, so
losses and dense gradients are averaged over ``dp x ep x cp`` (``ParallelDims.dense_mesh``;
experts: see elastic/parallel/ep.py).

SFT rows (micro-batches of three: inputs, targets, document ids) count only some targets
(the others are ``IGNORE``), so micro-batches differ in their counts. The step's loss is
then the mean over the counted targets of the whole global batch: the ranks first sum their
counts over the DP group (``N``, one small all-reduce), and micro-batch ``i`` with ``c_i``
counted targets and mean loss ``l_i`` contributes ``l_i * c_i * dense_dp * grad_accum / N``
where it contributed ``l_i`` before. The division by ``grad_accum`` and DP's average then
leave ``sum_i l_i * c_i / N``: exact at any DP degree and gradient accumulation.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from elastic.ingest.sft_rows import IGNORE
from elastic.models.spec import ModelSpec, model_spec
from elastic.optim import TrainConfig, build_optimizer
from elastic.parallel import ddp, fsdp, memtrack, pp
from elastic.parallel.clip import clip_grad_norm
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import ParallelDims
from elastic.parallel.live import LiveState, keeps_module, rewrap
from elastic.parallel.parallelize import parallelize, required_plan
from elastic.parallel.tp import to_local_value

# (inputs, targets), or SFT rows' (inputs, targets, document_ids or None): targets that do not
# count are IGNORE (elastic/ingest/sft_rows.py), and the loss is the mean over the counted ones.
MicroBatch = tuple[torch.Tensor, ...]


class TrainEngine:
    def __init__(
        self,
        model_cfg: Any,
        parallel_cfg: ParallelConfig,
        train_cfg: TrainConfig,
        dims: ParallelDims,
        seed: int,
        device: str | torch.device = "cpu",
        restoring: bool = False,
        adopt: LiveState | None = None,
    ):
        got = (parallel_cfg.tp, parallel_cfg.pp, parallel_cfg.ep, parallel_cfg.cp)
        if got != (dims.tp, dims.pp, dims.ep, dims.cp):
            raise ValueError(f"parallel config tp/pp/ep/cp {got} != dims {(dims.tp, dims.pp, dims.ep, dims.cp)}")
        if getattr(parallel_cfg, "shard_group", None) != dims.shard_group:
            raise ValueError(f"parallel config shard_group {parallel_cfg.shard_group} != dims {dims.shard_group}")
        self.spec: ModelSpec = model_spec(model_cfg)  # a model config, or a ModelSpec itself
        self.spec.check_layout(dims.tp, dims.pp, dims.ep, dims.cp)
        self.model_cfg, self.parallel_cfg, self.train_cfg, self.dims = model_cfg, parallel_cfg, train_cfg, dims
        self.grad_accum = dims.grad_accum(train_cfg.global_batch, parallel_cfg.micro_batch)
        self.device = _resolve_device(device)
        if not dims.mesh_built:
            dims.build_mesh(self.device.type)
        self.coords = dims.local_coords()

        self.dtype = train_cfg.resolved_dtype(self.device.type)
        bf16 = self.dtype == "bf16"

        # ``build_timings``: where the build's time went (logged by the worker on a re-formation).
        self.build_timings: dict[str, float] = {}
        if adopt is not None and adopt.module is not None and keeps_module(parallel_cfg, dims):
            # A survivor's own module, optimizer and schedule (parallel/live.py): only DDP is new.
            t0 = time.perf_counter()
            self.module = self.gpt = adopt.module
            self.model = rewrap(adopt.module, dims)
            self.optimizer, self.scheduler = adopt.optimizer, adopt.scheduler
            self.optimizer.zero_grad(set_to_none=True)  # a step the failure cut short left gradients behind
            self.build_timings["wrap_s"] = time.perf_counter() - t0
        else:
            self._build(seed, bf16, restoring, adopt.params if adopt is not None else None)
        self.model.train()
        if self.spec.set_loss_scale is not None:  # what each micro-batch's loss is scaled by (the pipeline
            # schedule scales the accumulated gradients instead); a kept module's grad_accum may have changed
            self.spec.set_loss_scale(self.module, 1.0 if dims.pp_enabled else 1.0 / self.grad_accum)
        # FSDP computes in bf16 through its mixed-precision policy; the rest autocasts (fp32 master state).
        self._autocast = bf16 and not isinstance(self.model, FSDPModule)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        # The parameters the optimizer steps, by name, as built: in the middle of a step the
        # module may hold FSDP's unsharded stand-ins instead (elastic/parallel/live.py).
        self.named_params = list(self.model.named_parameters())

        self.schedule = self.pipeline_stage = None
        if dims.pp_enabled:
            self.pipeline_stage = pp.build_stage(self.model, dims.pp_mesh, self.device)
            self.schedule = pp.build_schedule(
                self.pipeline_stage, self.grad_accum, self._pipeline_loss, parallel_cfg.pp_schedule
            )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # The sweep's CPU memory probe (docs/sweep.md): a ParallelConfig subclass may carry
        # ``memory_probe_step``; that step (counted from this engine's build) is tracked.
        self._probe_step = getattr(parallel_cfg, "memory_probe_step", None) if self.device.type == "cpu" else None
        self._steps_begun = 0
        self._probe: memtrack.LiveTensorBytes | None = None
        self.probed_peak_bytes: int | None = None
        self.sync_wait_s = 0.0  # the last step's time blocked on peers (gradient sync, loss all-reduce)
        self._factor: float | None = None  # this step's dense_dp * grad_accum / N on SFT rows (see above)

    def _build(self, seed: int, bf16: bool, restoring: bool, kept: dict[str, torch.Tensor] | None) -> None:
        """The model on the meta device, cut to this rank's stage, then sharded, materialised
        and seeded in ``parallelize`` (``kept``: a survivor's shards): one init under any layout."""
        dims, parallel_cfg, train_cfg = self.dims, self.parallel_cfg, self.train_cfg
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = self.spec.build()
        if dims.pp_enabled:
            model = required_plan(self.spec.split_stage, "split_stage")(model, dims.pp, self.coords.pp_rank)
        self.module = model  # the (stage of the) model itself; ``model`` may be a DDP wrapper around it
        self.gpt = model  # historical name of ``module``
        self.build_timings["meta_s"] = time.perf_counter() - t0
        self.model = parallelize(
            model,
            dims,
            parallel_cfg,
            self.spec,
            seed,
            self.device,
            bf16=bf16,
            compile=train_cfg.compile,
            timings=self.build_timings,
            restoring=restoring,
            kept=kept,
        )
        t1 = time.perf_counter()
        self.optimizer, self.scheduler = build_optimizer(self.model, train_cfg)
        self.build_timings["optimizer_s"] = time.perf_counter() - t1

    # ----- properties a worker reports ----------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.dims.pp - 1

    @property
    def bubble_fraction(self) -> float:
        return pp.bubble_fraction(self.dims.pp, self.grad_accum) if self.dims.pp_enabled else 0.0

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs (forward + backward, no recompute) of one global step, all ranks."""
        return self.spec.flops_per_token * self.train_cfg.global_batch * self.spec.seq_len

    def peak_mem_bytes(self) -> int:
        """Peak accelerator memory allocated by this process, or its peak RSS on CPU.

        On CPU with a memory probe, once the probed step is done: that step's peak of live
        tensor bytes (``elastic/parallel/memtrack.py``), the figure the memory model predicts.
        """
        if self.probed_peak_bytes is not None:
            return self.probed_peak_bytes
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    # ----- one step ---------------------------------------------------------------------

    def forward_backward(self, micro_batches: Sequence[MicroBatch]) -> float:
        """Accumulate the gradients of this data shard's micro-batches (under CP: this rank's
        chunk of their sequences, ``elastic.parallel.cp.sequence_slice``); return the global mean loss."""
        return self.forward_backward_agree(micro_batches, lambda: False)[0]

    def forward_backward_agree(
        self, micro_batches: Sequence[MicroBatch], flag: Callable[[], bool]
    ) -> tuple[float, bool]:
        """``forward_backward`` that also agrees on a flag: True if any rank's ``flag()`` is, read
        once the rank's own forward and backward are done (a stop asked meanwhile ends this step).
        Under pure DP the flag rides in the loss all-reduce (one collective per step).
        Otherwise it rides with the loss over the PP group, then the DP group (dp x ep x cp), and takes one
        more all-reduce over the TP group: the mesh is a product, so summing over each of
        its dimensions in turn sums over every rank. No collective spans the world, whose
        group then needs no connections (``elastic/worker/process_group.py``).
        """
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"expected {self.grad_accum} micro-batches, got {len(micro_batches)}")
        self._steps_begun += 1
        self.sync_wait_s = 0.0
        if self._steps_begun == self._probe_step:
            self._start_probe(micro_batches)
        self._factor = self._counted_factor(micro_batches) if len(micro_batches[0]) > 2 else None
        with self.spec.loss_context(self.dims.tp), self._precision():
            if self.schedule is not None:
                local = self._pipeline_forward_backward(self.schedule, micro_batches)
            else:
                local = self._local_forward_backward(micro_batches)
        _finish_own_work(self.device)  # so the wait timed below is the peers', not this device's queue
        if self.dims.dp == self.dims.world_size:
            value = torch.stack([local.detach().float().reshape(()), torch.tensor(float(flag()), device=self.device)])
            t = time.perf_counter()
            if self.dims.dp_enabled:
                dist.all_reduce(value, group=self.dims.dp_mesh.get_group())
            result = float(value[0]) / self.dims.dp, bool(value[1] > 0)
            self.sync_wait_s += time.perf_counter() - t
            return result
        t = time.perf_counter()
        loss, flags = self._global_mean_and_flags(local, flag())
        self.sync_wait_s += time.perf_counter() - t
        return loss, flags > 0

    def _local_forward_backward(self, micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            is_last = i == len(micro_batches) - 1
            fsdp.prepare_micro_batch(self.model, self.parallel_cfg.zero, is_last)
            with ddp.micro_batch_context(self.model, is_last):
                logits = self._forward(mb)
                loss = self._loss(logits, mb[1].to(self.device), self._factor)
                del logits  # the loss keeps what backward needs; the logits would hold b*s*V more
                if is_last and self.dims.dense_dp > 1 and loss.requires_grad:
                    with _own_backward(loss) as own:
                        (loss / self.grad_accum).backward()
                    self.sync_wait_s += own.waited_s
                else:
                    (loss / self.grad_accum).backward()
            total += to_local_value(loss.detach())
        return total / self.grad_accum

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        """The model's outputs for a micro-batch; packed rows pass their ``document_ids``."""
        docs = mb[2] if len(mb) > 2 else None
        if docs is None:
            return self.model(mb[0].to(self.device))
        if not self.spec.documents:
            raise RuntimeError(f"model {self.spec.name!r} takes no document_ids (the preflight refuses it)")
        return self.model(mb[0].to(self.device), document_ids=docs.to(self.device))

    def _counted_factor(self, micro_batches: Sequence[MicroBatch]) -> float:
        """``dense_dp * grad_accum / N``, ``N`` the counted targets of the global batch (0 when none)."""
        local = sum(int((mb[1] != IGNORE).sum()) for mb in micro_batches)
        count = torch.tensor(float(local), dtype=torch.float64, device=self.device)
        if self.dims.dense_dp > 1:
            t = time.perf_counter()
            dist.all_reduce(count, group=self.dims.dense_mesh.get_group())
            self.sync_wait_s += time.perf_counter() - t
        n = float(count)
        return self.dims.dense_dp * self.grad_accum / n if n > 0 else 0.0

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor, factor: float | None) -> torch.Tensor:
        """The spec's mean loss; on SFT rows scaled by the micro-batch's counted targets times
        ``factor`` (a micro-batch with none contributes a zero of the same graph)."""
        if factor is None:
            return self.spec.loss_fn(outputs, targets)
        count = int((targets != IGNORE).sum())
        if count == 0 or factor == 0.0:
            return self.spec.loss_fn(outputs, targets.clamp(min=0)) * 0.0
        return self.spec.loss_fn(outputs, targets) * (count * factor)

    def _pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(outputs, targets, self._factor)

    @torch.no_grad()
    def eval_loss(self, micro_batches: Sequence[MicroBatch], progress: Callable[[], None] | None = None) -> float:
        """The mean loss over the counted targets of every rank's ``micro_batches`` together (no
        gradient): each data shard's share of an eval corpus, summed with the counts over the
        DP group. Every rank runs as many micro-batches (a share's padding counts nothing).
        ``progress()`` is called after each (the worker's heartbeat during a long eval)."""
        if self.schedule is not None:
            raise RuntimeError("eval under pipeline parallelism (the spec refuses train.eval_every with pp > 1)")
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        with self.spec.loss_context(self.dims.tp), self._precision():
            for mb in micro_batches:
                targets = mb[1].to(self.device)
                count = int((targets != IGNORE).sum())
                logits = self._forward(mb)
                if count:
                    mean = to_local_value(self.spec.loss_fn(logits, targets).detach())
                    sums += torch.stack([mean.double() * count, torch.tensor(float(count), dtype=torch.float64)])
                del logits
                if progress is not None:
                    progress()
        if self.dims.dense_dp > 1:
            dist.all_reduce(sums, group=self.dims.dense_mesh.get_group())
        return float(sums[0] / sums[1]) if float(sums[1]) > 0 else float("nan")

    def _precision(self) -> contextlib.AbstractContextManager:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _pipeline_forward_backward(
        self, schedule: PipelineScheduleSingle, micro_batches: Sequence[MicroBatch]
    ) -> torch.Tensor:
        # The schedule re-splits the concatenation along dim 0 into the same micro-batches.
        if any(len(mb) > 2 and mb[2] is not None for mb in micro_batches):
            raise RuntimeError("document_ids under pipeline parallelism (the preflight refuses it)")
        args = (torch.cat([mb[0] for mb in micro_batches]).to(self.device),) if self.is_first_stage else ()
        target = torch.cat([mb[1] for mb in micro_batches]).to(self.device) if self.is_last_stage else None
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=target, losses=losses if self.is_last_stage else None, return_outputs=False)
        if not self.is_last_stage:
            return torch.zeros((), device=self.device)
        return torch.stack([to_local_value(loss.detach()) for loss in losses]).mean()

    def _global_mean_and_flags(self, local: torch.Tensor, flag: bool) -> tuple[float, float]:
        """The global mean loss, and the number of ranks whose ``flag`` is set.

        Only the last stage's loss counts: the others add 0 to it over the PP group (an
        exact sum, the same value a broadcast from the last stage gives).
        """
        loss = local.detach().float().reshape(()) if self.is_last_stage else torch.zeros((), device=self.device)
        value = torch.stack([loss, torch.tensor(float(flag), device=self.device)])
        if self.dims.pp_enabled:
            dist.all_reduce(value, group=self.dims.pp_mesh.get_group())
        if self.dims.dense_dp > 1:  # dp x ep x cp (the DP mesh without EP and CP)
            dist.all_reduce(value, group=self.dims.dense_mesh.get_group())
        flags = value[1:].clone()
        if self.dims.tp_enabled:
            dist.all_reduce(flags, group=self.dims.tp_mesh.get_group())
        return float(value[0] / self.dims.dense_dp), float(flags)

    def optimizer_step(self) -> float:
        """Clip to the global grad norm, step optimizer and LR schedule, drop the grads.

        Returns the pre-clip global gradient norm (identical on every rank).
        """
        pp_group = self.dims.pp_mesh.get_group() if self.dims.pp_enabled else None
        norm = clip_grad_norm(self._params, self.train_cfg.grad_clip, pp_group, self.device)
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        if self._probe is not None:
            self._probe.__exit__(None, None, None)
            self.probed_peak_bytes, self._probe = self._probe.peak, None
        return norm

    def _start_probe(self, micro_batches: Sequence[MicroBatch]) -> None:
        probe = memtrack.LiveTensorBytes(self.device)
        probe.__enter__()
        probe.register(list(self.model.parameters()) + list(self.model.buffers()))
        probe.register(memtrack.tensors_in(self.optimizer.state))
        probe.register([t for mb in micro_batches for t in mb if t is not None])
        if self.pipeline_stage is not None:  # allocated by the first step, written in place by receives
            probe.register(pp.received_buffers(self.pipeline_stage))
        self._probe = probe

    def zero_grad(self) -> None:
        """Drop the accumulated gradients without stepping (an uncommitted step)."""
        self.optimizer.zero_grad(set_to_none=True)

    # ----- state ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Model and optimizer keyed by full-model FQN (DTensors where sharded), scheduler.

        The tensors alias the live parameters and optimizer state (nothing is copied): read
        them before the next optimizer step. DCP's ``get_state_dict`` costs milliseconds
        (it maps every FQN), more than the snapshot copy itself, so its result is kept and
        reused while the same parameter and optimizer-state tensors are live (both are
        updated in place); only the optimizer's hyperparameters, which the LR schedule
        changes every step, are refreshed. A changed tensor set rebuilds it.
        """
        key = self._live_key()
        cache = getattr(self, "_sd_cache", None)
        if cache is None or cache[0] != key:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            cache = (key, model_sd, optim_sd) if _aliases_live(model_sd, optim_sd, self.model, self.optimizer) else None
            self._sd_cache = cache
            if cache is None:
                return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}
        _, model_sd, optim_sd = cache
        for cached, live in zip(optim_sd["param_groups"], self.optimizer.param_groups):
            cached.update({k: v for k, v in live.items() if k != "params"})
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def _live_key(self) -> tuple:
        """Identity and storage of every tensor the optimizer updates (parameters and state).

        Read from the optimizer, not by walking the module tree, which costs more than the
        rest of a snapshot. The model has no buffers; a state dict that holds anything not
        aliased here is never cached (``_aliases_live``).
        """
        live = [p for g in self.optimizer.param_groups for p in g["params"]]
        live += [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return tuple((id(t), _storage_ptr(t)) for t in live)

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._sd_cache = None

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored with the scheduler state)."""
        return self.scheduler.last_epoch


class _own_backward:
    """Times the part of a backward pass spent waiting for the gradient sync.

    DDP (and torch's ``replicate``) launch their gradient all-reduces asynchronously during
    backward and wait for them in a callback queued on autograd's engine. A hook on the
    loss, the first node backward visits, queues an earlier callback (they run in order)
    that marks the end of this rank's own backward; what the pass takes after it is the
    wait for the slowest peer. Without it, a straggler would make every rank look slow.
    """

    def __init__(self, loss: torch.Tensor):
        self.loss, self.waited_s = loss, 0.0
        self.local_done: float | None = None  # when this rank's own backward ended

    def __enter__(self) -> _own_backward:
        def mark() -> None:
            self.local_done = time.perf_counter()

        def on_loss_grad(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(mark)

        self.handle = self.loss.register_hook(on_loss_grad)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()
        if self.local_done is not None:
            self.waited_s = max(0.0, time.perf_counter() - self.local_done)


def _aliases_live(model_sd: dict, optim_sd: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Does every tensor of the state dict share storage with a live parameter or optimizer state?"""
    live = {_storage_ptr(t) for t in [*model.parameters(), *model.buffers()]}
    live |= {_storage_ptr(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)}
    tensors = list(model_sd.values()) + [v for st in optim_sd["state"].values() for v in st.values()]
    return all(_storage_ptr(t) in live for t in tensors if torch.is_tensor(t))


def _storage_ptr(t: torch.Tensor) -> int:
    """Address of a tensor's (a DTensor's local shard's) data."""
    return getattr(t, "_local_tensor", t).data_ptr()


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _finish_own_work(device: torch.device) -> None:
    """Wait for this rank's own queued device work. On CUDA, kernels run asynchronously: a
    collective's wall time would otherwise include this rank's forward and backward, and a
    slow GPU would look like a fast rank waiting for its peers (``compute_s``, stragglers)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
