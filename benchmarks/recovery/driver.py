"""Runs one side of one repetition of the recovery benchmark: writes the side's settings,
starts ``python -m benchmarks.recovery_vs_raytrain --_child CFG`` in its own session on a
private ``TMPDIR`` under a hard limit, and reads back what the child measured. ``run_child``
is that child's entry. Runs in the benchmark's driver process (and ``run_child`` in the child).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

from benchmarks.harness.cluster import private_tmpdir
from benchmarks.harness.proc import child_env, module_command, run_logged
from benchmarks.harness.results import write_json
from benchmarks.recovery.scenario import (
    RAY_TUNED_ENV,
    RAY_TUNED_SYSTEM_CONFIG,
    REJOIN_SIDES,
    TORCHFT_SIDES,
)

ENTRY = "benchmarks.recovery_vs_raytrain"


def side_timeout(side: str, args: argparse.Namespace) -> float:
    return {
        "ours": args.ours_timeout,
        "raytrain_tuned": args.raytrain_timeout,
        "raytrain_default": args.raytrain_timeout,
        "torchft": args.torchft_timeout,
        "raytrain_torchft": args.raytrain_timeout,
    }[side]


def side_config(side: str, rep: int, args: argparse.Namespace, spec_path: str, side_dir: str) -> dict[str, Any]:
    """The child's settings (``cfg.json``) and its spec (``spec.json``), written to ``side_dir``."""
    cfg: dict[str, Any] = {
        "side": side,
        "spec": spec_path,
        "work": side_dir,
        "out": os.path.join(side_dir, "result.json"),
        "kill_step": args.kill_step,
        "kill_rank": args.kill_rank,
        "side_timeout": side_timeout(side, args),
        "return_delay_s": args.return_delay,
    }
    if side == "raytrain_tuned":
        cfg["system_config"] = RAY_TUNED_SYSTEM_CONFIG
        cfg["checkpoint_every"] = 1
    elif side == "raytrain_default":
        cfg["checkpoint_every"] = 5
    with open(spec_path) as f:
        spec = json.load(f)
    # Ours and TorchFT go on long enough for the returning node to rejoin; the steps after the
    # recovery enter no recovery figure.
    steps = args.rejoin_steps if side in REJOIN_SIDES and args.return_delay >= 0 else args.steps
    spec["train"]["steps"] = steps
    cfg["spec"] = os.path.join(side_dir, "spec.json")
    cfg["steps"] = steps
    write_json(cfg["spec"], spec)
    return cfg


def side_env(side: str, args: argparse.Namespace, tmp: str) -> dict[str, str]:
    extra = [args.torchft_path] if side in TORCHFT_SIDES and args.torchft_path else None
    env = child_env(private_tmp=tmp, extra_paths=extra)
    env["RAY_TRAIN_V2_ENABLED"] = "1"
    for k in RAY_TUNED_ENV:
        env.pop(k, None)
    if side == "raytrain_tuned":
        env.update(RAY_TUNED_ENV)
    return env


def run_side(side: str, rep: int, args: argparse.Namespace, spec_path: str, work: str) -> dict[str, Any]:
    side_dir = os.path.join(work, f"{side}-{rep}")
    os.makedirs(side_dir, exist_ok=True)
    # A private temp dir: Ray's session files and its ray_current_cluster live there, so no
    # other process on this machine joins the benchmark's cluster by accident.
    tmp = private_tmpdir()
    cfg = side_config(side, rep, args, spec_path, side_dir)
    cfg_path = os.path.join(side_dir, "cfg.json")
    write_json(cfg_path, cfg)
    log_path = os.path.join(side_dir, "log.txt")
    # The child's own deadline fires first; this limit catches a child whose deadline failed.
    rc, wall, _ = run_logged(
        module_command(ENTRY, "--_child", cfg_path), cfg["side_timeout"] + 30, side_env(side, args, tmp), log_path
    )
    res: dict[str, Any] = {"side": side, "status": "crashed", "rc": rc}
    if os.path.exists(cfg["out"]):
        with open(cfg["out"]) as f:
            res = json.load(f)
    res["rc"], res["wall_s"], res["rep"] = rc, wall, rep
    res["loadavg_1m_after"] = os.getloadavg()[0]
    if "recovery_s" not in res:
        with open(log_path) as f:
            res["log_tail"] = "".join(f.readlines()[-30:])
    res["failures"] = failure_events(os.path.join(side_dir, "run"))
    if args.keep:  # Ray's session logs (the workers' own tracebacks) stay too
        res["ray_tmpdir"] = tmp
    else:
        if res.get("status") not in ("succeeded", "skipped"):
            res["evidence_dir"] = keep_evidence(side_dir, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    return res


FAILURE_DETAIL_CHARS = 400  # a failure event's detail, as the results file keeps it


def failure_events(run_dir: str) -> list[dict[str, Any]]:
    """Our side's failure events (cause, ranks, detail), in order: why a run re-formed,
    kept in the results file itself. Empty for the other sides (no run directory)."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:  # a line cut by the child's deadline
                continue
            if e.get("kind") == "failure":
                detail = str(e.get("detail", ""))[:FAILURE_DETAIL_CHARS]
                out.append({"ts": e.get("ts"), "cause": e.get("cause"), "ranks": e.get("ranks"), "detail": detail})
    return out


def keep_evidence(side_dir: str, ray_tmp: str) -> str:
    """A failed run's evidence, kept without ``--keep``: the side's own files and its run
    directory less the checkpoints (gigabytes at ~100M), and the error logs of Ray's
    processes (the workers' tracebacks). Returns the directory, printed with the run."""
    dest = tempfile.mkdtemp(prefix=f"bench-recovery-failed-{os.path.basename(side_dir)}-")
    shutil.copytree(side_dir, os.path.join(dest, "side"), ignore=shutil.ignore_patterns("checkpoints"))
    logs = os.path.join(dest, "ray-logs")
    os.makedirs(logs)
    for root, _, files in os.walk(ray_tmp):
        for name in files:
            if name.endswith(".err") and os.path.getsize(os.path.join(root, name)) > 0:
                shutil.copy(os.path.join(root, name), os.path.join(logs, f"{os.path.basename(root)}-{name}"))
    return dest


def run_child(cfg_path: str) -> None:
    """In the child: run the side ``cfg.json`` names (each side ends the process itself)."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    side = cfg["side"]
    if side == "ours":
        from benchmarks.recovery.side_ours import ours_child

        ours_child(cfg)
    elif side == "raytrain_torchft":
        from benchmarks.recovery.side_raytrain_torchft import raytrain_torchft_child

        raytrain_torchft_child(cfg)
    elif side.startswith("raytrain"):
        from benchmarks.recovery.side_raytrain import raytrain_child

        raytrain_child(cfg)
    else:
        from benchmarks.recovery.side_torchft import torchft_child

        torchft_child(cfg)
