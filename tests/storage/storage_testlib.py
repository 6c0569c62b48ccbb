"""Shared helpers for storage tests: a moto S3 server, model + AdamW state, dim-0 shards.

Known answers come from the full, unsharded state: every resharded load must reproduce it.
(A uniquely named module rather than ``conftest`` imports, which other test folders share.)
"""

from __future__ import annotations

import socket
import uuid

import torch

from elastic.testing.ports import free_port as _free_port
from storage import ShardRecord, chunk_boxes

WORLD = 4

FAKE_KEY = "AKIAFAKEKEY0TESTONLY"
FAKE_SECRET = "fAkE/SeCrEt+0nly4Tests0000000000000000000"


class MotoS3:
    """A moto S3 server that can be stopped and restarted on the same loopback port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        with socket.socket() as probe:  # moto's start() would wait forever on a bind failure
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", self.port))
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def options(self) -> dict:
        """storage_options for this server; one botocore attempt so *our* retries are tested."""
        return {
            "endpoint_url": self.endpoint,
            "key": FAKE_KEY,
            "secret": FAKE_SECRET,
            "region": "us-east-1",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
            "skip_instance_cache": True,
        }

    def client(self):
        """A boto3 S3 client of this server (for set-up and inspection, not the code under test)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=FAKE_KEY,
            aws_secret_access_key=FAKE_SECRET,
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        client = self.client()
        client.create_bucket(Bucket=name)
        return name

    def all_objects(self, bucket: str) -> dict[str, bytes]:
        client = self.client()
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])
        ]
        return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def model_and_optimizer_state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """Full (unsharded) tensors of a small model after two AdamW steps, and plain objects."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        loss = model(torch.randint(0, 50, (8,))).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"optim.{names[id(p)]}.{k}"] = v.detach().clone()
    sd = opt.state_dict()
    objects = {
        "optim.param_groups": sd["param_groups"],
        "train.step": 2,
        "data.cursor": {"epoch": 0, "offsets": (3, 7)},
        "rng": {"cpu": torch.get_rng_state()},
    }
    return tensors, objects


def is_sharded(fqn: str, value: torch.Tensor) -> bool:
    """FSDP shards every parameter and its moments along dim 0; 0-d ``step`` is replicated."""
    return value.dim() > 0


def rank_snapshot(tensors: dict[str, torch.Tensor], objects: dict, rank: int, world: int = WORLD) -> dict:
    snap: dict = {}
    for fqn, full in tensors.items():
        if is_sharded(fqn, full):
            offsets, sizes = chunk_boxes(full.shape, world)[rank]
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            snap[fqn] = ShardRecord(full[box].clone(), tuple(full.shape), offsets)
        else:
            snap[fqn] = full.clone()
    snap.update(objects)
    return snap


def owner(rank: int, snapshot: dict):
    """Replicated entries (full tensors, objects) are written by rank 0 only; shards by all."""
    return lambda fqn: rank == 0 or isinstance(snapshot[fqn], ShardRecord)


def save_sharded(store, step: int, tensors: dict, objects: dict, world: int = WORLD) -> list:
    """Every rank's collective-free upload, as the runtime's background threads would do."""
    from storage import write_rank_shard

    results = []
    for r in range(world):
        snap = rank_snapshot(tensors, objects, r, world)
        results.append(write_rank_shard(store, step, snap, r, owns=owner(r, snap)))
    return results


def overlap_bytes(tensors: dict, old_world: int, new_world: int, new_rank: int) -> dict[int, int]:
    """Known answer: bytes each old rank's dim-0 boxes share with ``new_rank``'s new boxes."""
    need: dict[int, int] = {}
    for full in tensors.values():
        if not is_sharded("", full):
            continue
        row = full[0].numel() * full.element_size()
        (lo,), (n,) = (x[:1] for x in chunk_boxes(full.shape, new_world)[new_rank])
        for r, (off, size) in enumerate(chunk_boxes(full.shape, old_world)):
            rows = max(0, min(lo + n, off[0] + size[0]) - max(lo, off[0]))
            if rows:
                need[r] = need.get(r, 0) + rows * row
    return need


def target(tensors: dict[str, torch.Tensor], rank: int, world: int) -> dict:
    """Empty load targets for ``rank`` of a new dim-0 layout with ``world`` ranks."""
    out: dict = {}
    for fqn, full in tensors.items():
        if is_sharded(fqn, full):
            offsets, sizes = chunk_boxes(full.shape, world)[rank]
            out[fqn] = ShardRecord.empty(full.shape, offsets, sizes, full.dtype)
        else:
            out[fqn] = torch.full_like(full, float("nan"))
    return out


def assemble(targets: list[dict], fqn: str) -> torch.Tensor:
    value = targets[0][fqn]
    if isinstance(value, ShardRecord):
        return torch.cat([t[fqn].local for t in targets], dim=0)
    return value


def assert_same_objects(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        if k == "rng":
            assert torch.equal(got[k]["cpu"], want[k]["cpu"])
        else:
            assert got[k] == want[k], k
