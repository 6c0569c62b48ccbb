"""What holding a loop's state costs a step: ``prepare_optimizer`` (the step guard's snapshot
of model and optimizer after every step, the price of zero lost steps) against the same
optimizer not held, the same model, data and seeds, in one run.

Each side trains an MLP (``--width`` x ``--depth`` linear layers with ReLU; AdamW) on
random batches of ``--batch`` rows, one torch thread (a Ray worker's ``num_cpus=1``), in
this process. The held side runs the code a ``TorchTrainer`` rank runs for a held loop:
``elastic.train.step_guard.StepGuard`` on a memory tier (``elastic/checkpoint/memory_tier.py``)
behind a stand-in for the rank (no Ray, no group: a group of one, so no DDP; the gradient
all-reduce of a larger group is DDP's own and costs both sides alike). Sides alternate
(plain, held, plain, ...) so that drift in the machine's load falls on both; the losses
must be equal, step for step (holding changes no math).

Figures: seconds per step (the median over the timed steps, after ``--warmup``), held /
plain per repetition, the median and range over ``--reps``; the snapshot's size.

Usage::

    .venv/bin/python -m benchmarks.held_step_cost [--width 1536] [--depth 6] [--steps 30] [--reps 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from benchmarks.harness.results import machine, utc_iso, write_json


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _side(held: bool, args: argparse.Namespace, tier: Any) -> tuple[list[float], list[float], int]:
    """Seconds of each timed step, every step's loss, the bytes of one snapshot."""
    from elastic.train.session import Session, TrainContext
    from elastic.train.step_guard import StepGuard

    model = _model(args.width, args.depth)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if held:
        rank = SimpleNamespace(runtime=SimpleNamespace(tier=tier), await_reform=lambda: None)
        session = Session(context=TrainContext(1, 0, 0, 1, 0, "bench"), checkpoint=None, on_report=lambda *_: None)
        session.state["loaders"] = []
        guard = StepGuard(rank, session)
        guard.add_model(model)
        guard.add_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(dt)
    nbytes = 0
    if held:
        tier.wait()
        newest = tier.newest()
        nbytes = newest.nbytes if newest is not None else 0
    return times, losses, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side and repetition")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch's threads (a Ray worker's num_cpus)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from elastic.checkpoint.memory_tier import MemoryTier

    tier = MemoryTier("cpu")  # the rank runtime's: it lives for the process, as a rank's does
    load_before = machine()["loadavg"]
    plain_s, held_s, ratios, nbytes = [], [], [], 0
    for rep in range(args.reps):
        t_plain, l_plain, _ = _side(False, args, tier)
        t_held, l_held, nbytes = _side(True, args, tier)
        if l_plain != l_held:
            print("the losses differ between the sides: holding changed the math", file=sys.stderr)
            return 1
        p, h = statistics.median(t_plain), statistics.median(t_held)
        plain_s.append(p)
        held_s.append(h)
        ratios.append(h / p)
        print(f"rep {rep}: plain {p * 1e3:.1f} ms/step, held {h * 1e3:.1f} ms/step, held/plain {h / p:.3f}")
    params = sum(p.numel() for p in _model(args.width, args.depth).parameters())
    result = {
        "benchmark": "held_step_cost",
        "measured_at": utc_iso(),
        "settings": vars(args),
        "params": params,
        "snapshot_bytes": nbytes,
        "step_s_plain": plain_s,
        "step_s_held": held_s,
        "ratio_held_plain": ratios,
        "ratio_median": statistics.median(ratios),
        "load_before": load_before,
        "machine": machine(),
    }
    print(
        f"held/plain = {statistics.median(ratios):.3f} (range {min(ratios):.3f}..{max(ratios):.3f}, "
        f"{args.reps} paired reps): {params / 1e6:.1f}M parameters, a {nbytes / 2**20:.0f} MiB snapshot every step, "
        f"plain {statistics.median(plain_s) * 1e3:.1f} ms/step; "
        f"load {load_before[0]:.2f} -> {result['machine']['loadavg'][0]:.2f}"
    )
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
