"""The private torch names the elastic runtime relies on, in one list.

Most are called from ``elastic/worker/process_group.py``; the others name their user.
``tests/worker/test_torch_private_api.py`` fails loudly, by name, when a torch upgrade
moves one, instead of a hang or a wrong result in the middle of a recovery.
"""

from __future__ import annotations

PRIVATE_TORCH_API = (
    "torch.distributed.distributed_c10d._set_pg_timeout",
    "torch.distributed.distributed_c10d._world.group_count",
    "torch.distributed.distributed_c10d._abort_process_group",
    "torch.distributed.distributed_c10d.SHRINK_ABORT",
    "torch.distributed.shrink_group",
    "torch.distributed.device_mesh._mesh_resources.mesh_stack",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator",
    "torch.distributed.ProcessGroupGloo._Options",
    # elastic/engine.py times a rank's own backward (straggler detection, docs/health.md)
    "torch.autograd.Variable._execution_engine.queue_callback",
    # elastic/parallel/dims.py flattens dp x ep x cp and dp x cp into one mesh dimension each
    # (torchtitan does the same; no public equivalent in torch 2.13)
    "torch.distributed.device_mesh.DeviceMesh._flatten",
    # elastic/parallel/live.py wraps a survivor's kept shards and optimizer state as DTensors
    # with their parameter's own spec (``DTensor(local, spec, requires_grad=...)``, as FSDP2's
    # own ``_from_local_no_grad`` does): ``from_local`` costs 0.05 ms a tensor, 10x more
    "torch.distributed.tensor.DTensor._spec",
)
