"""The three figures of ``elastic simulate --out`` (matplotlib, written headless)."""

from __future__ import annotations

import os

from elastic.simulator import model

SCALES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000)
COLORS = {"inplace": "tab:blue", "restart": "tab:red"}
LABELS = {"inplace": "inplace (ours: shrink, peer memory, grow back)", "restart": "restart (Ray Train / TorchElastic)"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_all(args, job: model.Job, sc: model.Scenario, out: dict, events, reaction) -> list[str]:
    return [
        ettr_vs_scale(args, job, sc, list(out)),
        ettr_vs_interval(args, job, sc, out, events, reaction),
        timeline(args, job, sc, out),
    ]


def ettr_vs_scale(args, job: model.Job, sc: model.Scenario, strategies: list[str]) -> str:
    from dataclasses import replace

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in strategies:
        xs, ys, gs = [], [], []
        for gpus in SCALES:
            j = replace(job, gpus=gpus, global_batch=None if job.global_batch is None else job.global_batch)
            if j.max_dp < 1:
                continue
            costs = model.strategy_costs(s, j, args.step_s)
            reaction = model.Reaction(j)
            events = model.cluster_events(j, sc)
            if args.ckpt_interval_s == "auto":
                interval, _ = model.best_interval(j, sc, costs, s, events, reaction)
            else:
                interval = args.ckpt_interval_s
            res = model.simulate(j, sc, costs, s, interval, events, reaction)
            xs.append(gpus)
            ys.append(res.ettr)
            gs.append(res.goodput)
        ax.plot(xs, ys, "o-", color=COLORS[s], label=f"{LABELS[s]}: ETTR")
        ax.plot(xs, gs, "x:", color=COLORS[s], label=f"{s}: goodput (work at full-DP rate)")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("fraction of wall-clock time")
    ax.set_title(
        f"ETTR vs scale: {sc.failure_rate:g} node failures per 1,000 node-days, {sc.days:g} days, "
        f"tp={job.tp} pp={job.pp}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    return _save(fig, plt, args.out, "ettr_vs_scale.png")


def ettr_vs_interval(args, job, sc, out: dict, events, reaction) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, (_res, p, curve) in out.items():
        if not curve:
            costs = _costs(args, s, job)
            _, curve = model.best_interval(job, sc, costs, s, events, reaction)
        xs, ys = zip(*curve)
        ax.plot(xs, ys, "-", color=COLORS[s], label=f"{LABELS[s]} (simulated)")
        best = max(curve, key=lambda c: c[1])
        ax.plot([best[0]], [best[1]], "*", color=COLORS[s], markersize=14, label=f"{s} optimum: {best[0]:.0f} s")
        if s == "restart":
            u0 = p["u0_s"]
            cf = [
                model.closed_form_ettr(p["nodes"], p["failure_rate_per_node_s"], u0, x, p["ckpt_blocking_s"])
                for x in xs
            ]
            ax.plot(xs, cf, "--", color="gray", label="restart, Meta's closed form (arXiv 2410.21680)")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)  # the closed form goes negative where N r (u0 + dt/2) > 1: outside its range
    ax.set_xlabel("storage checkpoint interval (training seconds)")
    ax.set_ylabel("ETTR")
    ax.set_title(f"ETTR vs checkpoint interval at {job.gpus} GPUs, {sc.failure_rate:g} per 1,000 node-days", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    return _save(fig, plt, args.out, "ettr_vs_interval.png")


def _costs(args, s, job):
    return model.strategy_costs(s, job, args.step_s)


def timeline(args, job, sc, out: dict) -> str:
    plt = _plt()
    week = min(7.0, sc.days) * model.DAY
    fig, axes = plt.subplots(len(out), 1, figsize=(9, 2.6 * len(out)), sharex=True, squeeze=False)
    for ax, (s, (res, _p, _)) in zip(axes[:, 0], out.items()):
        pts = [(t, d) for t, d in res.timeline if t <= week] + [(week, model.dp_at(res.timeline, week))]
        xs = [t / 3600 for t, _ in pts]
        ax.step(xs, [d for _, d in pts], where="post", color=COLORS[s], label=f"{s}: DP (0 = not training)")
        hits = [t / 3600 for t, _, hit in res.failure_marks if hit and t <= week]
        idle = [t / 3600 for t, _, hit in res.failure_marks if not hit and t <= week]
        top = max(d for _, d in pts) or 1
        ax.plot(hits, [top * 1.05] * len(hits), "v", color="black", markersize=4, label="failure of a job node")
        ax.plot(idle, [top * 1.05] * len(idle), "v", color="lightgray", markersize=4, label="failure of a spare node")
        ax.set_ylabel("DP (replicas)")
        ax.set_ylim(0, top * 1.15)
        ax.set_title(f"{s}: ETTR {res.ettr:.4f} over {sc.days:g} days; first week shown", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (hours)")
    return _save(fig, plt, args.out, "timeline.png")


def _save(fig, plt, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
