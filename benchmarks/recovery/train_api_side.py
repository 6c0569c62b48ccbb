"""One side of one run of ``benchmarks/train_api_recovery.py``, in its own child process: a
fresh 4-node local cluster, the user's script (``train_api_script``) under a
``TorchTrainer`` of Ray Train V2 or of ``elastic.train``, and a driver thread that kills the
node hosting rank ``kill_rank`` once step ``kill_step`` is in the ledgers (and, with
``kills`` > 1, the node of that rank in the smaller group every ``kill_gap`` steps after).
So that the kill lands at the same point on every side, whatever either side's per-step cost
and the machine's load, that rank holds (sleeps) when it has reported its kill step
(``hold_after``): the others go on into the next step and wait in its all-reduce, as peers of
a node that has just died do, and no step after the kill step is completed before the kill.

Sides (``SIDES``): the API, the data path, and whether the loop hands its optimizer over:

- ``raytrain``: ``ray.train`` with ``prepare_data_loader``; ``raytrain_dataset``: with a Ray
  Dataset (``get_dataset_shard`` + ``iter_torch_batches``);
- ``ours``: ``elastic.train``, the same loop (it only reports checkpoints);
  ``ours_prepared``: with ``prepare_optimizer`` too; ``ours_dataset``: with a Ray Dataset.

Every side runs on the same cluster and Ray settings: a head with ``num_cpus=0``, 4 worker
nodes with ``num_cpus=1``, Ray health checks every 0.5 s with 3 misses, and the driver
tunes Ray Train as an expert would (``scenario.RAY_TUNED_ENV``). A side whose API does not
import is reported ``skipped`` with the reason.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.cluster import start_cluster
from benchmarks.harness.kill import kill_node_now
from benchmarks.harness.proc import arm_deadline
from benchmarks.harness.results import write_json
from benchmarks.recovery.progress import report_skipped
from benchmarks.recovery.scenario import NODES, RAY_TUNED_SYSTEM_CONFIG
from benchmarks.recovery.train_api_ledger import analyse, kill_target, read_ledger, steps_at


@dataclass(frozen=True)
class Side:
    api: str  # "ray.train" or "elastic.train"
    data: str  # "loader" or "dataset"
    prepare_optimizer: bool = False

    @property
    def ours(self) -> bool:
        return self.api == "elastic.train"


SIDES = {
    "raytrain": Side("ray.train", "loader"),
    "raytrain_dataset": Side("ray.train", "dataset"),
    "ours": Side("elastic.train", "loader"),
    "ours_prepared": Side("elastic.train", "loader", prepare_optimizer=True),
    "ours_dataset": Side("elastic.train", "dataset"),
}
BASELINE = {"ours": "raytrain", "ours_prepared": "raytrain", "ours_dataset": "raytrain_dataset"}


def loop_config(cfg: dict[str, Any], side: Side) -> dict[str, Any]:
    """What the loop reads (``train_loop_config``)."""
    return {
        "rows": cfg["rows"],
        "global_batch": cfg["global_batch"],
        "epochs": 1,
        "seed": 0,
        "lr": 1e-3,
        "shuffle": True,
        "checkpoint_every": cfg["checkpoint_every"],
        "step_sleep_s": cfg["step_sleep_s"],
        "data": side.data,
        "prepare_optimizer": side.prepare_optimizer,
        "ledger": os.path.join(cfg["work"], "ledger"),
        # where each kill lands, the same on every side: the victim rank holds after these steps
        "hold_rank": cfg["kill_rank"],
        "hold_after": [[NODES - k, cfg["kill_step"] + k * cfg["kill_gap"]] for k in range(cfg["kills"])],
        "hold_s": 30.0,
    }


def side_child(cfg: dict[str, Any]) -> None:
    """Run the side ``cfg["side"]`` once; writes its result to ``cfg["out"]`` and ends the process."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    name = cfg["side"]
    side = SIDES[name]
    out: dict[str, Any] = {
        "side": name,
        "api": side.api,
        "data": side.data,
        "prepare_optimizer": side.prepare_optimizer,
    }
    out["kills"] = []
    armed = time.time()
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    try:
        train = importlib.import_module(side.api)
        train_torch = importlib.import_module(side.api + ".torch")
        trainer_cls = train_torch.TorchTrainer
    except (ImportError, AttributeError) as exc:
        report_skipped(cfg, out, f"{side.api}.torch.TorchTrainer", exc)
    from benchmarks.recovery.train_api_script import make_train_loop, ray_dataset

    config = loop_config(cfg, side)
    steps_per_epoch = cfg["rows"] // cfg["global_batch"]

    def figures() -> None:
        out.update(
            analyse(read_ledger(config["ledger"]), [k["kill_ts"] for k in out["kills"]], cfg["rows"], steps_per_epoch)
        )

    # A run that outlives its deadline still says what its ledgers show (the deadline writes ``out``).
    late = threading.Timer(max(1.0, cfg["side_timeout"] - 5 - (time.time() - armed)), figures)
    late.daemon = True
    late.start()
    t0 = time.time()
    started = start_cluster(NODES, system_config=RAY_TUNED_SYSTEM_CONFIG)
    out["cluster_start_s"] = time.time() - t0
    stop = threading.Event()

    def watch() -> None:
        """Driver-side thread: the k-th kill (k from 0) takes rank ``kill_rank``'s node once the
        group of ``NODES - k`` ranks has done step ``kill_step + k * kill_gap``."""
        while not stop.is_set() and len(out["kills"]) < cfg["kills"]:
            k = len(out["kills"])
            recs = read_ledger(config["ledger"])
            reached = steps_at(recs, NODES - k)
            if reached >= cfg["kill_step"] + k * cfg["kill_gap"]:
                node_id, pids = kill_target(recs, cfg["kill_rank"], NODES - k)
                kill: dict[str, Any] = {"step_at_kill": reached}
                kill_node_now(kill, started.cluster, node_id, pids)
                out["kills"].append({**kill, "group_size": NODES - k})
                if k == 0:
                    out.update(kill)
                continue
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        datasets = {"train": ray_dataset(cfg["rows"], config["seed"])} if side.data == "dataset" else None
        trainer = trainer_cls(
            make_train_loop(train, train_torch),
            train_loop_config=config,
            scaling_config=train.ScalingConfig(num_workers=(1, NODES), use_gpu=False),
            run_config=train.RunConfig(
                name=f"train-api-{name}",
                storage_path=os.path.join(cfg["work"], "storage"),
                failure_config=train.FailureConfig(max_failures=3),
                checkpoint_config=train.CheckpointConfig(num_to_keep=2),
            ),
            datasets=datasets,
        )
        watcher.start()
        t_fit = time.time()
        result = trainer.fit()
        out["fit_s"] = time.time() - t_fit
        out["status"] = "succeeded" if result.error is None else "failed"
        if result.error is not None:
            out["error"] = f"{type(result.error).__name__}: {str(result.error)[:2000]}"
        out["final_metrics"] = {k: v for k, v in (result.metrics or {}).items() if isinstance(v, int | float)}
    except Exception as exc:
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(timeout=30)
        started.stop()
    late.cancel()
    figures()
    write_json(cfg["out"], out)
    os._exit(0)
