"""The ``elastic`` command line (``docs/cli.md``).

Exit codes: 0 ok, 1 the job failed, 2 bad input. Bad input is reported as one line naming
the field, with no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
ADDRESS_HELP = (
    "Ray cluster to join: HOST:PORT, or auto for the one running on this machine "
    "(default: RAY_ADDRESS, else an embedded cluster for this command alone)"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(EXIT_BAD_INPUT, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elastic", description="Elastic, topology-aware training on Ray")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a training job from a YAML spec")
    run.add_argument("config")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--address", default=None, help=ADDRESS_HELP)
    run.add_argument("--run-dir", default=None)
    run.add_argument("--resume", action="store_true", help="start from the newest valid checkpoint in checkpoint.uri")
    run.add_argument(
        "--fault",
        dest="faults",
        action="append",
        default=[],
        metavar="KIND@STEP[:key=value...]",
        help="inject a failure (repeatable): kill_worker, kill_node, stop_worker, nan, spike, raise, "
        "hang, slow, bitflip or drain (a Ray drain notice), e.g. kill_worker@20:rank=2, drain@20:node=3:deadline_s=30",
    )

    demo = sub.add_parser("demo", help="the quickstart job with a node failure and recovery")
    demo.add_argument("--run-dir", default=None)
    demo.add_argument("--no-fault", action="store_true", help="run the quickstart without injecting a failure")

    plan = sub.add_parser("plan", help="print the rank placement plan")
    plan.add_argument("config")
    plan_src = plan.add_mutually_exclusive_group()
    plan_src.add_argument("--topology", default=None)
    plan_src.add_argument("--address", default=None, help="plan for this live Ray cluster; " + ADDRESS_HELP)
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    ckpt = sub.add_parser("ckpt", help="inspect checkpoints")
    csub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
    cl = csub.add_parser("list")
    cl.add_argument("uri")
    cl.add_argument("--json", action="store_true")
    cv = csub.add_parser("verify")
    cv.add_argument("uri")
    cv.add_argument("--step", type=int, default=None)
    ce = csub.add_parser("export", help="write a checkpoint as a Hugging Face model (docs/checkpoints.md)")
    ce.add_argument("uri")
    ce.add_argument("--step", type=int, default=None, help="default: the newest committed")
    ce.add_argument("--format", dest="fmt", required=True, choices=["hf"])
    ce.add_argument("--out", required=True, help="a directory (local path or fsspec URI)")
    ce.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ce.add_argument("--max-shard-size", default="5GB", help="larger models are split into files of this size")
    ce.add_argument("--spec", default=None, help="your job spec: the model to export (needed for kind: custom)")

    sub.add_parser("schema", help="print the JSON Schema of job specs")

    from elastic.simulator.cli import add_arguments as add_simulate_arguments

    add_simulate_arguments(sub.add_parser("simulate", help="simulate failures at scale: ETTR, inplace vs restart"))

    from elastic.ingest import cli as ingest_cli

    ingest_cli.add_arguments(sub.add_parser("prepare", help="tokenize and pack text into a training corpus"))

    from jobs.sweep import add_arguments as sweep_arguments

    sweep_arguments(sub.add_parser("sweep", help="Ray Tune sweep over parallel configurations (docs/sweep.md)"))

    from elastic.report import cli as report_cli

    report_cli.add_arguments(sub.add_parser("report", help="figures and report.md of a run (docs/observability.md)"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from elastic.errors import JobFailed, SpecError

    try:
        return _dispatch(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except JobFailed as exc:
        print(f"job failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C before the job's own handler is installed (docs/cli.md)
        print("interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return cmd_run(args.config, args.overrides, args.address, args.run_dir, args.resume, args.faults)
    if args.command == "demo":
        from jobs.demo import run_demo

        return run_demo(args.run_dir, inject_fault=not args.no_fault)
    if args.command == "plan":
        return cmd_plan(args.config, args.topology, args.json, args.overrides, args.address)
    if args.command == "ckpt":
        return cmd_ckpt(args)
    if args.command == "simulate":
        from elastic.simulator.cli import main as simulate_main

        return simulate_main(args)

    if args.command == "prepare":
        from elastic.ingest import cli as ingest_cli

        return ingest_cli.main(args)

    if args.command == "sweep":
        from jobs.sweep import main as sweep_main

        return sweep_main(args)
    if args.command == "report":
        from elastic.report import cli as report_cli

        return report_cli.main(args)
    if args.command == "schema":
        from jobs.spec import JobSpec

        print(JobSpec.json_schema())
        return EXIT_OK
    raise AssertionError(args.command)


def cmd_run(
    config: str,
    overrides: list[str],
    address: str | None,
    run_dir: str | None,
    resume: bool,
    faults: list[str] | None = None,
) -> int:
    from elastic.faults import WorkerFaults, build_faults, check_fault_specs, parse_fault_spec
    from jobs.spec import JobSpec

    parsed = [parse_fault_spec(f) for f in faults or []]
    spec = JobSpec.from_yaml(config, overrides=overrides)  # validates before anything starts
    check_fault_specs(parsed, spec)
    driver_faults, worker_faults = build_faults(parsed, spec)
    step_hook = WorkerFaults(worker_faults) if worker_faults else None
    from elastic.api import ElasticTrainer

    if any(f.kind in ("kill_node", "drain") for f in driver_faults):
        return _run_on_embedded_cluster(spec, run_dir, address, resume, driver_faults, step_hook)
    callbacks = []
    if driver_faults:
        from elastic.faults import FaultInjector

        callbacks.append(FaultInjector(driver_faults))
    trainer = ElasticTrainer(
        spec,
        run_dir=run_dir,
        address=address,
        resume=resume,
        progress=True,
        callbacks=callbacks,
        step_hook=step_hook,
        report=True,
    )
    result = trainer.fit()
    return _exit_code(result)


def _run_on_embedded_cluster(spec, run_dir, address, resume, driver_faults, step_hook) -> int:
    """``--fault kill_node``: the job runs on an embedded multi-node Ray (a CPU-less head plus
    one node per worker, ``ray.cluster_utils.Cluster``), whose nodes can be killed for real."""
    from elastic.api import ElasticTrainer
    from elastic.errors import SpecError

    joined = address or os.environ.get("RAY_ADDRESS")
    if joined and joined != "local":
        raise SpecError(
            "--fault",
            f"kill_node and drain need the embedded multi-node cluster that elastic run starts itself; "
            f"it cannot kill nodes of the cluster at {joined} (--address or RAY_ADDRESS)",
        )
    import ray
    from ray.cluster_utils import Cluster

    from elastic.faults import FaultInjector

    logging.getLogger("ray").setLevel(logging.ERROR)
    workers = spec.elastic.max_dp * spec.parallel.replica_size
    node_args = {
        "num_cpus": max(1, int(spec.resources.cpus_per_worker)),
        "resources": dict(spec.resources.custom) or None,
    }
    print(f"--fault kill_node: starting an embedded Ray cluster: 1 head + {workers} worker nodes", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    injector = FaultInjector(driver_faults, cluster=cluster, node_args=node_args)
    try:
        for _ in range(workers):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
        trainer = ElasticTrainer(
            spec,
            run_dir=run_dir,
            resume=resume,
            progress=True,
            callbacks=[injector],
            step_hook=step_hook,
            report=True,
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return _exit_code(result)


def _exit_code(result) -> int:
    """0 succeeded, 1 failed, 128 + the signal for a job stopped on a signal (130 SIGINT, 143 SIGTERM)."""
    if result.status == "stopped":
        from elastic.control.stop import exit_code_of

        return exit_code_of(result)
    return EXIT_OK if result.status == "succeeded" else EXIT_FAILED


def cmd_plan(config: str, topology: str | None, as_json: bool, overrides: list[str], address: str | None = None) -> int:
    from jobs.spec import JobSpec

    spec = JobSpec.from_yaml(config, overrides=overrides)
    from elastic.placement.planner import plan_from_spec
    from elastic.placement.topology import load_topology_file, topology_from_ray

    if topology:
        topo = load_topology_file(topology)
    else:  # the cluster `elastic run` would use: --address, RAY_ADDRESS, else an embedded one
        import ray

        from elastic.api import ensure_ray

        ensure_ray(address, spec)
        try:
            topo = topology_from_ray(ray.nodes())
        finally:
            ray.shutdown()
    plan = plan_from_spec(spec, topo)
    print(plan.to_json() if as_json else plan.to_table())
    return EXIT_OK


def cmd_ckpt(args: argparse.Namespace) -> int:
    from elastic.checkpoint.cli import ckpt_list, ckpt_verify

    if args.ckpt_command == "list":
        return ckpt_list(args.uri, args.json)
    if args.ckpt_command == "export":
        from elastic.checkpoint.export import ckpt_export
        from jobs.spec import JobSpec

        model = JobSpec.from_yaml(args.spec).model if args.spec else None  # the user's own model, never the manifest's
        return ckpt_export(args.uri, args.step, args.fmt, args.out, args.dtype, args.max_shard_size, model)
    return ckpt_verify(args.uri, args.step)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
