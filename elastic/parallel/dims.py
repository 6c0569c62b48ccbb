"""The parallel topology of one training run: degrees, validation and the device mesh.

One ``ParallelDims`` object describes the layout and is passed explicitly to everything
that needs it (torchtitan's pattern). It holds no process-group state until
``build_mesh()`` is called, and that state lives on the instance only: after an elastic
resize the caller destroys the process group, re-initialises it at the new world size and
builds a fresh ``ParallelDims``. Nothing here is cached at module level.

Rank order. The mesh dimensions are ``("dp", "pp", "tp")`` in row-major order, so::

    global_rank = ((dp_rank * pp) + pp_rank) * tp + tp_rank

TP is the fastest-varying dimension (TP peers are adjacent ranks, hence on the same node
once the placement planner packs consecutive ranks per node), PP next, DP slowest. The
placement planner relies on exactly this order; ``coords`` and ``rank_of`` are its pure
form and need no process group.

HSDP (``shard_group``, spec key ``parallel.shard_group``): FSDP shards inside groups of
``shard_group`` consecutive DP ranks and replicates across those groups. The mesh is then
``("dp_replicate", "dp_shard", "pp", "tp")`` (the DP rank is ``replica * shard_group +
shard``, so the rank order above is unchanged), FSDP takes its 2-D
``("dp_replicate", "dp_shard")`` slice, and ``dp_mesh`` is a 1-D mesh over all DP ranks of
this rank's (pp, tp) coordinate, for what spans the whole DP dimension (the loss, restores).

Context (cp) and expert (ep) parallelism have a slot in the constructor so the signature
will not change when they arrive, but only degree 1 is accepted today.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from elastic.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


MESH_DIM_NAMES = ("dp", "pp", "tp")
HSDP_DIM_NAMES = ("dp_replicate", "dp_shard", "pp", "tp")


class RankCoords(NamedTuple):
    dp_rank: int
    pp_rank: int
    tp_rank: int


def rank_coords(rank: int, tp: int, pp: int) -> RankCoords:
    """The one formula from a global rank to its (dp, pp, tp) coordinates."""
    rest, tp_rank = divmod(rank, tp)
    dp_rank, pp_rank = divmod(rest, pp)
    return RankCoords(dp_rank, pp_rank, tp_rank)


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, tp: int, pp: int) -> int:
    """The inverse of :func:`rank_coords`."""
    return ((dp_rank * pp) + pp_rank) * tp + tp_rank


def validate_layout(cfg: Any, tp: int, pp: int) -> None:
    """Can the model (a config of elastic/models/config.py, or a ``ModelSpec``) run at tp x pp?

    Each model says what must divide what (TP splits heads and hidden sizes, PP layers);
    a model without a TP plan or a stage split refuses tp > 1 or pp > 1.
    """
    check = getattr(cfg, "check_layout", None) or cfg.validate_layout
    check(tp, pp)


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1
    shard_group: int | None = None  # HSDP: FSDP shards inside groups of this many DP ranks
    timeout: timedelta | None = field(default=None, compare=False)  # for the mesh's sub-groups
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"parallel.{name}", f"must be a positive integer, got {value!r}")
        if self.cp != 1 or self.ep != 1:
            raise SpecError(
                "parallel.cp" if self.cp != 1 else "parallel.ep", "context/expert parallelism is not implemented yet"
            )
        g = self.shard_group
        if g is not None and (not isinstance(g, int) or g < 1 or self.dp % g):
            raise SpecError("parallel.shard_group", f"must be a positive divisor of the DP degree {self.dp}, got {g!r}")
        if self.dp * self.pp * self.tp != self.world_size:
            raise SpecError(
                "parallel",
                f"dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.dp * self.pp * self.tp} "
                f"does not match world size {self.world_size}",
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> ParallelDims:
        """DP is what is left of the world once whole tp x pp replicas are formed."""
        if world_size % (tp * pp):
            raise SpecError("parallel", f"world size {world_size} is not a multiple of tp*pp = {tp * pp}")
        return cls(dp=world_size // (tp * pp), tp=tp, pp=pp, world_size=world_size)

    # ----- validation against the model -----------------------------------------------

    def validate_model(self, cfg: Any) -> None:
        validate_layout(cfg, self.tp, self.pp)

    def grad_accum(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per DP rank per optimizer step (``elastic.parallel.batch.grad_accum``)."""
        from elastic.parallel.batch import grad_accum

        return grad_accum(global_batch, micro_batch, self.dp)

    # ----- pure rank arithmetic ---------------------------------------------------------

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank_coords(rank, self.tp, self.pp)

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return rank_of(dp_rank, pp_rank, tp_rank, self.tp, self.pp)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def hsdp(self) -> bool:
        """FSDP shards inside DP groups smaller than the DP dimension (``shard_group``)."""
        return self.shard_group is not None and self.shard_group < self.dp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return HSDP_DIM_NAMES if self.hsdp else MESH_DIM_NAMES

    def _mesh_shape(self) -> tuple[int, ...]:
        if self.hsdp:
            g = self.shard_group
            return (self.dp // g, g, self.pp, self.tp)
        return (self.dp, self.pp, self.tp)

    # ----- the device mesh (needs an initialised default process group) ---------------

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs an initialised default process group")
        if dist.get_world_size() != self.world_size:
            raise SpecError(
                "parallel", f"process group has {dist.get_world_size()} ranks, layout expects {self.world_size}"
            )
        self._world_mesh = init_device_mesh(
            device_type,
            self._mesh_shape(),
            mesh_dim_names=self.mesh_dim_names,
            backend_override=self._backend_override(device_type),
        )
        self._dp_mesh = self._flat_dp_mesh(device_type) if self.hsdp else None
        return self._world_mesh

    def _flat_dp_mesh(self, device_type: str) -> DeviceMesh:
        """A 1-D mesh over this rank's whole DP group (HSDP): every rank takes part in
        making each DP group, as ``new_group`` requires, and keeps its own."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        mine = None
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                ranks = [self.rank_of(d, pp_rank, tp_rank) for d in range(self.dp)]
                group = dist.new_group(ranks=ranks, timeout=self.timeout, group_desc="mesh_dp")
                if dist.get_rank() in ranks:
                    mine = group
        return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("dp",))

    def mesh_groups(self) -> list[Any]:
        """Every process group of this rank's mesh (one per dimension, and the flat DP group)."""
        groups = [self.world_mesh[name].get_group() for name in self.mesh_dim_names]
        return groups + ([self._dp_mesh.get_group()] if self._dp_mesh is not None else [])

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: the DP mesh, or under HSDP its 2-D (replicate, shard) slice."""
        return self.world_mesh[HSDP_DIM_NAMES[:2]] if self.hsdp else self.dp_mesh

    def _backend_override(self, device_type: str) -> dict | None:
        """Give the mesh's sub-groups the same timeout as the default group.

        ``new_group`` would otherwise give them torch's 30-minute default, and a rank
        blocked on a lost peer in a DP or TP sub-group would hang that long instead of
        failing after ``elastic.collective_timeout_s``.
        """
        if self.timeout is None:
            return None
        import torch.distributed as dist

        if device_type == "cuda":
            opts, backend = dist.ProcessGroupNCCL.Options(), "nccl"
        else:
            opts, backend = dist.ProcessGroupGloo._Options(), "gloo"
        opts._timeout = self.timeout
        return {name: (backend, opts) for name in self.mesh_dim_names}

    @property
    def mesh_built(self) -> bool:
        return self._world_mesh is not None

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._world_mesh is None:
            raise RuntimeError("call build_mesh() first")
        return self._world_mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self._dp_mesh if self._dp_mesh is not None else self.world_mesh["dp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.world_mesh["pp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.world_mesh["tp"]

    def local_coords(self) -> RankCoords:
        mesh = self.world_mesh
        dp_rank = self.dp_mesh.get_local_rank() if self.hsdp else mesh.get_local_rank("dp")
        return RankCoords(dp_rank, mesh.get_local_rank("pp"), mesh.get_local_rank("tp"))
