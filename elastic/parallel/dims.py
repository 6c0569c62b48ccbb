"""The parallel topology of one training run: degrees, validation and the device mesh.

One ``ParallelDims`` object describes the layout and is passed explicitly to everything
that needs it (torchtitan's pattern). It holds no process-group state until
``build_mesh()`` is called, and that state lives on the instance only: after an elastic
resize the caller destroys the process group, re-initialises it at the new world size and
builds a fresh ``ParallelDims``. Nothing here is cached at module level.

Rank order. The mesh dimensions are ``("dp", "pp", "ep", "cp", "tp")`` in row-major order
(a dimension of degree 1 beyond dp, pp and tp is left out of the mesh), so::

    global_rank = ((((dp_rank * pp) + pp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank

TP is the fastest-varying dimension (TP peers are adjacent ranks, hence on the same node
once the placement planner packs consecutive ranks per node), then CP, then EP (their
all-gathers and all-to-alls stay inside a node when they fit), then PP, DP slowest. One
model replica is the ``pp * ep * cp * tp`` consecutive ranks of one DP rank: the unit the
controller adds and removes. With ep = cp = 1 this is the ``(dp, pp, tp)`` order of
before. ``rank_coords`` and ``rank_of`` are its pure form and need no process group.

HSDP (``shard_group``, spec key ``parallel.shard_group``): FSDP shards inside groups of
``shard_group`` consecutive DP ranks and replicates across those groups. The mesh is then
``("dp_replicate", "dp_shard", "pp", "tp")`` (the DP rank is ``replica * shard_group +
shard``, so the rank order above is unchanged), FSDP takes its 2-D
``("dp_replicate", "dp_shard")`` slice, and ``dp_mesh`` is a 1-D mesh over all DP ranks of
this rank's (pp, tp) coordinate, for what spans the whole DP dimension (the loss, restores).

HSDP does not combine with EP or CP (ep = cp = 1; the spec refuses
``parallel.shard_group`` with either above 1).

Which ranks share what (docs/parallelism.md):

* a *data shard* is one (dp, ep) pair: EP ranks of a replica each train on their own
  micro-batches, CP ranks of one shard on slices of the same samples; so the global batch
  is split ``dp * ep`` ways (``data_shards``);
* dense (non-expert) gradients are averaged over ``dp * ep * cp`` ranks (``dense_mesh``),
  expert gradients over the ``dp * cp`` ranks that hold the same experts (``expert_mesh``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from elastic.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


MESH_DIM_NAMES = ("dp", "pp", "tp")  # the mesh of a layout without EP and CP
ALL_MESH_DIM_NAMES = ("dp", "pp", "ep", "cp", "tp")  # slowest to fastest
DENSE_MESH_NAME = "dp_ep_cp"  # dp x ep x cp flattened: where dense gradients are averaged
EXPERT_MESH_NAME = "dp_cp"  # dp x cp flattened: where expert gradients are averaged
HSDP_DIM_NAMES = ("dp_replicate", "dp_shard", "pp", "tp")  # with parallel.shard_group (ep = cp = 1)


class RankCoords(NamedTuple):
    """A rank's coordinates in a layout without EP and CP: the ``(dp, pp, tp)`` triple."""

    dp_rank: int
    pp_rank: int
    tp_rank: int

    @property
    def ep_rank(self) -> int:
        return 0

    @property
    def cp_rank(self) -> int:
        return 0


class MeshCoords(NamedTuple):
    """A rank's coordinates in a layout with EP or CP (``RankCoords``'s fields, then these two)."""

    dp_rank: int
    pp_rank: int
    tp_rank: int
    ep_rank: int
    cp_rank: int


def rank_coords(rank: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> RankCoords | MeshCoords:
    """The one formula from a global rank to its coordinates (see the module docstring).

    Without EP and CP the result is the ``(dp_rank, pp_rank, tp_rank)`` triple of before;
    with them a 5-tuple. Both name every coordinate (``ep_rank``/``cp_rank`` are 0 in the triple).
    """
    rest, tp_rank = divmod(rank, tp)
    rest, cp_rank = divmod(rest, cp)
    rest, ep_rank = divmod(rest, ep)
    dp_rank, pp_rank = divmod(rest, pp)
    if ep == 1 and cp == 1:
        return RankCoords(dp_rank, pp_rank, tp_rank)
    return MeshCoords(dp_rank, pp_rank, tp_rank, ep_rank, cp_rank)


def rank_of(
    dp_rank: int,
    pp_rank: int,
    tp_rank: int,
    tp: int,
    pp: int,
    ep_rank: int = 0,
    cp_rank: int = 0,
    ep: int = 1,
    cp: int = 1,
) -> int:
    """The inverse of :func:`rank_coords`."""
    return (((dp_rank * pp + pp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank


def spans_dp(mesh_dim_name: str) -> bool:
    """Does this mesh dimension (``dp`` or a flattened ``dp_ep_cp`` / ``dp_cp``) run across DP?"""
    return "dp" in mesh_dim_name.split("_")


def validate_layout(cfg: Any, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
    """Can the model (a config of elastic/models/config.py, or a ``ModelSpec``) run at this layout?

    Each model says what must divide what (TP splits heads and hidden sizes, PP layers, EP
    experts, CP the sequence); a model without a TP plan, a stage split, experts or
    context-parallel attention refuses tp, pp, ep or cp > 1.
    """
    check = getattr(cfg, "check_layout", None) or cfg.validate_layout
    if ep == 1 and cp == 1:
        check(tp, pp)  # the signature of models (and user factories) without EP or CP
    else:
        check(tp, pp, ep=ep, cp=cp)


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
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"parallel.{name}", f"must be a positive integer, got {value!r}")
        g = self.shard_group
        if g is not None and (not isinstance(g, int) or g < 1 or self.dp % g):
            raise SpecError("parallel.shard_group", f"must be a positive divisor of the DP degree {self.dp}, got {g!r}")
        if g is not None and (self.ep > 1 or self.cp > 1):
            raise SpecError("parallel.shard_group", "HSDP does not combine with parallel.ep or parallel.cp above 1")
        if self.dp * self.replica_size != self.world_size:
            raise SpecError(
                "parallel",
                f"dp*pp*ep*cp*tp = {self.dp}*{self.pp}*{self.ep}*{self.cp}*{self.tp} = "
                f"{self.dp * self.replica_size} does not match world size {self.world_size}",
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> ParallelDims:
        """DP is what is left of the world once whole pp x ep x cp x tp replicas are formed."""
        replica = tp * pp * ep * cp
        if world_size % replica:
            raise SpecError("parallel", f"world size {world_size} is not a multiple of tp*pp*ep*cp = {replica}")
        return cls(dp=world_size // replica, tp=tp, pp=pp, world_size=world_size, cp=cp, ep=ep)

    @property
    def replica_size(self) -> int:
        return self.pp * self.ep * self.cp * self.tp

    @property
    def data_shards(self) -> int:
        """Ranks that read different samples: one per (dp, ep) pair."""
        return self.dp * self.ep

    @property
    def dense_dp(self) -> int:
        """Ranks over which a dense parameter's gradient is averaged."""
        return self.dp * self.ep * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts, over which their gradients are averaged."""
        return self.dp * self.cp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        if self.hsdp:
            return HSDP_DIM_NAMES
        keep = {"dp", "pp", "tp"} | ({"ep"} if self.ep > 1 else set()) | ({"cp"} if self.cp > 1 else set())
        return tuple(n for n in ALL_MESH_DIM_NAMES if n in keep)

    # ----- validation against the model -----------------------------------------------

    def validate_model(self, cfg: Any) -> None:
        validate_layout(cfg, self.tp, self.pp, self.ep, self.cp)

    def grad_accum(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per data shard per optimizer step (``elastic.parallel.batch.grad_accum``)."""
        from elastic.parallel.batch import grad_accum

        return grad_accum(global_batch, micro_batch, self.dp, self.ep)

    # ----- pure rank arithmetic ---------------------------------------------------------

    def coords(self, rank: int) -> RankCoords | MeshCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank_coords(rank, self.tp, self.pp, self.ep, self.cp)

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int, ep_rank: int = 0, cp_rank: int = 0) -> int:
        return rank_of(dp_rank, pp_rank, tp_rank, self.tp, self.pp, ep_rank, cp_rank, self.ep, self.cp)

    def data_shard(self, coords: RankCoords | MeshCoords) -> int:
        """Which of the ``data_shards`` slices of each global batch these coordinates train on."""
        return coords.dp_rank * self.ep + coords.ep_rank

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
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hsdp(self) -> bool:
        """FSDP shards inside DP groups smaller than the DP dimension (``shard_group``)."""
        return self.shard_group is not None and self.shard_group < self.dp

    def _mesh_shape(self) -> tuple[int, ...]:
        if self.hsdp:
            g = self.shard_group or 1  # (set: hsdp)
            return (self.dp // g, g, self.pp, self.tp)
        return tuple(getattr(self, n) for n in self.mesh_dim_names)

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
        names = self.mesh_dim_names
        override = self._backend_override(device_type)
        self._world_mesh = init_device_mesh(
            device_type,
            self._mesh_shape(),
            mesh_dim_names=names,
            backend_override=None if override is None else {n: override for n in names},
        )
        self._dp_mesh = self._flat_dp_mesh(device_type) if self.hsdp else None
        # The flattened groups exist only with EP or CP: otherwise both are the DP mesh.
        # Kept here (torch deprecates slicing them back out of the root mesh).
        if self.ep > 1 or self.cp > 1:
            dense = tuple(n for n in ("dp", "ep", "cp") if n in names)
            self._flat[DENSE_MESH_NAME] = self._world_mesh[dense]._flatten(DENSE_MESH_NAME, backend_override=override)
        if self.cp > 1:
            self._flat[EXPERT_MESH_NAME] = self._world_mesh["dp", "cp"]._flatten(
                EXPERT_MESH_NAME, backend_override=override
            )
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
        if mine is None:  # every rank is in one (pp, tp) coordinate's DP group
            raise RuntimeError(f"rank {dist.get_rank()} is in no DP group of a {self.world_size}-rank mesh")
        return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("dp",))

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards dense parameters over: the dense mesh, or under HSDP the 2-D
        (replicate, shard) slice."""
        return self.world_mesh[HSDP_DIM_NAMES[:2]] if self.hsdp else self.dense_mesh

    def _backend_override(self, device_type: str) -> tuple | None:
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
            # Gloo's own options are ``_Options`` at run time (``Options`` is Backend's); torch's stub lacks it.
            opts, backend = dist.ProcessGroupGloo._Options(), "gloo"  # type: ignore[attr-defined]
        opts._timeout = self.timeout
        return (backend, opts)

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

    @property
    def ep_mesh(self) -> DeviceMesh:
        if self.ep == 1:
            raise RuntimeError("no ep mesh: parallel.ep is 1")
        return self.world_mesh["ep"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        if self.cp == 1:
            raise RuntimeError("no cp mesh: parallel.cp is 1")
        return self.world_mesh["cp"]

    @property
    def dense_mesh(self) -> DeviceMesh:
        """dp x ep x cp: the mesh that averages (and under FSDP shards) dense parameters."""
        self.world_mesh  # noqa: B018 - raises before the mesh is built
        return self._flat.get(DENSE_MESH_NAME) or self.dp_mesh

    @property
    def expert_mesh(self) -> DeviceMesh:
        """dp x cp: the ranks holding the same experts (their gradients are averaged there)."""
        self.world_mesh  # noqa: B018
        return self._flat.get(EXPERT_MESH_NAME) or self.dp_mesh

    @property
    def expert_shard_mesh(self) -> DeviceMesh | None:
        """Where experts are sharded: ``(ep,)``, ``(ep, tp)`` when TP splits each expert too,
        ``(tp,)`` under TP alone; None when neither shards them."""
        if self.ep > 1:
            return self.world_mesh["ep", "tp"] if self.tp > 1 else self.ep_mesh
        return self.tp_mesh if self.tp > 1 else None

    def mesh_groups(self) -> list[Any]:
        """Every process group of the mesh (its dimensions, the flattened ones, HSDP's flat DP group)."""
        groups = [self.world_mesh[n].get_group() for n in self.mesh_dim_names]
        flat = list(self._flat.values()) + ([self._dp_mesh] if self._dp_mesh is not None else [])
        return groups + [m.get_group() for m in flat]

    def local_coords(self) -> RankCoords | MeshCoords:
        mesh = self.world_mesh
        names = self.mesh_dim_names

        def local(name: str) -> int:
            return mesh.get_local_rank(name) if name in names else 0

        if self.hsdp:  # ep = cp = 1; the DP rank is the flat DP mesh's
            return RankCoords(self.dp_mesh.get_local_rank(), local("pp"), local("tp"))
        if self.ep == 1 and self.cp == 1:
            return RankCoords(local("dp"), local("pp"), local("tp"))
        return MeshCoords(local("dp"), local("pp"), local("tp"), local("ep"), local("cp"))
